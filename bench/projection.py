"""Bytes read per decode step of Ling-3.0-flash INT4, counted from config.json, and what that allows on GB10.

Decode at batch 1 is memory-bound: every step streams the active weights once (plus the KDA states, read and
written, and the MLA KV cache). Tokens/s ≤ bandwidth / bytes-per-step; with MTP k=1 one verify step reads
the same weights for 2 tokens plus the draft layer and yields 1 + acceptance tokens. This is a projection
from arithmetic, not a measurement.

    python -m ling_bench.projection [--config config.json] [--context 4096] [--bandwidth-gbs 273]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

BF16, FP32 = 2, 4
INT4_GROUP_BYTES = 32 // 2 + 2  # 32 int4 weights (16 B) + one bf16 scale per group of 32


@dataclass
class StepBytes:
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def _linear(out_f: int, in_f: int, nbytes: int = BF16) -> int:
    return out_f * in_f * nbytes


def _int4_expert(c: dict) -> float:
    h, i = c["hidden_size"], c["moe_intermediate_size"]
    return 3 * h * i / 32 * INT4_GROUP_BYTES  # gate, up, down


def _experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens of uniform top-k routing."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def _mla(c: dict) -> int:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, r = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    return (_linear(heads * (nope + rope), h) + _linear(r + rope, h) + _linear(heads * (nope + v), r)
            + _linear(heads, h) + _linear(h, heads * v))


def _moe(c: dict, tokens: int) -> float:
    h = c["hidden_size"]
    shared = 3 * h * c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"] * BF16
    router = _linear(c["num_experts"], h, FP32)
    return router + shared + _experts_touched(c["num_experts"], c["num_experts_per_tok"], tokens) * _int4_expert(c)


def decode_step_bytes(c: dict, context: int, tokens: int = 1, mtp: bool = False) -> StepBytes:
    """Bytes one forward step over `tokens` new tokens of one sequence reads (KDA states: read + write)."""
    h, heads, n = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    d, g = c["head_dim"], c["layer_group_size"]
    p = heads * d
    mla_layers = sum(1 for i in range(n) if (i + 1) % g == 0 or i >= n // g * g)
    kda_layers = n - mla_layers
    dense_layers = c["first_k_dense_replace"]
    kda = 5 * _linear(p, h) + _linear(h, p) + _linear(heads, h) + 3 * p * c["short_conv_kernel_size"] * FP32
    parts = {
        "KDA weights": kda_layers * kda,
        "KDA state (read + write)": kda_layers * 2 * heads * d * d * FP32,
        "MLA weights": mla_layers * _mla(c),
        "MLA KV cache": mla_layers * context * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16,
        "dense MLPs": dense_layers * 3 * h * c["intermediate_size"] * BF16,
        "MoE (router, shared, routed INT4)": (n - dense_layers) * _moe(c, tokens),
        "lm_head": _linear(c["vocab_size"], h),
    }
    if mtp:  # the draft: eh_proj + one MLA + one MoE layer, its own KV cache, and the shared lm_head again
        parts["MTP draft"] = (_linear(h, 2 * h) + _mla(c) + _moe(c, 1) + _linear(c["vocab_size"], h)
                              + context * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16)
    return StepBytes(parts)


def project(c: dict, context: int, bandwidth_gbs: float, efficiency: float, acceptance: float) -> dict:
    plain = decode_step_bytes(c, context)
    verify = decode_step_bytes(c, context, tokens=2, mtp=True)
    bw = bandwidth_gbs * 1e9 * efficiency
    return {
        "plain_step_gb": plain.total / 1e9,
        "plain_tok_s": bw / plain.total,
        "mtp_step_gb": verify.total / 1e9,
        "mtp_tok_s": bw / verify.total * (1 + acceptance),
        "parts_gb": {k: v / 1e9 for k, v in plain.parts.items()},
    }


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parents[1] / "vllm_ling" / "configs" / "ling-3.0-flash-int4" / "config.json"
    ap = argparse.ArgumentParser(prog="python -m ling_bench.projection", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=here)
    ap.add_argument("--context", type=int, default=4096, help="tokens already in the sequence")
    ap.add_argument("--bandwidth-gbs", type=float, default=273.0, help="GB10: 273")
    ap.add_argument("--efficiency", type=float, default=0.7, help="share of peak bandwidth reached (ops-facts W11: 70%%)")
    ap.add_argument("--acceptance", type=float, default=0.94, help="MTP k=1 acceptance (3P: 94%%)")
    a = ap.parse_args(argv)
    r = project(json.loads(a.config.read_text()), a.context, a.bandwidth_gbs, a.efficiency, a.acceptance)
    print(f"PROJECTION (arithmetic, not a measurement) at context {a.context}, {a.bandwidth_gbs:.0f} GB/s x {a.efficiency:.0%}:")
    for k, v in r["parts_gb"].items():
        print(f"  {k:<36} {v:6.3f} GB")
    print(f"  plain decode step {r['plain_step_gb']:.2f} GB -> {r['plain_tok_s']:.1f} tok/s")
    print(f"  MTP k=1 verify step {r['mtp_step_gb']:.2f} GB, {1 + a.acceptance:.2f} tokens -> {r['mtp_tok_s']:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
