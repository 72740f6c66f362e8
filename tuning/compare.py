"""Per batch size: vLLM's default tiles vs the tuned file vs Marlin, on the same weights and inputs.

"tuned" goes through vLLM's own lookup of the written file (not an override), so a row with a
time also proves vLLM found and used the file. Achieved bandwidth counts what one call must
stream: distinct experts touched x bytes per expert (int4 weights + bf16 group scales).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ling_tuning.configfile import lookup
from ling_tuning.runner import REL_TOL, Measured, Runner
from ling_tuning.shapes import MoEShape
from ling_tuning.space import Config, uses_cuda_kernel


@dataclass(frozen=True)
class Timing:
    us: float | None = None
    rel_err: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class Row:
    m: int
    kernel: str
    experts: float
    tuned: Timing
    default: Timing
    marlin: Timing
    tiles: Config | None = None

    def gbs(self, t: Timing, expert_bytes: int) -> float | None:
        """Achieved GB/s of a timing: the bytes this call streams over its time."""
        return self.experts * expert_bytes / (t.us * 1e3) if t.us else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _timed(fn: Callable[..., Measured], *args: Any) -> Timing:
    try:
        got = fn(*args)
    except Exception as e:  # a baseline that crashes (vLLM's default at M <= 2) is a result too
        return Timing(error=f"{type(e).__name__}: {e}"[:300])
    if got.us is None or not got.rel_err <= REL_TOL:
        return Timing(rel_err=got.rel_err, error=f"wrong result: rel_err {got.rel_err:.3g} > {REL_TOL}")
    return Timing(us=got.us, rel_err=got.rel_err)


def compare(shape: MoEShape, ms: list[int], runner: Runner, folder: Path,
            table: dict[int, Config], with_marlin: bool = True) -> list[Row]:
    """Time default, tuned (through the file in `folder`) and Marlin at each M."""
    rows = []
    for m in ms:
        rows.append(Row(
            m=m,
            kernel="cuda_wna16" if uses_cuda_kernel(m, shape) else "triton_wna16",
            experts=runner.experts_touched(m),
            tuned=_timed(runner.triton, m, None, folder),
            default=_timed(runner.triton, m, None, None),
            marlin=_timed(runner.marlin, m) if with_marlin else Timing(error="not measured"),
            tiles=table[lookup(table, m)] if table else None,
        ))
    return rows
