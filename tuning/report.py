"""The end-of-run summary: one markdown row per M, and the same numbers as JSON."""

from __future__ import annotations

from ling_tuning.compare import Row, Timing
from ling_tuning.space import Config
from ling_tuning.tuner import MOutcome

_SHORT = {"BLOCK_SIZE_M": "BM", "BLOCK_SIZE_N": "BN", "BLOCK_SIZE_K": "BK", "GROUP_SIZE_M": "GM",
          "num_warps": "w", "num_stages": "s"}


def tiles_text(cfg: Config | None) -> str:
    if not cfg:
        return "-"
    return " ".join(f"{short}{cfg[k]}" for k, short in _SHORT.items() if k in cfg)


def _us(t: Timing) -> str:
    return f"{t.us:.1f}" if t.us else ("fails" if t.error else "-")


def _ratio(base: Timing, tuned: Timing) -> str:
    return f"{base.us / tuned.us:.2f}x" if base.us and tuned.us else "-"


def summary_table(rows: list[Row], expert_bytes: int, copy_gbs: float) -> str:
    """M, tiles, tuned time, GB/s and share of copy bandwidth, speed-up vs default and vs Marlin."""
    head = ("| M | kernel | tuned tiles | tuned µs | GB/s | % of copy BW | vs default | vs Marlin "
            "| default µs | Marlin µs | Marlin GB/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        gbs, mgbs = r.gbs(r.tuned, expert_bytes), r.gbs(r.marlin, expert_bytes)
        lines.append(
            f"| {r.m} | {r.kernel} | {tiles_text(r.tiles)} | {_us(r.tuned)} | "
            f"{f'{gbs:,.0f}' if gbs else '-'} | {f'{100 * gbs / copy_gbs:.0f}%' if gbs and copy_gbs else '-'} | "
            f"{_ratio(r.default, r.tuned)} | {_ratio(r.marlin, r.tuned)} | {_us(r.default)} | {_us(r.marlin)} | "
            f"{f'{mgbs:,.0f}' if mgbs else '-'} |")
    return "\n".join(lines)


def _default_us(o: MOutcome) -> str:
    if o.default is None:
        return "-"
    return f"{o.default.us:.1f}" if o.default.status == "ok" else "fails"


def tuning_table(outcomes: dict[int, MOutcome]) -> str:
    """How each M's search went: candidates, pruned, measured/reused/skipped, rejections, vLLM's
    default (timed first; it competes, so best µs <= default µs whenever it runs) and the best."""
    lines = ["| M | kernel | candidates | pruned before launch | measured | reused | skipped (budget) "
             "| rejected | default µs | best µs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m, o in sorted(outcomes.items()):
        pruned = ", ".join(f"{k} {v}" for k, v in sorted(o.pruned.items())) or "0"
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(o.rejected.items())) or "0"
        lines.append(f"| {m} | {o.kernel} | {o.candidates} | {pruned} | {o.measured} | {o.reused} | "
                     f"{o.skipped} | {rejected} | {_default_us(o)} | {f'{o.best.us:.1f}' if o.best else '-'} |")
    return "\n".join(lines)
