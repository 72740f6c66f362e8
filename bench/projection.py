"""Bytes a batch-1 decode round of Ling-3.0-flash INT4 reads, and the tokens/s that allows on GB10.

A projection from arithmetic, not a measurement. Decode at batch 1 is memory-bound: a forward streams every
weight matrix its tokens use once (the routed experts they pick, every other matrix whole), the KDA states
(read and written) and the MLA KV cache, so a round of speculation that yields AL tokens (the mean accepted
length, bonus token included) runs at

    tok/s = AL x bandwidth x efficiency / bytes per round.

Plain decode: AL = 1, one forward over 1 token. MTP k: k draft steps of the MTP layer, then one verify of k + 1
tokens (`mtp_round_bytes`). DSpark K: one drafter forward over the block, then one verify of K + 1 tokens
(`dspark_round_bytes`). The matrices come from the checkpoint's tensor table (`ling_tools.tensors`) and, for the
DSpark drafter, from the tiny drafter writer's names and shapes scaled to the real drafter (`dspark_config`);
1-D tensors (norms, A_log, dt_bias, expert_bias: about 1 MB a step) and embedding rows are left out. Routing
is taken as uniform (`experts_touched`): tokens of one sequence that share experts make a wide verify cheaper.

Two weight formats. `bf16` is what is served today: routed experts INT4 (4 bits + a bf16 scale per 32),
router fp32, KDA conv fp32, everything else BF16. `fp8` is `--quantization ling_fp8` (docs/speed.md §FP8):
every BF16 matrix read as FP8 (1 byte) plus one fp32 scale per output channel, except MLA kv_b_proj (vLLM's
MLA absorbs it into W_UK/W_UV) and the draft's eh_proj, which stay BF16 (`vllm_ling.fp8.KEEP_BF16`);
experts, router and conv are as in `bf16`. Under `fp8` the DSpark drafter's own matrices (Markov head
included) are counted in FP8 too, as its own `quantization: ling_fp8` serves them (docs/dspark.md §Draft FP8). The
default block scheme's scales (one fp32 per 128 x 128 block) are smaller than the per-channel ones counted here.

    python -m ling_bench.projection [--method plain|mtp|dspark|all] [--k 1,2,3] [--block 4,6,8]
        [--acceptance 0.94,0.70] [--acceptance-length 3.5,3.7,5.3,6.5] [--context 4096] [--lanes 1,2,4,8]
        [--json OUT]
    python -m ling_bench.projection --break-even dspark:8 [--format fp8|bf16] [--draft-format fp8|bf16]

DSpark rows also carry `al_one_rate` / `tok_s_one_rate`: a K-wide block keeping the drafts the card's K = 8 length
came from, at one per-position rate (`narrow_block_length`), a lower estimate beside the capped upper bound.
`--lanes` adds sequences decoding together (`lane_rows`): one step reads every matrix once for all of them, so
lanes share the dense bytes and each adds its routed experts, KDA state and MLA KV. `--break-even METHOD:K` prints
the mean accepted length at which that round and a plain step decode equally fast (round bytes over a plain step's,
`break_even_length`): the serve recipe hands it to the watchdog, whose traffic line warns below it on a Spark.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from vllm_ling.layout import is_mla_layer, is_moe_layer, kda_head_dim, num_mtp_layers
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
                      draft_vocab: int | None = None, draft_steps: int = 1, seqs: int = 1) -> StepBytes:
    """Bytes one forward step over `tokens` new tokens of each of `seqs` sequences reads (every matrix once,
    the routed experts the seqs x tokens tokens touch, each sequence's KDA state and MLA KV at `context`); with
    `mtp`, plus `draft_steps` passes of the draft layer(s) on one token a sequence: eh_proj, MLA, MoE, their own
    KV cache and the shared lm_head again, or only its `draft_vocab` rows (and their scales) with a draft
    vocabulary (vllm_ling/draft/vocab.py)."""
    n, heads, d = c["num_hidden_layers"], c["num_attention_heads"], kda_head_dim(c)
    kv_row = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16  # one token's MLA latent + k_pe
    mla = [i for i in range(n) if is_mla_layer(c, i)]
    kda = [i for i in range(n) if not is_mla_layer(c, i)]
    moe = [i for i in range(n) if is_moe_layer(c, i)]
    dense = [i for i in range(n) if not is_moe_layer(c, i)]
    lm_head = matrix_bytes("lm_head.weight", tensor_specs(c)["lm_head.weight"], fp8)
    batch = tokens * seqs
    parts = {
        "KDA weights": sum(_weights(c, i, "attention.", batch, fp8) for i in kda),
        "KDA state (read + write)": seqs * len(kda) * 2 * heads * d * d * FP32,
        "MLA weights": sum(_weights(c, i, "attention.", batch, fp8) for i in mla),
        "MLA KV cache": seqs * len(mla) * context * kv_row,
        "dense MLPs": sum(_weights(c, i, "mlp.", batch, fp8) for i in dense),
        "MoE (router, shared, routed INT4)": sum(_weights(c, i, "mlp.", batch, fp8) for i in moe),
        "lm_head": lm_head,
    }
    if mtp:
        draft_head = lm_head * min(draft_vocab or c["vocab_size"], c["vocab_size"]) / c["vocab_size"]
        parts["MTP draft"] = draft_steps * sum(_weights(c, i, "", seqs, fp8) + draft_head + seqs * context * kv_row
                                               for i in range(n, n + num_mtp_layers(c)))
    return StepBytes(parts)


def mean_accepted_length(acceptance: float, k: int) -> float:
    """Tokens per MTP round when each of k drafts is accepted with probability a given the ones before it:
    AL = 1 + a + a^2 + ... + a^k (the bonus token, then each accepted draft)."""
    return sum(acceptance ** i for i in range(k + 1))


def acceptance_for_length(length: float, k: int) -> float:
    """The per-position rate a with mean_accepted_length(a, k) = length (bisection; 1.0 past the cap k + 1)."""
    if length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_accepted_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


def mtp_round_bytes(c: dict, context: int, k: int, fp8: bool = False, draft_vocab: int | None = None,
                    seqs: int = 1) -> StepBytes:
    """One MTP round: k sequential draft steps (each the draft layer on one token, its KV and the LM head)
    and one verify of k + 1 tokens through the target. k = 1 is the verify step `project` counts. The first
    draft step of a round runs on the tokens the last verify accepted; counting it on one token, as k = 1
    always has, leaves out a few experts."""
    return decode_step_bytes(c, context, tokens=k + 1, mtp=True, fp8=fp8, draft_vocab=draft_vocab, draft_steps=k,
                             seqs=seqs)


# inclusionAI/Ling-3.0-flash-dspark (model card): 5 dense full-attention layers, 32 query / 32 KV heads, block
# size 8, Markov head of rank 256, confidence head, target features after layers 1, 11, 23, 29, 35; its files hold
# 961,316,865 parameters. head_dim 128 (a Qwen3 drafter, as the tiny one) and intermediate_size 16,640 are
# inferred: with them the files' count comes out 0.07% high (655,360 parameters).
DSPARK = {"num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128,
          "intermediate_size": 16640, "dspark_block_size": 8, "dspark_markov_rank": 256,
          "dspark_target_layer_ids": [1, 11, 23, 29, 35]}
DSPARK_FILE_PARAMS = 961_316_865


def dspark_config(c: dict) -> dict:
    """The real drafter's config for target `c`, in the tiny drafter writer's format (ling_tools/tiny/dspark.py)."""
    from ling_tools.tiny.dspark import dspark_config as tiny_config

    return {**tiny_config(c, DSPARK["dspark_target_layer_ids"]), **DSPARK}


def dspark_specs(c: dict) -> dict[str, TensorSpec]:
    """Every tensor in the drafter's files (no embedding, no LM head: the target's), with its shape: the names
    vLLM's loader requires (`vllm_ling.draft.dspark.required_tensors`), the shapes the tiny writer gives them."""
    from vllm_ling.draft.dspark import required_tensors
    from ling_tools.tiny.dspark import _shape

    d = dspark_config(c)
    return {n: TensorSpec(_shape(n, d), "linear" if len(_shape(n, d)) > 1 else "norm") for n in required_tensors(d)}


def dspark_round_bytes(c: dict, context: int, block: int, fp8: bool = False,
                       draft_vocab: int | None = None, draft_fp8: bool | None = None) -> StepBytes:
    """One DSpark round of K = `block` drafts, as vLLM's DSpark runtime runs it (v1/worker/gpu/spec_decode/dspark):

    - `fc` maps the verified tokens' target features (5 x 2,560 wide) into the drafter, and a fused GEMM
      writes their K/V for every drafter layer: a stacked copy of the k_proj/v_proj rows, read again;
    - one parallel forward over the block: every drafter matrix once, attention over the drafter's KV cache
      (5 layers x 2 x 32 heads x 128 x BF16 per context token);
    - the shared LM head once over the K positions (one GEMM);
    - the Markov head, sequential: per position one row of markov_w1 (the previous token) and the whole
      157,184 x 256 markov_w2 (80.5 MB in BF16, half in FP8), so K reads of it; the confidence head once;
    - the target verifies K + 1 tokens: experts touched for K + 1 tokens, every other matrix once, KDA state,
      MLA KV.

    With `draft_vocab` N the LM head pass and markov_w2 read N rows (vLLM sizes markov_w2 by the draft
    vocabulary); the drafter's released files hold the whole vocabulary. `draft_fp8` is the format of the
    drafter's own matrices (its speculative config's quantization), None: as the target's (`fp8`)."""
    specs, d = dspark_specs(c), dspark_config(c)
    vocab = c["vocab_size"]
    share = min(draft_vocab or vocab, vocab) / vocab
    own_fp8 = fp8 if draft_fp8 is None else draft_fp8

    def mat(names: list[str]) -> float:
        return sum(matrix_bytes(n, specs[n], own_fp8) for n in names)

    layers = [n for n, s in specs.items() if n.startswith("layers.") and len(s.shape) > 1]
    kv_proj = [n for n in layers if n.endswith(("k_proj.weight", "v_proj.weight"))]
    w1, w2 = "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"
    kv_row = 2 * d["num_key_value_heads"] * d["head_dim"] * BF16 * d["num_hidden_layers"]
    lm_head = matrix_bytes("lm_head.weight", tensor_specs(c)["lm_head.weight"], fp8)
    parts = {
        "drafter fc (target features)": mat(["fc.weight"]),
        "drafter context K/V (k_proj, v_proj again)": mat(kv_proj),
        "drafter layers": mat(layers),
        "drafter KV cache": context * kv_row,
        "drafter LM head (one pass, K positions)": lm_head * share,
        "Markov head (markov_w2 per position)": block * (mat([w2]) * share + specs[w1].shape[1] * BF16),
        "confidence head": mat(["confidence_head.proj.weight"]),
    }
    verify = decode_step_bytes(c, context, tokens=block + 1, fp8=fp8)
    parts |= {f"verify: {k}": v for k, v in verify.parts.items()}
    return StepBytes(parts)


def dspark_params(c: dict) -> int:
    """Parameters in the drafter's files, counted from `dspark_specs` (DSPARK_FILE_PARAMS to compare)."""
    return sum(s.numel for s in dspark_specs(c).values())


def narrow_block_length(length: float, k: int, block: int = DSPARK["dspark_block_size"]) -> float:
    """The mean accepted length a K-wide block would get from drafts that a `block`-wide one (the drafter's own,
    where its card measured `length`) accepts at one per-position rate a: AL_K = 1 + a + ... + a^K with a from
    AL_block = length. A model, not a measurement: a real drafter's rate falls along the block, so the first
    positions, which a narrow block keeps, are accepted more often than a, and this is a lower estimate."""
    return mean_accepted_length(acceptance_for_length(length, block), k)


def round_rows(c: dict, context: int, bandwidth_gbs: float, efficiency: float, methods: list[str],
               ks: list[int], blocks: list[int], acceptances: list[float], lengths: list[float],
               draft_vocab: int | None = None) -> list[dict]:
    """Every projected round, both formats: method, K, per-position rate (MTP), AL, GB per round (draft and
    verify apart), round bytes over a plain step's, tok/s = AL x bandwidth x efficiency / bytes per round.
    MTP runs at each rate in `acceptances` (AL from it) and at each AL in `lengths` it can reach, AL <= k + 1
    (the rate from it). DSpark runs at each AL in `lengths`, capped at K + 1 (`capped` says where): the card's
    lengths are at K = 8, and a narrower block accepts less, so below K = 8 they are upper bounds; `al_one_rate`
    and `tok_s_one_rate` are the same drafts at one per-position rate (`narrow_block_length`), a lower estimate."""
    bw = bandwidth_gbs * 1e9 * efficiency
    rows = []
    for fmt in FORMATS:
        fp8 = fmt == "fp8"
        plain = decode_step_bytes(c, context, fp8=fp8).total

        def row(method: str, k: int, al: float, step: StepBytes, rate: float | None = None) -> dict:
            draft = sum(v for p, v in step.parts.items() if p.startswith(("MTP draft", "drafter", "Markov", "conf")))
            narrow = narrow_block_length(al, k) if method == "dspark" else None
            return {"method": method, "k": k, "format": fmt, "acceptance": rate, "al_given": al,
                    "al": min(al, k + 1), "capped": al > k + 1,
                    "gb_per_round": step.total / 1e9, "draft_gb": draft / 1e9, "verify_gb": (step.total - draft) / 1e9,
                    "round_over_plain_bytes": step.total / plain, "tok_s": min(al, k + 1) * bw / step.total,
                    "al_one_rate": narrow, "tok_s_one_rate": None if narrow is None else narrow * bw / step.total}

        if "plain" in methods:
            rows.append(row("plain", 0, 1.0, decode_step_bytes(c, context, fp8=fp8)))
        if "mtp" in methods:
            for k in ks:
                step = mtp_round_bytes(c, context, k, fp8, draft_vocab)
                rows += [row("mtp", k, mean_accepted_length(a, k), step, a) for a in acceptances]
                rows += [row("mtp", k, al, step, acceptance_for_length(al, k)) for al in lengths if al <= k + 1]
        if "dspark" in methods:
            for k in blocks:
                step = dspark_round_bytes(c, context, k, fp8, draft_vocab)
                rows += [row("dspark", k, al, step) for al in lengths]
    return rows


def break_even_length(c: dict, method: str, k: int, fp8: bool, context: int = 4096,
                      draft_fp8: bool | None = None) -> float:
    """The mean accepted length (bonus token included) at which `method` with k drafts a round decodes exactly as
    fast as plain steps where decode is bound by the bytes it reads (a GB10): tok/s = AL x bandwidth / bytes, so the
    two meet at AL = round bytes / plain step bytes. Below it the drafts cost more than they yield. `draft_fp8`:
    the DSpark drafter's own format, None as the target's (`dspark_round_bytes`)."""
    plain = decode_step_bytes(c, context, fp8=fp8).total
    if method == "mtp":
        return mtp_round_bytes(c, context, k, fp8).total / plain
    if method == "dspark":
        return dspark_round_bytes(c, context, k, fp8, draft_fp8=draft_fp8).total / plain
    raise ValueError(f"method {method!r}: a break-even length is for mtp or dspark")


def _spec(text: str) -> tuple[str, int]:
    """`mtp:1` or `dspark:8` -> (method, k)."""
    method, _, k = text.partition(":")
    if method not in ("mtp", "dspark") or not k.isdigit() or int(k) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected mtp:K or dspark:K with K >= 1, e.g. mtp:1 or dspark:8")
    return method, int(k)


def lane_rows(c: dict, context: int, bandwidth_gbs: float, efficiency: float, lanes: list[int],
              acceptance: float) -> list[dict]:
    """`n` sequences decoding together, each at `context`, both formats: plain steps and MTP k = 1 rounds at
    per-position rate `acceptance`. A step reads every matrix once for the batch, so lanes share the dense
    bytes and add their routed experts (uniform routing over n x tokens), KDA states and MLA KV: per-request
    tok/s = AL x bandwidth x efficiency / bytes per step, aggregate = n x that. (vLLM's scheduler may also
    run a lane's prefill chunk in the same step; not counted here.)"""
    bw = bandwidth_gbs * 1e9 * efficiency
    rows = []
    for fmt in FORMATS:
        fp8 = fmt == "fp8"
        for method, k, al in (("plain", 0, 1.0), ("mtp", 1, mean_accepted_length(acceptance, 1))):
            for n in lanes:
                step = (decode_step_bytes(c, context, fp8=fp8, seqs=n) if k == 0
                        else mtp_round_bytes(c, context, k, fp8, seqs=n))
                per_request = al * bw / step.total
                rows.append({"method": method, "k": k, "format": fmt, "lanes": n, "al": al,
                             "acceptance": acceptance if k else None, "gb_per_step": step.total / 1e9,
                             "per_request_tok_s": per_request, "aggregate_tok_s": n * per_request})
    return rows


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


def _lengths(text: str) -> list[float]:
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give acceptance lengths >= 1 (bonus token included), comma-separated")
    return values


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or not all(v >= 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, comma-separated")
    return values


def report(c: dict, context: int, bandwidth_gbs: float, efficiency: float, acceptances: list[float],
           draft_vocab: int | None = None, rows: list[dict] | None = None, lanes: list[dict] | None = None) -> str:
    """The table: a plain step's GB by part, both step totals and tok/s, one column per weight format; then,
    given `rows` (`round_rows`), one line per round: GB, bytes over a plain step's, tok/s; given `lanes`
    (`lane_rows`), one line per method and lane count: GB a step, per-request and aggregate tok/s."""
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
    if rows:
        lines += ["", "Rounds, PROJECTED GB10 tok/s = AL x bandwidth x efficiency / GB per round "
                  "(AL capped at K + 1, marked *; DSpark's last two columns: the K = 8 length's drafts at one "
                  "per-position rate, a lower estimate for K < 8):",
                  f"  {'method':<7}{'K':>3}{'a':>7}{'AL':>7}" + "".join(
                      f"{x:>11}" for x in ["GB bf16", "GB fp8", "x plain", "x plain", "tok/s bf16", "tok/s fp8",
                                           "AL 1-rate", "fp8 1-rate"])]
        fp8 = [r for r in rows if r["format"] == "fp8"]
        for b, f in zip([r for r in rows if r["format"] == "bf16"], fp8):
            a = "" if b["acceptance"] is None else f"{b['acceptance']:.3f}"
            al = f"{b['al']:.2f}" + ("*" if b["capped"] else "")
            lines.append(f"  {b['method']:<7}{b['k']:>3}{a:>7}{al:>7}" + "".join(f"{x:>11}" for x in [
                f"{b['gb_per_round']:.2f}", f"{f['gb_per_round']:.2f}", f"{b['round_over_plain_bytes']:.2f}",
                f"{f['round_over_plain_bytes']:.2f}", f"{b['tok_s']:.1f}", f"{f['tok_s']:.1f}",
                "" if f["al_one_rate"] is None else f"{f['al_one_rate']:.2f}",
                "" if f["tok_s_one_rate"] is None else f"{f['tok_s_one_rate']:.1f}"]))
    if lanes:
        lines += ["", "Lanes (sequences decoding together, each at the context above), PROJECTED GB10 tok/s:",
                  f"  {'method':<7}{'lanes':>6}" + "".join(f"{x:>14}" for x in [
                      "GB bf16", "GB fp8", "per req bf16", "per req fp8", "all bf16", "all fp8"])]
        fp8 = [r for r in lanes if r["format"] == "fp8"]
        for b, f in zip([r for r in lanes if r["format"] == "bf16"], fp8):
            name = b["method"] + (f" k={b['k']}" if b["k"] else "")
            lines.append(f"  {name:<7}{b['lanes']:>6}" + "".join(f"{x:>14}" for x in [
                f"{b['gb_per_step']:.2f}", f"{f['gb_per_step']:.2f}", f"{b['per_request_tok_s']:.1f}",
                f"{f['per_request_tok_s']:.1f}", f"{b['aggregate_tok_s']:.1f}", f"{f['aggregate_tok_s']:.1f}"]))
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
                    help="MTP per-position acceptance rates, comma-separated (default 0.94, what Spark owners "
                         "report for k=1, and 0.70)")
    ap.add_argument("--method", choices=["plain", "mtp", "dspark", "all"], default="all",
                    help="which rounds to project after the step table (default all)")
    ap.add_argument("--k", type=_ints, default=[1, 2, 3], help="MTP draft steps per round (default 1,2,3)")
    ap.add_argument("--block", type=_ints, default=[4, 6, 8], help="DSpark drafts per round K (default 4,6,8)")
    ap.add_argument("--acceptance-length", type=_lengths, default=[3.5, 3.7, 5.3, 6.5],
                    help="mean accepted lengths incl. the bonus token (DSpark; MTP at the equivalent rate); "
                         "the drafter's card: GSM8K 6.40, HumanEval 6.57, MBPP 6.34, LiveCodeBench 5.33, "
                         "MT-Bench 3.92, Alpaca 3.51, macro 5.29")
    ap.add_argument("--draft-vocab", type=int, metavar="N",
                    help="drafts read only N rows of the LM head (and DSpark's markov_w2): a draft vocabulary; "
                         "the acceptance you give is assumed to hold with it")
    ap.add_argument("--lanes", type=_ints, metavar="N,N",
                    help="also project N sequences decoding together (plain and MTP k=1 at the first --acceptance), "
                         "e.g. 1,2,4,8")
    ap.add_argument("--json", type=Path, metavar="OUT", help="write every round's figures here")
    ap.add_argument("--break-even", type=_spec, metavar="METHOD:K",
                    help="print only the mean accepted length below which METHOD with K drafts a round decodes "
                         "slower than plain steps (break_even_length), e.g. dspark:8; with --format and "
                         "--draft-format")
    ap.add_argument("--format", choices=FORMATS, default="fp8", help="--break-even: the target's weights (default fp8)")
    ap.add_argument("--draft-format", choices=FORMATS,
                    help="--break-even dspark:K: the drafter's own weights (default: as --format)")
    a = ap.parse_args(argv)
    c = json.loads(a.config.read_text())
    if a.break_even:
        method, k = a.break_even
        draft = None if a.draft_format is None else a.draft_format == "fp8"
        print(f"{break_even_length(c, method, k, a.format == 'fp8', a.context, draft):.2f}")
        return 0
    methods = ["plain", "mtp", "dspark"] if a.method == "all" else [a.method]
    rows = round_rows(c, a.context, a.bandwidth_gbs, a.efficiency, methods, a.k, a.block, a.acceptance,
                      a.acceptance_length, a.draft_vocab)
    lanes = lane_rows(c, a.context, a.bandwidth_gbs, a.efficiency, a.lanes, a.acceptance[0]) if a.lanes else None
    print(report(c, a.context, a.bandwidth_gbs, a.efficiency, a.acceptance, a.draft_vocab, rows, lanes))
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "projection": "arithmetic, not a measurement: GB10 tok/s = AL x bandwidth x efficiency / bytes per round",
            "context": a.context, "bandwidth_gbs": a.bandwidth_gbs, "efficiency": a.efficiency,
            "draft_vocab": a.draft_vocab,
            "plain_step_gb": {f: decode_step_bytes(c, a.context, fp8=f == "fp8").total / 1e9 for f in FORMATS},
            "rows": rows, **({"lanes": lanes} if lanes else {})}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
