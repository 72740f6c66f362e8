"""Bytes one batch-1 decode step of Ling-3.0-flash INT4 reads, and the tokens/s that allows on GB10.

A projection from arithmetic, not a measurement. Decode at batch 1 is memory-bound: a step streams every
weight matrix its tokens use once (the routed experts they pick, every other matrix whole), the KDA states
(read and written) and the MLA KV cache, so tokens/s <= bandwidth / bytes-per-step. An MTP k=1 verify step
reads the weights for 2 tokens plus the draft layer and yields 1 + acceptance tokens. The matrices come
from the checkpoint's tensor table (`ling_tools.tensors`); 1-D tensors (norms, A_log, dt_bias, expert_bias:
about 1 MB a step) and the embedding (one row) are left out.

Two weight formats. `bf16` is what is served today: routed experts INT4 (4 bits + a bf16 scale per 32),
router fp32, KDA conv fp32, everything else BF16. `fp8` is `--quantization ling_fp8` (docs/speed.md §FP8):
every BF16 matrix read as FP8 (1 byte) plus one fp32 scale per output channel, except MLA kv_b_proj (vLLM's
MLA absorbs it into W_UK/W_UV) and the draft's eh_proj, which stay BF16 (`vllm_ling.fp8.KEEP_BF16`);
experts, router and conv are as in `bf16`.

    python -m ling_bench.projection [--config config.json] [--context 4096] [--acceptance 0.94,0.70]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from vllm_ling.config import is_mla_layer, is_moe_layer, kda_head_dim, num_mtp_layers
from vllm_ling.configs import FLASH_INT4_DIR
from ling_tools.tensors import TensorSpec, layer_tensors, tensor_specs

BF16, FP8, FP32 = 2, 1, 4
INT4_GROUP, INT4_GROUP_BYTES = 32, 32 // 2 + 2  # 32 int4 weights (16 B) + one bf16 scale
FORMATS = ("bf16", "fp8")
STAYS_BF16 = ("attention.kv_b_proj.weight", "eh_proj.weight")  # under fp8, as vllm_ling.fp8 serves it


@dataclass
class StepBytes:
    parts: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def matrix_bytes(name: str, spec: TensorSpec, fp8: bool = False) -> float:
    """Bytes a step reads of one weight matrix, as served."""
    if spec.kind == "expert":
        return spec.numel / INT4_GROUP * INT4_GROUP_BYTES
    if spec.kind in ("router", "fp32"):  # vLLM holds the router in fp32, whatever the checkpoint stores
        return spec.numel * FP32
    if fp8 and not name.endswith(STAYS_BF16):
        return spec.numel * FP8 + spec.shape[0] * FP32  # + per-output-channel fp32 scales
    return spec.numel * BF16


def experts_touched(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens of uniform top-k routing."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def _weights(c: dict, layer: int, prefix: str, tokens: int, fp8: bool) -> float:
    """Bytes of layer `layer`'s matrices under `prefix` (`attention.`, `mlp.`, `eh_proj`); routed experts
    count as the share of them that `tokens` tokens touch."""
    specs = {k: s for k, s in layer_tensors(c, layer).items() if k.startswith(prefix) and len(s.shape) > 1}
    dense = sum(matrix_bytes(k, s, fp8) for k, s in specs.items() if s.kind != "expert")
    routed = sum(matrix_bytes(k, s, fp8) for k, s in specs.items() if s.kind == "expert")
    if routed:
        e = c["num_experts"]
        routed *= experts_touched(e, c["num_experts_per_tok"], tokens) / e
    return dense + routed


def decode_step_bytes(c: dict, context: int, tokens: int = 1, mtp: bool = False, fp8: bool = False,
                      draft_vocab: int | None = None) -> StepBytes:
    """Bytes one forward step over `tokens` new tokens of one sequence reads; with `mtp`, plus the draft
    layer(s) on one token: eh_proj, MLA, MoE, their own KV cache and the shared lm_head again, or only its
    `draft_vocab` rows (and their scales) with a draft vocabulary (vllm_ling/draft/vocab.py)."""
    n, heads, d = c["num_hidden_layers"], c["num_attention_heads"], kda_head_dim(c)
    kv_row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16  # one token's MLA latent + k_pe
    mla = [i for i in range(n) if is_mla_layer(c, i)]
    kda = [i for i in range(n) if not is_mla_layer(c, i)]
    moe = [i for i in range(n) if is_moe_layer(c, i)]
    dense = [i for i in range(n) if not is_moe_layer(c, i)]
    lm_head = matrix_bytes("lm_head.weight", tensor_specs(c)["lm_head.weight"], fp8)
    parts = {
        "KDA weights": sum(_weights(c, i, "attention.", tokens, fp8) for i in kda),
        "KDA state (read + write)": len(kda) * 2 * heads * d * d * FP32,
        "MLA weights": sum(_weights(c, i, "attention.", tokens, fp8) for i in mla),
        "MLA KV cache": len(mla) * context * kv_row,
        "dense MLPs": sum(_weights(c, i, "mlp.", tokens, fp8) for i in dense),
        "MoE (router, shared, routed INT4)": sum(_weights(c, i, "mlp.", tokens, fp8) for i in moe),
        "lm_head": lm_head,
    }
    if mtp:
        draft_head = lm_head * min(draft_vocab or c["vocab_size"], c["vocab_size"]) / c["vocab_size"]
        parts["MTP draft"] = sum(_weights(c, i, "", 1, fp8) + draft_head + context * kv_row
                                 for i in range(n, n + num_mtp_layers(c)))
    return StepBytes(parts)


def project(c: dict, context: int, bandwidth_gbs: float, efficiency: float, acceptance: float,
            fp8: bool = False, draft_vocab: int | None = None) -> dict:
    plain = decode_step_bytes(c, context, fp8=fp8)
    verify = decode_step_bytes(c, context, tokens=2, mtp=True, fp8=fp8, draft_vocab=draft_vocab)
    bw = bandwidth_gbs * 1e9 * efficiency
    return {
        "plain_step_gb": plain.total / 1e9,
        "plain_tok_s": bw / plain.total,
        "mtp_step_gb": verify.total / 1e9,
        "mtp_tok_s": bw / verify.total * (1 + acceptance),
        "parts_gb": {k: v / 1e9 for k, v in plain.parts.items()},
    }


def _acceptances(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(0 <= a <= 1 for a in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give acceptance rates in [0, 1], comma-separated")
    return values


def report(c: dict, context: int, bandwidth_gbs: float, efficiency: float, acceptances: list[float],
           draft_vocab: int | None = None) -> str:
    """The table: a plain step's GB by part, both step totals and tok/s, one column per weight format."""
    runs = {f: [project(c, context, bandwidth_gbs, efficiency, a, fp8=f == "fp8", draft_vocab=draft_vocab)
                for a in acceptances] for f in FORMATS}
    first = {f: r[0] for f, r in runs.items()}

    def row(label: str, cells: list[str]) -> str:
        return f"  {label:<44}" + "".join(f"{x:>12}" for x in cells)

    lines = [f"PROJECTION (arithmetic, not a measurement) at context {context}, "
             f"{bandwidth_gbs:.0f} GB/s x {efficiency:.0%}, batch 1"
             + (f", MTP draft over a {draft_vocab}-token draft vocabulary (acceptance as given)" if draft_vocab else "")
             + ":",
             row("GB read per step, by part", ["bf16 today", "fp8"])]
    lines += [row(part, [f"{first[f]['parts_gb'][part]:.3f}" for f in FORMATS]) for part in first["bf16"]["parts_gb"]]
    lines += [row("plain decode step, GB", [f"{first[f]['plain_step_gb']:.2f}" for f in FORMATS]),
              row("MTP k=1 verify step (2 tokens + draft), GB", [f"{first[f]['mtp_step_gb']:.2f}" for f in FORMATS]),
              row("plain decode, tok/s", [f"{first[f]['plain_tok_s']:.1f}" for f in FORMATS])]
    lines += [row(f"MTP k=1 at {a:.0%} acceptance, tok/s", [f"{runs[f][i]['mtp_tok_s']:.1f}" for f in FORMATS])
              for i, a in enumerate(acceptances)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling_bench.projection", description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=FLASH_INT4_DIR / "config.json",
                    help="a config.json (default: the bundled Ling-3.0-flash-int4 one)")
    ap.add_argument("--context", type=int, default=4096, help="tokens already in the sequence")
    ap.add_argument("--bandwidth-gbs", type=float, default=273.0, help="GB10: 273")
    ap.add_argument("--efficiency", type=float, default=0.7,
                    help="share of peak bandwidth reached (70%%, FINDINGS.md §6)")
    ap.add_argument("--acceptance", type=_acceptances, default=[0.94, 0.70],
                    help="MTP k=1 acceptance rates, comma-separated (default 0.94, what Spark owners report, "
                         "and 0.70)")
    ap.add_argument("--draft-vocab", type=int, metavar="N",
                    help="the MTP draft reads only N rows of the LM head (a draft vocabulary); the acceptance you "
                         "give is assumed to hold with it")
    a = ap.parse_args(argv)
    print(report(json.loads(a.config.read_text()), a.context, a.bandwidth_gbs, a.efficiency, a.acceptance,
                 a.draft_vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
