"""When to relaunch after a fault, and when to give up.

A W7 freeze usually loads clean on the next try, so a few relaunches with exponential backoff are
worth it; a fault that keeps coming back is not transient, so two limits stop the loop:
max_relaunches in a row (reset by a stable serving period) and burst_failures in burst_window_s
(docs/ops-walls.md, "Supervisor practice").
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ling_watchdog.config import Config


@dataclass(frozen=True, slots=True)
class Decision:
    relaunch: bool
    delay_s: float = 0.0
    reason: str = ""


class RelaunchPolicy:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.in_a_row = 0  # relaunches since the last stable serving period
        self.total = 0
        self._failures: deque[float] = deque()

    def stable(self) -> None:
        self.in_a_row = 0

    def after_failure(self, t: float) -> Decision:
        cfg = self.cfg
        self._failures.append(t)
        while self._failures and t - self._failures[0] > cfg.burst_window_s:
            self._failures.popleft()
        if self.in_a_row >= cfg.max_relaunches:
            return Decision(False, reason=f"relaunch limit: {self.in_a_row} relaunches without a stable "
                            f"serving period (max_relaunches {cfg.max_relaunches})")
        if len(self._failures) >= cfg.burst_failures:
            return Decision(False, reason=f"burst limit: {len(self._failures)} failures within "
                            f"{cfg.burst_window_s:g}s (burst_failures {cfg.burst_failures})")
        self.in_a_row += 1
        self.total += 1
        delay = min(cfg.backoff_initial_s * 2 ** (self.in_a_row - 1), cfg.backoff_max_s)
        return Decision(True, delay)
