"""The tuning loop: every surviving candidate at every M, checked, timed, logged as it goes.

Budget: each M gets an equal share of the time still left (time an M does not use passes on), so
a cut-short run still covers every M with an unbiased sample (candidates come in a seeded shuffle).
Results already in the store are reused and cost nothing, which is what makes a rerun resume.
vLLM's own default for each M is measured first, whatever the budget, and competes with the
searched configs: the written entry is never slower than what vLLM runs without a tuned file.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ling_tuning.runner import REL_TOL, Runner
from ling_tuning.shapes import MoEShape
from ling_tuning.space import Config, candidates, config_key, explicit_default_config, violations
from ling_tuning.store import Result, ResultStore
from tqdm import tqdm


@dataclass
class MOutcome:
    """What tuning found at one batch size."""

    m: int
    kernel: str
    candidates: int
    pruned: dict[str, int]
    measured: int = 0  # measured in this run
    reused: int = 0  # taken from the store
    skipped: int = 0  # left untimed when the budget ran out
    rejected: dict[str, int] = field(default_factory=dict)
    best: Result | None = None
    default: Result | None = None  # vLLM's default config at this M: timed, or why it cannot run


# Errors after which the CUDA context is unusable: every later call would fail too.
STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "unspecified launch failure",
                      "misaligned address", "illegal instruction")


class DeviceBroken(RuntimeError):
    """A config broke the CUDA context. It is logged as rejected; rerunning the command resumes."""


def measure(runner: Runner, m: int, cfg: Config, smem_limit: int) -> Result:
    """One candidate: correctness first, then time; any failure becomes a logged rejection."""
    try:
        got = runner.triton(m, cfg)
    except Exception as e:  # compile errors, OutOfResources, TORCH_CHECK: all mean "not usable"
        text = f"{type(e).__name__}: {e}"[:300]
        sticky = any(s in str(e) for s in STICKY_CUDA_ERRORS)
        return Result(m, cfg, "error", detail=("sticky CUDA error: " if sticky else "") + text)
    if got.us is None or not got.rel_err <= REL_TOL:
        return Result(m, cfg, "wrong", rel_err=got.rel_err, smem=got.smem,
                      detail=f"rel_err {got.rel_err:.3g} > {REL_TOL}")
    detail = f"compiled smem {got.smem} B > limit {smem_limit} B" if (got.smem or 0) > smem_limit else ""
    return Result(m, cfg, "ok", us=got.us, rel_err=got.rel_err, smem=got.smem, detail=detail)


def _measure_and_log(runner: Runner, store: ResultStore, out: MOutcome, cfg: Config, smem_limit: int) -> Result:
    """Measure a config the store lacks, log and count it; stop the run if it broke the CUDA context."""
    res = measure(runner, out.m, cfg, smem_limit)
    store.add(res)
    out.measured += 1
    if res.detail.startswith("sticky CUDA error"):
        raise DeviceBroken(f"M={res.m} config {cfg} broke the CUDA context ({res.detail}); it is "
                           f"logged as rejected, run the same command again to resume")
    return res


def measure_default(runner: Runner, store: ResultStore, out: MOutcome, shape: MoEShape,
                    smem_limit: int) -> Result:
    """vLLM's default at out.m, timed like any candidate (reused when stored). One the kernel rejects
    (vLLM's CUDA default at M <= 2: BLOCK_SIZE_K // group = 16) is an 'error' Result, not
    launched and not stored (it may be valid under another run's limit); one that raises when
    launched is stored as 'error' like any candidate. Either way tuning goes on without it."""
    cfg = explicit_default_config(out.m, shape)
    reasons = violations(out.m, cfg, shape, smem_limit)
    if reasons:
        return Result(out.m, cfg, "error", detail=f"vLLM default rejected before launch: {reasons[0]}")
    if (res := store.get(out.m, cfg)) is not None:
        out.reused += 1
        return res
    return _measure_and_log(runner, store, out, cfg, smem_limit)


def pick_best(store: ResultStore, m: int, shape: MoEShape, smem_limit: int) -> Result | None:
    """Fastest correct result at m that this run's limit allows, by estimate and by compiled size
    (the store may hold results measured under a larger limit)."""
    ok = [r for r in store.results(m) if r.status == "ok" and (r.smem or 0) <= smem_limit
          and not violations(m, r.config, shape, smem_limit)]
    return min(ok, key=lambda r: r.us) if ok else None


def tune(
    shape: MoEShape,
    ms: list[int],
    runner: Runner,
    store: ResultStore,
    smem_limit: int,
    space: str = "quick",
    budget_s: float = 3600.0,
    clock: Callable[[], float] = time.monotonic,
    progress: bool = True,
    max_candidates: int | None = None,
) -> dict[int, MOutcome]:
    """Tune every M in `ms`; returns what was found per M (best = fastest correct, fitting)."""
    plans = {m: candidates(m, shape, smem_limit, space, max_candidates) for m in ms}
    outcomes = {m: MOutcome(m, p.kernel, len(p.kept), p.dropped) for m, p in plans.items()}
    end = clock() + budget_s
    with tqdm(total=sum(len(p.kept) for p in plans.values()), desc="ling-tune", unit="cfg",
              disable=not progress, dynamic_ncols=True) as bar:
        for i, m in enumerate(ms):
            out = outcomes[m]
            m_end = clock() + max(0.0, end - clock()) / (len(ms) - i)
            bar.set_postfix_str(f"M={m} {out.kernel}")
            out.default = measure_default(runner, store, out, shape, smem_limit)
            for cfg in plans[m].kept:
                if config_key(cfg) == config_key(out.default.config):
                    res = out.default
                elif (res := store.get(m, cfg)) is not None:
                    out.reused += 1
                elif clock() >= m_end:
                    out.skipped += 1
                else:
                    res = _measure_and_log(runner, store, out, cfg, smem_limit)
                if res is not None and res.status != "ok":
                    out.rejected[res.status] = out.rejected.get(res.status, 0) + 1
                bar.update()
            out.best = pick_best(store, m, shape, smem_limit)
    return outcomes
