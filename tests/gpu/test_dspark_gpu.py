"""DSpark speculative decoding on a GPU with tiny drafters (docs/dspark.md): lossless for K = 1..8, both the reject and
the accept path.

Two drafters from `ling_tools.tiny.dspark` (the released drafter's names and config format, normalised by the
plugin onto vLLM's Qwen3 DSpark runtime), both on the `mtp_echo` tiny target, so one plain engine serves as the
reference of both:
- `random`: a random drafter: acceptance near 0, verification rejects;
- `agree`: the agreeing drafter (its Markov head drafts f(previous token), what the echo target mostly says):
  acceptance high, verification accepts whole blocks.
For each pair and K, greedy output with DSpark is compared with greedy output without it (>= 64 new tokens), and
both with the fp32 transformers oracle teacher-forced on each engine's own tokens. As in test_mtp_gpu.py, bf16 may
flip near-ties between a 1-token decode and a (K+1)-token verify: so DSpark's tokens must agree with the oracle's
argmax on decided positions as plain decoding does, and where DSpark and plain first part the oracle's margin must
be one bf16 can flip. A verify that corrupted the KDA state or accepted an unverified token breaks the first.
Run on the device: LING_GPU_RESULTS=$OUT python -m pytest tests/gpu/test_dspark_gpu.py -q
(DSPARK_KS=1,8 runs those K only: all eight and the plain engine are 17 engines, more than one device call; K = 1,
4 and 8 with a cold compile cache ran past 570 s, so two K a call;
DSPARK_ADAPTIVE=1 verifies with vLLM's confidence-driven adaptive width instead of the fixed one; DSPARK_FP8=1 serves
the drafter's own weights in FP8, `"quantization": "ling_fp8"` in its speculative config (docs/dspark.md §Draft
FP8), the target staying BF16 so the oracle's bar is unchanged: lossless still, and the agreeing drafter still
accepted; DSPARK_TARGET=int4 serves the INT4 `mtp_echo` checkpoint (experts INT4, vLLM's default MoE kernel) as the
target of all engines, the oracle reading its dequantized copy, the model it serves, as test_model_gpu.py does;
DSPARK_TARGET=fp8 serves the BF16 target under `--quantization ling_fp8` in its default scheme, the drafter then
sharing the target's FP8 LM head (a drafter reading FP8 bytes through a BF16 method accepts ~nothing), scored by
the FP8 reference and judged as test_mtp_gpu.py judges MTP on FP8: decided agreement at most 1 point below plain
decoding's, and no bf16 margin where the two part.)
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import BF16_FLIP_MAX_MARGIN, DECIDED_AGREEMENT, FP8_LOSSLESS_SLACK, decided_disagreements  # noqa: E402
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
from model_helpers import (FP8_MERGED, NO_CLAMPS, first_difference, random_prompts, run_scripts,  # noqa: E402
                           spec_acceptance)

from vllm_ling.fp8 import DEFAULT_SCHEME  # noqa: E402

PROMPT_LENGTHS = [3, 17, 64, 130]
MAX_TOKENS = 64
KS = [int(k) for k in os.environ.get("DSPARK_KS", "1,2,3,4,5,6,7,8").split(",")]
ADAPTIVE = os.environ.get("DSPARK_ADAPTIVE", "0") == "1"
DRAFT_FP8 = os.environ.get("DSPARK_FP8", "0") == "1"
TARGET = "mtp_echo"
TARGET_KIND = os.environ.get("DSPARK_TARGET", "bf16")
if TARGET_KIND not in ("bf16", "int4", "fp8"):
    raise ValueError(f"DSPARK_TARGET={TARGET_KIND!r}: bf16, int4 or fp8")
TARGET_INT4, TARGET_FP8 = TARGET_KIND == "int4", TARGET_KIND == "fp8"
# the FP8 target: our FP8 in its default scheme on every engine, and the oracle's FP8 reference of the same scheme
TARGET_ENGINE = {"quantization": "ling_fp8"} if TARGET_FP8 else {}
ORACLE_FP8 = ({"fp8": "w8a8", "fp8_scheme": DEFAULT_SCHEME, "fp8_merged": FP8_MERGED["vllm-ling"]} if TARGET_FP8
              else {})
PAIRS = {"random": False, "agree": True}  # drafter -> built to agree with the target
AGREE_MIN_ACCEPTANCE = 0.5  # the agreeing drafter's share of accepted drafts (the echo target follows f ~80-90%)
RANDOM_MAX_ACCEPTANCE = 0.1
# engines side by side: each a fixed KV cache, as in test_mtp_gpu.py (profiling would count the others' memory)
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.08, "engine_kwargs": {"kv_cache_memory_bytes": 1 << 30}}
GROUP = 6  # engines started at once


def _spec(draft: str, k: int) -> dict:
    """vLLM's Ling recipe's DSpark flags (0.33 sdist recipes/models/inclusionAI/Ling-3.0-flash.yaml): fixed width
    there; adaptive with DSPARK_ADAPTIVE=1; the drafter's own quantization ling_fp8 with DSPARK_FP8=1."""
    spec = {"method": "dspark", "model": draft, "num_speculative_tokens": k, "attention_backend": "FLASH_ATTN",
            "enable_adaptive_verification": ADAPTIVE}
    return spec | ({"quantization": "ling_fp8"} if DRAFT_FP8 else {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """drafter -> {"plain": run, k: run}, each run's outputs scored by the fp32 oracle (its "scored")."""
    from ling_tools.tiny import dequantize_checkpoint, ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    tmp = tmp_path_factory.mktemp("dspark")
    prompts = random_prompts(PROMPT_LENGTHS, seed=13)
    model = str(ensure_tiny(variant=TARGET, int4=TARGET_INT4))
    reference = str(dequantize_checkpoint(model, tmp / "dequantized")) if TARGET_INT4 else model
    base = {"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "dtype": "bfloat16",
            "enforce_eager": False, "max_model_len": 1024, "max_num_batched_tokens": 512,
            "prompt_logprobs": False, "hf_overrides": NO_CLAMPS, "log_lines": DRAFT_FP8 or TARGET_FP8,
            **SIDE_BY_SIDE}
    base["engine_kwargs"] = {**SIDE_BY_SIDE["engine_kwargs"], **TARGET_ENGINE}
    jobs = [("engine_runner.py", base, "plain")]
    for pair, agree in PAIRS.items():
        draft = str(make_tiny_dspark(tmp / f"draft-{pair}", model, agree=agree))
        jobs += [("engine_runner.py", {**base, "speculative_config": _spec(draft, k)}, f"{pair}-k{k}") for k in KS]
    done = {}
    tag = (f"dspark_k{''.join(map(str, KS))}{'' if TARGET_KIND == 'bf16' else '_' + TARGET_KIND}"
           f"{'_adaptive' if ADAPTIVE else ''}"
           f"{'_draft_fp8' if DRAFT_FP8 else ''}")
    for i in range(0, len(jobs), GROUP):
        group = jobs[i:i + GROUP]
        done.update(zip([name for *_, name in group], run_scripts(group, tmp, GPU_ENV)))
        # what has run so far, before the oracle: a step cut short still says which engines served and how fast
        record(f"{tag}_engines", {name: {"seconds": r.get("seconds"), "counters": r.get("spec_decode"),
                                         "first_tokens": [o["token_ids"][:8] for o in r["outputs"]]}
                                  for name, r in done.items()})
    names = list(done)  # plain, then each drafter's K: all scored by the oracle in one run
    oracle = run_scripts([("oracle.py", {
        "model": reference, "prompts": [], "device": "cuda", **ORACLE_FP8,
        "score": [p + done[name]["outputs"][j]["token_ids"] for name in names for j, p in enumerate(prompts)],
    }, "oracle")], tmp)[0]
    n = len(prompts)
    for i, name in enumerate(names):
        done[name]["scored"] = oracle["scored"][i * n:(i + 1) * n]
    out = {pair: {"plain": done["plain"], **{k: done[f"{pair}-k{k}"] for k in KS}} for pair in PAIRS}
    record(tag, {pair: _report(named) for pair, named in out.items()})
    return out


def _agreement(run: dict) -> float:
    counts = [decided_disagreements(p, o["token_ids"], ref) for p, o, ref in zip(PROMPT_LENGTHS, run["outputs"], run["scored"])]
    return 1 - sum(bad for _, bad in counts) / max(sum(n for n, _ in counts), 1)


def _report(named: dict) -> dict:
    plain = named["plain"]
    report = {"plain_vs_oracle": _agreement(plain), "plain_seconds": plain.get("seconds"), "k": {}}
    for k in KS:
        run = named[k]
        parts = [first_difference(a["token_ids"], b["token_ids"]) for a, b in zip(plain["outputs"], run["outputs"])]
        report["k"][k] = {
            "acceptance": spec_acceptance(run), "counters": run["spec_decode"], "vs_oracle": _agreement(run),
            "identical_requests": sum(p is None for p in parts), "seconds": run.get("seconds"),
            "margins_at_first_difference": [None if p is None else run["scored"][i]["margin"][PROMPT_LENGTHS[i] + p]
                                            for i, p in enumerate(parts)]}
    return report


@pytest.mark.parametrize("pair", list(PAIRS))
def test_dspark_is_lossless(runs, pair):
    """For every K: DSpark's greedy tokens agree with the fp32 oracle on decided positions as plain decoding does."""
    named = runs[pair]
    plain = _agreement(named["plain"])
    if TARGET_FP8:  # FP8 rounding amplifies bf16 noise: DSpark may not lose against plain decoding (test_mtp_gpu.py)
        bad = {k: round(_agreement(named[k]), 4) for k in KS if _agreement(named[k]) < plain - FP8_LOSSLESS_SLACK}
        assert not bad, f"{pair}: FP8 target, decided agreement more than 1 point below plain's {plain:.4f} at K: {bad}"
        return
    assert plain >= DECIDED_AGREEMENT, f"{pair}: plain decoding already disagrees ({plain:.4f})"
    bad = {k: round(_agreement(named[k]), 4) for k in KS if _agreement(named[k]) < DECIDED_AGREEMENT}
    assert not bad, f"{pair}: decided agreement with the oracle below {DECIDED_AGREEMENT} at K: {bad}"


@pytest.mark.parametrize("pair", list(PAIRS))
def test_dspark_and_plain_part_only_where_bf16_can_flip(runs, pair):
    if TARGET_FP8:
        pytest.skip("FP8 moves a near-boundary value by an e4m3 step: bf16's flip margin does not bound it")
    report = _report(runs[pair])
    for k, r in report["k"].items():
        for m in r["margins_at_first_difference"]:
            assert m is None or m < BF16_FLIP_MAX_MARGIN, f"{pair}, K={k}: parted from plain at margin {m:.3f} nat"


def test_both_paths_run(runs):
    """The agreeing drafter is accepted (whole blocks verified), the random one rejected: both paths are exercised."""
    for k in KS:
        agree, random = (spec_acceptance(runs[p][k]) for p in ("agree", "random"))
        assert agree >= AGREE_MIN_ACCEPTANCE, f"K={k}: the agreeing drafter was accepted {agree:.2%}"
        assert random <= RANDOM_MAX_ACCEPTANCE, f"K={k}: the random drafter was accepted {random:.2%}"


@pytest.mark.skipif(not TARGET_FP8, reason="DSPARK_TARGET=fp8 serves the target in FP8")
def test_the_target_serves_fp8_with_its_lm_head(runs):
    """Every engine, plain and DSpark, logged the target's FP8 line with its LM head in FP8 (vllm_ling.startup_log
    FP8_ON): the drafter then reads that FP8 head, which test_both_paths_run shows it does right (an agreeing drafter
    reading FP8 bytes through a BF16 method would be accepted ~never)."""
    from vllm_ling.startup_log import FP8_HEAD_ON, FP8_ON

    for name, run in [("plain", runs["agree"]["plain"])] + [(f"{p}-k{k}", runs[p][k]) for p in PAIRS for k in KS]:
        found = [FP8_ON.search(line) for line in run["log_lines"]]
        assert any(f and f["head"] == FP8_HEAD_ON for f in found), (name, [line for line in run["log_lines"]
                                                                           if "FP8" in line])


@pytest.mark.skipif(not DRAFT_FP8, reason="DSPARK_FP8=1 serves the drafter's own weights in FP8")
def test_the_drafter_serves_its_own_weights_in_fp8(runs):
    """vLLM built each drafter with its own quantization ling_fp8: the tiny drafter's 9 linears (2 layers x 4, fc)
    and its Markov head, by the line the drafter logs once built (vllm_ling.startup_log.DSPARK_FP8_ON)."""
    from vllm_ling.startup_log import DSPARK_FP8_ON, DSPARK_MARKOV_ON

    for pair in PAIRS:
        for k in KS:
            found = [DSPARK_FP8_ON.search(line) for line in runs[pair][k]["log_lines"]]
            assert any(f and f["linears"] == "9" and f["markov"] == DSPARK_MARKOV_ON for f in found), (pair, k)
