"""What vllm-ling needs from vLLM, as one table, checked by reading vLLM's source (docs/vllm-seams.md §New releases).

Each seam names a module and what the plugin uses in it: top-level names it imports, class members it calls,
parameters it passes by keyword, dataclass/config fields it reads. `missing()` parses only the files the table
names (no vLLM import, no CUDA, well under a second), so registration can check a release the plugin has not
been tested on, and `python -m ling_tools.seams` can check one before it is installed.

Stdlib only: this module runs before vLLM is imported and must not import the rest of the plugin.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Seam:
    """`modules`: where to look, any one of them (a module moved between releases). `owner`: None for top-level
    names, "Class" for its members or fields, "function" or "Class.method" for parameters. `names`: each one
    needed; "A|B" accepts either spelling. `fallback`: None = needed; else what the plugin does without it."""

    kind: str  # "module" | "names" | "members" | "fields" | "params"
    modules: tuple[str, ...]
    owner: str | None = None
    names: tuple[str, ...] = ()
    fallback: str | None = None


def _seam(kind: str, modules: str | tuple[str, ...], owner: str | None, names: str, fallback: str | None = None):
    return Seam(kind, (modules,) if isinstance(modules, str) else modules, owner, tuple(names.split()), fallback)


def module(path: str, fallback: str | None = None) -> Seam:
    return _seam("module", path, None, "", fallback)


def names(path: str | tuple[str, ...], these: str, fallback: str | None = None) -> Seam:
    return _seam("names", path, None, these, fallback)


def members(path: str, cls: str, these: str, fallback: str | None = None) -> Seam:
    return _seam("members", path, cls, these, fallback)


def fields(path: str, cls: str, these: str) -> Seam:
    return _seam("fields", path, cls, these)


def params(path: str, func: str, these: str, fallback: str | None = None) -> Seam:
    return _seam("params", path, func, these, fallback)


L = "vllm.model_executor.layers."
MAMBA = L + "mamba.mamba_utils"
KDA_GATE = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"  # compat.KDA_GATE_KERNELS
HUMMING_ACTIVATION = L + "quantization.utils.humming.activation"  # compat._HUMMING_ACTIVATION

# What vllm_ling/ imports from vLLM (`from vllm...`), plus what compat probes and what the model reads from
# vLLM's objects by name. Read from the plugin's source; checked against 0.32 (CPU), 0.33 and 0.34 (CUDA).
SEAMS: tuple[Seam, ...] = (
    # plugin.py, parsers/__init__.py: registration
    names("vllm", "ModelRegistry"),
    names("vllm.envs", "environment_variables", fallback="vLLM logs the plugin's VLLM_LING_* variables as unknown"),
    names("vllm.reasoning", "ReasoningParserManager"),
    names("vllm.tool_parsers", "ToolParserManager"),
    # model.py, mtp.py, mla.py, kda.py, moe.py: the model
    names("vllm.compilation.decorators", "support_torch_compile"),
    names("vllm.config", "VllmConfig SpeculativeConfig get_current_vllm_config get_current_vllm_config_or_none"),
    fields("vllm.config.vllm", "VllmConfig", "model_config cache_config parallel_config quant_config "
           "speculative_config additional_config scheduler_config"),
    fields("vllm.config.cache", "CacheConfig", "mamba_cache_dtype"),
    fields("vllm.config.parallel", "ParallelConfig", "tensor_parallel_size"),
    fields("vllm.config.speculative", "SpeculativeConfig", "num_speculative_tokens draft_model_config "
           "use_local_argmax_reduction"),
    names("vllm.distributed", "get_tensor_model_parallel_rank get_tensor_model_parallel_world_size "
          "tensor_model_parallel_all_reduce"),
    names("vllm.forward_context", "get_forward_context"),
    fields("vllm.forward_context", "ForwardContext", "no_compile_layers attn_metadata"),
    names("vllm.model_executor.custom_op", "CustomOp"),
    params("vllm.model_executor.custom_op", "CustomOp.__init__", "compile_native"),
    names(L + "activation", "SiluAndMul SwigluStepAndMul"),
    names(L + "attention", "Attention"),
    names(L + "fused_moe", "GateLinear fused_moe_make_expert_params_mapping FusedMoEFactory"),
    params(L + "fused_moe.layer", "FusedMoEFactory", "shared_experts num_experts top_k hidden_size "
           "intermediate_size renormalize quant_config prefix scoring_func swiglu_limit use_grouped_topk "
           "num_expert_group topk_group routed_scaling_factor e_score_correction_bias custom_routing_function "
           "router_logits_dtype activation"),
    names(L + "layernorm", "RMSNorm RMSNormGated"),
    names(L + "linear", "ColumnParallelLinear LinearBase MergedColumnParallelLinear ReplicatedLinear "
          "RowParallelLinear UnquantizedLinearMethod"),
    names(L + "logits_processor", "LogitsProcessor"),
    names(L + "mamba.abstract", "MambaBase"),
    names(MAMBA, "MambaStateCopyFuncCalculator MambaStateDtypeCalculator MambaStateShapeCalculator "
          "is_conv_state_dim_first"),
    members(MAMBA, "MambaStateShapeCalculator", "_orient_conv_shape"),
    members(MAMBA, "MambaStateDtypeCalculator", "kda_state_dtype"),
    members(MAMBA, "MambaStateCopyFuncCalculator", "kda_state_copy_func"),
    names(L + "mamba.ops.causal_conv1d", "causal_conv1d_fn causal_conv1d_update"),
    # kda.py, kda_core.py, compat.py: in-prefill KDA checkpoints (VLLM_LING_KDA_PREFILL_CHECKPOINT)
    names(L + "mamba.kda_checkpoint", "kda_prefill_checkpoint_alignment FlashKDAPrefillCheckpointExporter"),
    fields("vllm.v1.kv_cache_interface", "MambaSpec", "num_prefill_checkpoint_blocks prefill_checkpoint_alignment"),
    fields("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata", "checkpoint"),
    names(L + "mla", "MLAModules MultiHeadLatentAttentionWrapper"),
    fields(L + "mla", "MLAModules", "kv_a_layernorm kv_b_proj rotary_emb o_proj fused_qkv_a_proj "
           "kv_a_proj_with_mqa q_a_layernorm q_b_proj q_proj indexer is_sparse topk_indices_buffer"),
    names(L + "rotary_embedding", "get_rope"),
    names(L + "vocab_parallel_embedding", "ParallelLMHead UnquantizedEmbeddingMethod VocabParallelEmbedding"),
    names("vllm.model_executor.model_loader.weight_utils", "default_weight_loader sharded_weight_loader"),
    names("vllm.model_executor.models.interfaces", "HasInnerState IsHybrid"),
    # model.py, dspark.py, compat.py: DSpark (the target's aux hidden states, Ling's drafter on vLLM's Qwen3 DSpark)
    names("vllm.model_executor.models.interfaces", "EagleModelMixin SupportsEagle3"),
    names("vllm.model_executor.models.qwen3_dspark", "Qwen3DSparkForCausalLM"),
    members("vllm.config.speculative", "SpeculativeConfig", "hf_config_override"),
    # fp8.py, dspark.py: the drafter's own quantization (the speculative config's; vLLM hands the quantization
    # config the drafter's hf_config, which carries dspark_draft_topk)
    fields("vllm.config.speculative", "SpeculativeConfig", "quantization dspark_draft_topk"),
    params(L + "quantization.base_config", "QuantizationConfig.maybe_update_config", "model_name hf_config revision"),
    names("vllm.model_executor.models.utils", "WeightsMapper maybe_prefix"),
    names("vllm.model_executor.utils", "set_weight_attrs"),
    names("vllm.platforms", "current_platform"),
    names("vllm.triton_utils", "tl triton"),
    names("vllm.utils.torch_utils", "direct_register_custom_op"),
    names("vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum"),
    members("vllm.v1.attention.backends.registry", "MambaAttentionBackendEnum", "GDN_ATTN"),
    fields("vllm.v1.attention.backends.gdn_attn", "GDNAttentionMetadata", "num_prefills num_decodes "
           "num_spec_decodes num_actual_tokens has_initial_state spec_query_start_loc non_spec_query_start_loc "
           "spec_state_indices_tensor non_spec_state_indices_tensor spec_sequence_masks spec_token_indx "
           "non_spec_token_indx num_accepted_tokens"),
    # kda_core.py, smem_guard.py: KDA kernels
    names("vllm.third_party.flash_linear_attention.ops.kda", "chunk_kda fused_recurrent_kda fused_recurrent_kda_fwd"),
    names(KDA_GATE, "fused_recurrent_kda_packed_decode fused_recurrent_kda chunk_kda_with_fused_gate"),
    params(KDA_GATE + ".fused_recurrent", "fused_recurrent_kda", "raw_g raw_beta A_log dt_bias lower_bound "
           "initial_state cu_seqlens ssm_state_indices num_accepted_tokens out"),
    params(KDA_GATE + ".fused_recurrent", "fused_recurrent_kda_packed_decode", "mixed_qkv raw_g raw_beta A_log "
           "dt_bias lower_bound initial_state state_indices out"),
    params(KDA_GATE + ".chunk", "chunk_kda_with_fused_gate", "raw_g raw_beta A_log g_bias lower_bound scale "
           "initial_state output_final_state use_qk_l2norm_in_kernel cu_seqlens"),
    # flashkda.py (compat): FlashKDA's prefill, --kda-prefill-backend, vLLM's scratch for its workspace
    _seam("fields", "vllm.engine.arg_utils", "EngineArgs", "kda_prefill_backend",
          "--kda-prefill-backend does not exist: the KDA prefill serves as under auto"),
    fields("vllm.config.scheduler", "SchedulerConfig", "max_num_batched_tokens max_num_seqs"),
    names("vllm.v1.worker.workspace", "current_workspace_manager is_workspace_manager_initialized",
          "FlashKDA's workspace is allocated at each prefill, not reserved before the KV cache is sized"),
    # ops/: MoE alignment, router GEMM
    names("vllm._custom_ops", "moe_align_block_size gptq_marlin_moe_repack"),
    params("vllm._custom_ops", "gptq_marlin_moe_repack", "b_q_weight size_k size_n num_bits"),
    # fp8.py: --quantization ling_fp8
    names(L + "quantization", "get_quantization_config register_quantization_config"),
    names(L + "quantization.base_config", "QuantizationConfig QuantizeMethodBase"),
    names(L + "quantization.online.fp8", "Fp8PtpcOnlineLinearMethod Fp8PerBlockOnlineLinearMethod"),
    names("vllm.model_executor.kernels.linear", "init_fp8_linear_kernel"),
    names("vllm.model_executor.kernels.linear.scaled_mm", "MarlinFP8ScaledMMLinearKernel"),
    names("vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel", "Fp8BlockScaledMMLinearKernel"),
    # parsers/ling3.py and the protocol it builds (compat.openai_protocol, compat.make_tool_call_id)
    names("vllm.parser.engine.adapters", "ParserEngineReasoningAdapter"),
    names("vllm.parser.engine.parser_engine_config", "ParserEngineConfig"),
    names("vllm.parser.glm47_moe", "Glm47MoeParser glm47_moe_config"),
    names("vllm.tool_parsers.abstract_tool_parser", "ToolParser"),
    names("vllm.tokenizers", "TokenizerLike"),
    names("vllm.entrypoints.generate.base.protocol",
          "DeltaMessage DeltaToolCall ToolCall ExtractedToolCallInformation FunctionCall"),
    names("vllm.renderers.chat_utils", "make_tool_call_id"),
    # compat.py: logging set-up (ling_bench's capture), and what it probes and works without
    names("vllm.config.logging", "LoggingConfig"),
    names("vllm.logger", "configure_logging_if_needed"),
    names("vllm.transformers_utils.config", "_CONFIG_REGISTRY", "AutoConfig.register alone (works on every release)"),
    names(HUMMING_ACTIVATION, "get_humming_activation", "Humming's swiglustep keeps its own limit 7: serve INT4 "
          "experts with --moe-backend marlin or triton"),
    module("vllm.model_executor.models.bailing_moe_v3", "our model serves (no in-tree Ling V3 to choose)"),
)


def vllm_root() -> Path | None:
    """The folder holding the installed `vllm/` package, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]).parent if locations else None


def _file(root: Path, dotted: str) -> Path | None:
    base = root.joinpath(*dotted.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=256)
def _parse(path: Path, mtime: float) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _tree(root: Path, dotted: str) -> tuple[Path | None, ast.Module | None]:
    path = _file(root, dotted)
    return (path, _parse(path, path.stat().st_mtime)) if path else (None, None)


def _statements(body: list[ast.stmt]):
    """Statements of a body, looking into if/try/with blocks (TYPE_CHECKING imports, optional imports)."""
    for node in body:
        yield node
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, block, None):
                yield from _statements(getattr(node, block))
        for handler in getattr(node, "handlers", []):
            yield from _statements(handler.body)


def _defined(body: list[ast.stmt]) -> set[str]:
    """Names a module or class body binds: defs, classes, assignments, annotated fields, imports."""
    out: set[str] = set()
    for node in _statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
    return out


def _exported(root: Path, dotted: str, depth: int = 0) -> set[str]:
    """A module's top-level names, with what its `from .x import *` lines bring in (vllm.distributed)."""
    path, tree = _tree(root, dotted)
    if tree is None:
        return set()
    out = _defined(tree.body)
    package = dotted if path is not None and path.name == "__init__.py" else dotted.rpartition(".")[0]
    for node in _statements(tree.body):
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) and depth < 3:
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(x for x in (base, node.module) if x)
            out |= {n for n in _exported(root, source, depth + 1) if not n.startswith("_")}
    return out


def _lazy(tree: ast.Module) -> set[str]:
    """Names a module exports through a module-level `__getattr__`: every string constant in it (its table of
    lazy attributes, or `__all__`). Only counted when the module defines `__getattr__`."""
    if "__getattr__" not in _defined(tree.body):
        return set()
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in _statements(tree.body) if isinstance(n, ast.ClassDef) and n.name == name), None)


def _function(tree: ast.Module, dotted: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    *cls, func = dotted.split(".")
    body = tree.body
    if cls:
        owner = _class(tree, cls[0])
        if owner is None:
            return None
        body = owner.body
    return next((n for n in _statements(body)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func), None)


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = func.args
    return {p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs]}


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in _statements(cls.body) if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def _have(root: Path, seam: Seam, dotted: str) -> tuple[set[str], str | None]:
    """(what `dotted` offers for this seam, or why nothing): its names, members, fields or parameters."""
    path, tree = _tree(root, dotted)
    if path is None:
        return set(), f"no module {dotted}"
    if tree is None:
        return set(), f"{dotted} does not parse"
    if seam.kind == "module":
        return set(), None
    if seam.kind == "names":
        subs = {p.stem for p in path.parent.glob("*.py")} | {p.name for p in path.parent.iterdir() if p.is_dir()}
        return _exported(root, dotted) | _lazy(tree) | (subs if path.name == "__init__.py" else set()), None
    if seam.kind == "params":
        func = _function(tree, seam.owner or "")
        return (_params(func), None) if func else (set(), f"no {seam.owner} in {dotted}")
    cls = _class(tree, seam.owner or "")
    if cls is None:
        return set(), f"no class {seam.owner} in {dotted}"
    return (_fields(cls) if seam.kind == "fields" else _defined(cls.body)), None


def _gaps(root: Path, seam: Seam, dotted: str) -> list[str]:
    """What `dotted` lacks of this seam, one line each; [] when it has all of it."""
    have, why = _have(root, seam, dotted)
    if why:
        return [why]
    label = {"names": "{}", "members": f"{seam.owner}.{{}}", "fields": f"field {seam.owner}.{{}}",
             "params": f"parameter {seam.owner}({{}})"}.get(seam.kind, "{}")
    return [f"{dotted}: " + label.format(" or ".join(n.split("|"))) for n in seam.names
            if not set(n.split("|")) & have]


def check(seam: Seam, root: Path) -> list[str]:
    """What the vLLM source under `root` lacks of this seam, one readable line each; [] when one of its modules
    has all of it."""
    tries = [_gaps(root, seam, m) for m in seam.modules]
    if any(not gaps for gaps in tries):
        return []
    lines = tries[0] if len(tries) == 1 else [" | ".join("; ".join(g) for g in tries) + " (needs one of these)"]
    return [f"{line} (without it: {seam.fallback})" if seam.fallback else line for line in lines]


def missing(root: Path | None = None, optional: bool = False) -> list[str]:
    """One line per seam the vLLM source under `root` (a folder holding `vllm/`) lacks; None = the installed
    vLLM. Only needed seams unless `optional`, which lists the ones the plugin works without, instead."""
    root = root if root is not None else vllm_root()
    if root is None or not (root / "vllm").is_dir():
        return [f"no vllm/ source tree under {root}" if root else "vLLM is not installed"]
    return [line for seam in SEAMS if (seam.fallback is not None) == optional for line in check(seam, root)]
