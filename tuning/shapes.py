"""The MoE problem a tuned file is for: shapes from a model config, and the batch sizes to tune.

vLLM keys its tuned MoE files on (E, N, device, dtype) where N is the per-TP-shard expert width,
i.e. the K of the down projection (`try_get_optimal_moe_config` doubles the packed w2 width for
int4). The kernel path depends on M: vLLM runs the CUDA `moe_wna16_gemm` while
M·top_k / E <= 6 (`should_moe_wna16_use_cuda`), and the Triton `fused_moe_kernel_gptq_awq` above.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# vLLM's benchmark_moe.py default batch sizes; we add the Spark recipe's prefill chunk (8192).
VLLM_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)


@dataclass(frozen=True)
class MoEShape:
    """One MoE layer's expert GEMMs: x[M, hidden] -> w13 [E, 2N, hidden] -> SwiGLU -> w2 [E, hidden, N]."""

    num_experts: int
    intermediate: int  # N in vLLM's file name: per-shard expert width
    hidden: int
    top_k: int
    group_size: int
    weight_bits: int = 4

    def __post_init__(self) -> None:
        for name in ("num_experts", "intermediate", "hidden", "top_k", "group_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.weight_bits != 4:
            raise ValueError(
                f"weight_bits={self.weight_bits}: this tuner covers int4_w4a16 only "
                "(vLLM's wna16 kernels); use vLLM's benchmark_moe.py for other dtypes"
            )
        for k in (self.hidden, self.intermediate):
            if k % self.group_size:
                raise ValueError(f"K={k} is not a multiple of group_size={self.group_size}")

    @property
    def dtype(self) -> str:
        return "int4_w4a16"

    @property
    def gemm_ks(self) -> tuple[int, int]:
        """Reduction sizes of the two GEMMs (w13 reads hidden, w2 reads N); a K tile must fit both."""
        return self.hidden, self.intermediate

    @property
    def cuda_max_tokens(self) -> int:
        """Largest M that vLLM sends to the CUDA moe_wna16 kernel: M·top_k <= 6·E."""
        return 6 * self.num_experts // self.top_k

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert streams: 3·N·hidden int4 weights + one bf16 scale per group."""
        elems = 3 * self.intermediate * self.hidden
        return elems * self.weight_bits // 8 + elems // self.group_size * 2

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


PRESETS: dict[str, MoEShape] = {
    # Ling-3.0-flash-int4 (docs/architecture.md §Config, §INT4): 512 experts of width 768, top-8, g32.
    "ling-3.0-flash": MoEShape(num_experts=512, intermediate=768, hidden=2560, top_k=8, group_size=32),
}


def _first(cfg: dict[str, Any], *names: str) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    raise KeyError(f"config has none of {names}")


def _quant_scheme(cfg: dict[str, Any]) -> tuple[int, int]:
    """(bits, group) from compressed-tensors `config_groups` or a GPTQ/AWQ-style flat config."""
    q = cfg.get("quantization_config")
    if not q:
        raise ValueError(
            "config has no quantization_config: the model is not INT4, so vLLM would not use the "
            "int4_w4a16 MoE kernels this tuner measures (pass the INT4 checkpoint's config)"
        )
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") is not None:
            return int(w["num_bits"]), int(w.get("group_size") or -1)
    return int(_first(q, "bits", "w_bit", "num_bits")), int(_first(q, "group_size", "q_group_size"))


def shape_from_config(cfg: dict[str, Any], tp: int = 1) -> MoEShape:
    """Read E, N, hidden, top-k, group from an HF config.json dict (text_config for VL wrappers)."""
    cfg = cfg.get("text_config") or cfg
    inter = int(_first(cfg, "moe_intermediate_size", "intermediate_size"))
    if inter % tp:
        raise ValueError(f"moe_intermediate_size={inter} does not split over tp={tp}")
    bits, group = _quant_scheme(cfg)
    if group <= 0:
        raise ValueError(f"group_size={group}: channel-wise int4 is not a wna16 group scheme")
    return MoEShape(
        num_experts=int(_first(cfg, "num_experts", "n_routed_experts", "num_local_experts")),
        intermediate=inter // tp,
        hidden=int(cfg["hidden_size"]),
        top_k=int(_first(cfg, "num_experts_per_tok", "num_experts_per_token", "moe_topk")),
        group_size=group,
        weight_bits=bits,
    )


def bundled_config_path() -> Path:
    """The full-size Ling-3.0-flash-int4 config.json shipped with the plugin as package data (vllm_ling.configs,
    the one locator; importing it imports no vLLM)."""
    from vllm_ling.configs import FLASH_INT4_DIR

    return FLASH_INT4_DIR / "config.json"


def resolve_model(model: str, tp: int = 1) -> tuple[MoEShape, str]:
    """`model` is a preset name, a config.json, or a checkpoint folder; returns (shape, source). The one preset
    is read from the bundled config, so tp splits it like any config."""
    if model in PRESETS:
        bundled = bundled_config_path()
        return shape_from_config(json.loads(bundled.read_text()), tp), str(bundled)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"--model {model!r}: no such config.json or checkpoint folder; "
            f"use a path or one of the presets {sorted(PRESETS)}"
        )
    return shape_from_config(json.loads(path.read_text()), tp), str(path)


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of batch sizes, sorted and deduplicated (an argparse type: bad input names the rule)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be integers >= 1")
    return values


def default_batch_sizes(max_tokens: int) -> list[int]:
    """vLLM's tuning grid up to max-num-batched-tokens, plus that maximum (the prefill chunk)."""
    if max_tokens < 1:
        raise ValueError(f"max_num_batched_tokens={max_tokens} must be >= 1")
    return sorted({m for m in VLLM_BATCH_SIZES if m <= max_tokens} | {max_tokens})
