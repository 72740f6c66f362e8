"""The GPU tests' statistical bars (tests/gpu/criteria.py), checked on the CPU: wide enough for sampling noise,
narrow enough to catch a real loss. The model test's decode check scores ~420 decided tokens (64 a request).

How much a bar catches depends on how the two runs' misses relate. A fault in ours breaks tokens the reference gets
right (ours' misses a superset of the reference's): caught below. Two runs of one model whose misses are unrelated
give the widest slack: a 10-point loss is then caught in ~80% of trials at 418 tokens and ~37% at 209 (simulated in
a review of the bar; not pinned here); engines and their reference share weights and rounding, so their misses
mostly coincide."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from criteria import paired_slack  # noqa: E402

N = 418  # decided decode tokens, about, at 64 tokens a request
TEACHER_FORCED = 1911  # prompt positions the teacher-forced checks score


def _hits(n: int, p: float, rng: random.Random) -> list[bool]:
    return [rng.random() < p for _ in range(n)]


def _gap(ours: list[bool], ref: list[bool]) -> float:
    return (sum(ref) - sum(ours)) / len(ref)


@pytest.mark.parametrize("n, p, points", [(N, 0.88, 0.01), (TEACHER_FORCED, 0.80, 0.005)])
def test_two_equally_good_runs_with_unrelated_misses_stay_within_the_slack(n, p, points):
    """Equal quality, misses independent (the widest the slack gets): within it in at least 99% of 2,000 trials,
    where the fixed bar alone fails a fifth of them or more. Decode: 88% (an H200 FP8 decode run), a 1-point bar
    (36% failed at 209 tokens). Teacher-forced, all positions: 80% (an H200 run's int4_fp8_ourgate and its floor,
    0.7975 against 0.8074), the old half-point bar."""
    rng = random.Random(0)
    within = within_fixed = 0
    for _ in range(2000):
        ours, ref = _hits(n, p, rng), _hits(n, p, rng)
        within += _gap(ours, ref) <= paired_slack(ours, ref, points)
        within_fixed += _gap(ours, ref) <= points
    assert within >= 0.99 * 2000 and within_fixed < 0.8 * 2000


def _broken(ref: list[bool], loss: float, rng: random.Random) -> list[bool]:
    """A fault that breaks a share `loss` of the tokens the reference gets right, and fixes none."""
    return [hit and rng.random() >= loss for hit in ref]


@pytest.mark.parametrize("n, p, points, loss, caught_at_least", [
    (N, 0.88, 0.01, 0.114, 0.99), (N, 0.88, 0.01, 0.057, 0.95),  # decode: ~10 and ~5 points
    (TEACHER_FORCED, 0.80, 0.005, 0.025, 0.99)])  # teacher-forced, all positions: 2 points
def test_a_fault_that_breaks_the_references_tokens_is_caught(n, p, points, loss, caught_at_least):
    rng = random.Random(int(loss * 1000))
    caught = 0
    for _ in range(500):
        ref = _hits(n, p, rng)
        ours = _broken(ref, loss, rng)
        caught += _gap(ours, ref) > paired_slack(ours, ref, points)
    assert caught >= caught_at_least * 500


def test_paired_slack_is_the_floor_when_runs_agree_everywhere():
    same = [True, False] * 100
    assert paired_slack(same, same, 0.01) == 0.01


def _run(tokens: list[int], logprobs: list[float]) -> dict:
    return {"token_ids": tokens, "logprobs": logprobs}


def test_a_resume_within_the_fp16_drift_and_parting_at_a_tie_passes():
    """A right fp16 resume on the CPU engine drifts by 0.004-0.012 nats and keeps its tokens; one that parts where two
    tokens are within the bound (a tie) is rounding too."""
    from criteria import FP16_DRIFT, fp16_parting

    want = _run([5, 6, 7, 8], [-0.5, -0.2, -1.0, -0.7])
    assert fp16_parting(_run([5, 6, 7, 8], [-0.51, -0.21, -0.99, -0.71]), want) is None
    assert fp16_parting(_run([5, 6, 9, 8], [-0.51, -0.2, -1.0 + FP16_DRIFT / 2, -0.7]), want) is None


@pytest.mark.parametrize(("tokens", "logprobs", "why"), [
    ([5, 6, 7, 8], [-0.5, -0.2, -1.04, -0.7], "differ by 0.040"),  # a wrong resume's drift (0.034-0.070 on the CPU)
    ([5, 9, 7, 8], [-0.5, -0.32, -1.0, -0.7], "parts from the uncached run at new token 1, not a tie"),
])
def test_a_wrong_resume_is_caught_by_the_fp16_bounds_but_not_by_bf16s(tokens, logprobs, why):
    """The CPU engine's wrong fp16 resumes move by 0.034-0.070 nats or part away from a tie; bf16's bounds (0.5 nats,
    a tie below 0.2) pass both, which is why the fp16 test exists."""
    from criteria import bf16_parting, fp16_parting

    want = _run([5, 6, 7, 8], [-0.5, -0.2, -1.0, -0.7])
    assert why in (fp16_parting(_run(tokens, logprobs), want) or "")
    assert bf16_parting(_run(tokens, logprobs), want) is None


def test_the_bf16_chain_bound_passes_the_rounding_a_gpu_showed_and_catches_a_gross_error():
    """DSpark's right resume on an H100 parted at its first new token 0.297 nats from its uncached run (bf16, whose
    per-token bound there is 0.5); a resume from a wrong state that lands nats away is still caught, whether it
    drifts or parts."""
    from criteria import BF16_FLIP_MAX_MARGIN, bf16_chain_parting, bf16_parting

    want = _run([5, 6, 7, 8], [-1.35, -1.37, -0.23, -0.7])
    seen = _run([9, 6, 7, 8], [-1.05, -1.01, -1.43, -0.7])  # the H100's parting (its first logprobs)
    assert bf16_chain_parting(seen, want) is None
    assert "not a tie (0.300)" in (bf16_parting(seen, want) or "")
    gross = _run([9, 6, 7, 8], [-1.35 + BF16_FLIP_MAX_MARGIN + 0.1, -1.0, -1.4, -0.7])
    assert "not a tie (0.600)" in (bf16_chain_parting(gross, want) or "")
    drift = _run([5, 6, 7, 8], [-1.35, -1.37 - 0.8, -0.23, -0.7])
    assert "differ by 0.800" in (bf16_chain_parting(drift, want) or "")
