"""Shared by the GPU model tests and the bf16-floor script (no CUDA needed to import)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import first_difference, random_prompts  # noqa: E402  (standard library only at import)

# 8 concurrent requests; 517 and 1000 exceed the 256-token budget (chunked prefill carries KDA state)
PROMPT_LENGTHS = [1, 9, 63, 64, 65, 200, 517, 1000]
TOPK = 20
# nats: a prediction is "decided" when the fp32 reference's top-1/top-2 logprob margin is at least this.
# bf16's own |Δ logprob| on the tiny checkpoint: median 0.04, p99 0.18 (tests/gpu/bf16_floor.py, FINDINGS.md §1)
DECIDED = 0.2
# bf16 still flips a decided prediction now and then (2 of 1,552 in test_model_gpu.py), so agreement on decided
# positions is held to >= 99%, not 100%; a state bug disagrees on a large share of them.
DECIDED_AGREEMENT = 0.99
# nats: bf16 cannot flip a prediction this decided (its |Δ logprob| p99 is 0.18); where two bf16 runs part, the
# fp32 margin must be below this.
BF16_FLIP_MAX_MARGIN = 0.5
# nats: how far an fp16 engine's uncached logprob may stand from the fp32 oracle's on the prefix-cache agent turns of
# the stable_router checkpoint: transformers in fp16 moves them by at most 0.022 (bf16_floor.py --chains --low
# float16), the CPU engine in fp16 by up to 0.052; twice that, where a broken fp16 path is nats off
FP16_MARGIN = 0.1
# nats: how far a resumed continuation's logprobs may stand from its uncached run's in the same fp16 engine. On the
# CPU engine, fp16, the agent turns at --prefix-match-unit 16: right resumes 0.004-0.012 and never a parting; with
# vLLM 0.32's partial block copy 3-4 of 6 turns move by 0.034-0.070 or part away from a tie
# (tests/model/partial_hit_size.py --dtype float16 [--copy ours], stable_router and default)
FP16_DRIFT = 0.03


def decided_agreement_holds(decided: int, disagree: int, bar: float = DECIDED_AGREEMENT) -> bool:
    """At least `bar` of the decided positions agree, or only one disagrees: below 100 decided positions a 99% bar
    would call a single bf16 flip (the rate above, about 1 in 800) a bug; a state bug disagrees on a large share."""
    return disagree <= max(1, int((1 - bar) * decided))


def decided_disagreements(prompt_len: int, tokens: list[int], ref: dict) -> tuple[int, int]:
    """(decided positions, of them where the engine's token is not the fp32 oracle's argmax), the oracle
    teacher-forced on the engine's own tokens (`ref`: oracle.py's scored record of prompt + tokens)."""
    pos = [(t, ref["argmax"][prompt_len + j], ref["margin"][prompt_len + j]) for j, t in enumerate(tokens)]
    decided = [(t, want) for t, want, m in pos if m >= DECIDED]
    return len(decided), sum(t != w for t, w in decided)


def model_prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=7)


# FP8 targets: a speculative engine's decided agreement with the FP8 reference at most 1 point below plain decoding's
# (FP8's rounding turns bf16's small verify-vs-step differences into e4m3-sized ones, so the bf16 bars would judge
# FP8 itself; test_model_gpu.py)
FP8_LOSSLESS_SLACK = 0.01

ACCEPTANCE_POINTS = 0.03  # two acceptance rates of one draft under different numerics: within 3 points...


def acceptance_slack(p1: float, n1: int, p2: float, n2: int) -> float:
    """...or 3 standard errors of p1 - p2 where the drafts (n1, n2) are too few for 3 points to be more than
    noise: max(ACCEPTANCE_POINTS, 3 sqrt(p1(1-p1)/n1 + p2(1-p2)/n2)) for two binomial acceptance rates."""
    return max(ACCEPTANCE_POINTS, 3 * (p1 * (1 - p1) / max(n1, 1) + p2 * (1 - p2) / max(n2, 1)) ** 0.5)


def paired_slack(ours: list[bool], ref: list[bool], points: float) -> float:
    """How far ours may fall below a reference's hit rate on the same positions before the gap is more than noise:
    max(points, 3 sqrt(b + c) / n), b the positions only the reference gets right, c those only ours does. Under
    equal quality b - c has mean 0 and variance about b + c (McNemar's test). One H200 bf16_fp8 decode fell 1.9
    points (4 of 209 decided tokens) below its reference, under a 1-point bar, while its 1,568 teacher-forced
    positions beat that reference: 1 point was 2 tokens there, below a binomial's noise."""
    n = len(ours)
    discordant = sum(a != b for a, b in zip(ours, ref))
    return max(points, 3 * discordant ** 0.5 / max(n, 1))


def parting(got: dict, want: dict) -> tuple[int | None, float]:
    """Where a continuation's greedy tokens leave another's (None: never), and its largest logprob difference before."""
    first = first_difference(got["token_ids"], want["token_ids"])
    upto = len(want["token_ids"]) if first is None else first
    return first, max((abs(a - b) for a, b in zip(got["logprobs"][:upto], want["logprobs"][:upto])), default=0.0)


def parted_beyond(got: dict, want: dict, drift_max: float, tie_max: float) -> str | None:
    """Why a cached continuation is not the uncached one, or None when it is: greedy tokens equal up to the first
    place they part, the logprobs before it within `drift_max` nats, and that place a tie (the two tokens' logprobs
    within `tie_max`)."""
    first, drift = parting(got, want)
    if drift > drift_max:
        return f"cached vs uncached logprobs differ by {drift:.3f} nats"
    if first is not None and (gap := abs(got["logprobs"][first] - want["logprobs"][first])) >= tie_max:
        return f"parts from the uncached run at new token {first}, not a tie ({gap:.3f})"
    return None


def bf16_parting(got: dict, want: dict) -> str | None:
    """`parted_beyond` in bf16's terms: drift within BF16_FLIP_MAX_MARGIN, a parting below DECIDED."""
    return parted_beyond(got, want, BF16_FLIP_MAX_MARGIN, DECIDED)


def bf16_chain_parting(got: dict, want: dict) -> str | None:
    """`parted_beyond` for the prefix-cache agent turns in bf16: drift and a parting's gap within
    BF16_FLIP_MAX_MARGIN. Their checkpoint's bf16 tails are long (`stable_router`: up to 3.7 nats from fp32 in
    transformers), and a right resume may part at a gap above DECIDED: on an H100 (vLLM 0.34, CUDA graphs) DSpark's
    resume parted at its first new token with the two runs' logprobs 0.30 nats apart, where the same turns in fp16
    stood within 0.0075 nats of theirs, never parting. A gross-error check; the fp16 module judges these resumes."""
    return parted_beyond(got, want, BF16_FLIP_MAX_MARGIN, BF16_FLIP_MAX_MARGIN)


def fp16_parting(got: dict, want: dict) -> str | None:
    """`parted_beyond` in fp16's terms: drift and a parting's gap within FP16_DRIFT."""
    return parted_beyond(got, want, FP16_DRIFT, FP16_DRIFT)
