"""The GPU tests' statistical bars (tests/gpu/criteria.py), checked on the CPU: wide enough for sampling noise,
narrow enough to catch a real loss."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from criteria import paired_slack  # noqa: E402


def _hits(n: int, p: float, rng: random.Random) -> list[bool]:
    return [rng.random() < p for _ in range(n)]


def test_paired_slack_covers_two_equally_good_runs_on_a_few_hundred_tokens():
    """Two independent runs of equal quality (88%, session 14's FP8 decode) on 209 tokens: the gap stays within
    the slack in at least 99% of 2,000 trials; a fixed 1-point bar fails about a third of them (36%)."""
    rng = random.Random(0)
    within, within_fixed = 0, 0
    for _ in range(2000):
        ours, ref = _hits(209, 0.88, rng), _hits(209, 0.88, rng)
        gap = (sum(ref) - sum(ours)) / 209
        within += gap <= paired_slack(ours, ref, 0.01)
        within_fixed += gap <= 0.01
    assert within >= 0.99 * 2000 and within_fixed < 0.8 * 2000


def test_paired_slack_still_catches_a_run_that_loses_ten_points():
    """Ours wrong on 10% of the positions the reference gets right: flagged in at least 99% of trials."""
    rng = random.Random(1)
    caught = 0
    for _ in range(500):
        ref = _hits(209, 0.88, rng)
        ours = [hit and rng.random() >= 0.114 for hit in ref]  # ~10 points lost, never a gain
        caught += (sum(ref) - sum(ours)) / 209 > paired_slack(ours, ref, 0.01)
    assert caught >= 0.99 * 500


def test_paired_slack_is_the_floor_when_runs_agree_everywhere():
    same = [True, False] * 100
    assert paired_slack(same, same, 0.01) == 0.01
