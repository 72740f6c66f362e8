"""The headline comparisons as SVG charts, drawn from `ling_bench.fullsize` JSON (results/), with no plotting library.

    python3 -m ling_bench.charts results/h200-2026-12-03-side-by-side/v033/*.json --out charts/

writes, for the files that hold them:
- `decode_step.svg`: the decode step (ms) of every plain run, one bar per file, labelled by path (implementation,
  FP8, KDA gate, router, vLLM release), with its tok/s;
- `spec_tok_s.svg`: tok/s by speculation method and acceptance length: every MTP run's acceptance phases
  (synthetic acceptance length asked, the share of drafts accepted as counted, draft vocabulary), beside the plain
  runs' tok/s as "no speculation".

A file that is not a full-size run (a GPU test's records, a kernel benchmark) is skipped with a note on stderr.
Exit 1 when no file holds anything to draw.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

WIDTH, LEFT, RIGHT, TOP, ROW, BAR = 1000, 400, 200, 48, 26, 18  # px: chart width, label column, value column, ...


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    note: str = ""  # written after the value


def _load(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        print(f"ling_bench.charts: skipped {path}: {e}", file=sys.stderr)
        return None
    if not isinstance(data, dict) or "decode_step_ms" not in data or "impl" not in data:
        print(f"ling_bench.charts: skipped {path}: not a ling_bench.fullsize result", file=sys.stderr)
        return None
    return data


def path_label(run: dict[str, Any]) -> str:
    """'ours + FP8 w8a8, vLLM 0.33.0' and what differs from the recipe's defaults (KDA gate, router, MoE alignment)."""
    parts = ["vLLM in-tree" if run.get("impl") in ("vllm", "vllm-bare") else "ours"]
    if run.get("fp8") not in (None, "", "off", False):
        parts.append(f"FP8 {run['fp8']}")
    if run.get("impl") == "ours":
        if run.get("kda_gate_asked") == "ours":
            parts.append("our KDA gate")
        if run.get("router_asked") == "vllm":
            parts.append("vLLM router")
        if run.get("moe_align_asked") == "ours":
            parts.append("our MoE align")
    label = " + ".join(parts)
    return f"{label}, vLLM {run['vllm']}" if run.get("vllm") else label


def decode_bars(runs: list[tuple[str, dict[str, Any]]]) -> list[Bar]:
    """One bar per plain (non-MTP) run: its decode step in ms."""
    return [Bar(f"{path_label(run)} ({name})", float(run["decode_step_ms"]), f"{run.get('decode_tok_s', 0):.1f} tok/s")
            for name, run in runs if run.get("mode") != "mtp"]


def spec_bars(runs: list[tuple[str, dict[str, Any]]]) -> list[Bar]:
    """tok/s per speculation method and acceptance length; plain runs as 'no speculation'."""
    bars = []
    for name, run in runs:
        if run.get("mode") != "mtp":
            bars.append(Bar(f"no speculation ({name})", float(run.get("decode_tok_s", 0.0)), path_label(run)))
            continue
        method = "MTP k=1" + (f", draft vocab {run['draft_vocab']}" if run.get("draft_vocab") else "")
        for phase in run.get("by_acceptance") or []:
            accepted = phase.get("accepted_per_draft")
            note = f"{accepted:.1%} accepted" if accepted is not None else ""
            bars.append(Bar(f"{method}, length {phase['synthetic_acceptance_length']} ({name})",
                            float(phase["decode_tok_s"]), note))
    return bars


def svg_bars(title: str, unit: str, bars: list[Bar]) -> str:
    """A horizontal bar chart: one row per bar, the longest bar spanning the plot, values written at each bar's end."""
    height = TOP + ROW * len(bars) + 16
    peak = max((b.value for b in bars), default=0.0) or 1.0
    plot = WIDTH - LEFT - RIGHT
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
           f'<text x="{LEFT}" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
           f'<text x="{LEFT}" y="38" fill="#555">{escape(unit)}</text>']
    for i, bar in enumerate(bars):
        y = TOP + i * ROW
        w = max(bar.value, 0.0) / peak * plot
        value = f"{bar.value:,.3f}".rstrip("0").rstrip(".") if bar.value < 100 else f"{bar.value:,.1f}"
        out += [f'<text x="{LEFT - 8}" y="{y + BAR - 5}" text-anchor="end">{escape(bar.label)}</text>',
                f'<rect x="{LEFT}" y="{y}" width="{w:.1f}" height="{BAR}" fill="#4878a8"/>',
                f'<text x="{LEFT + w + 6:.1f}" y="{y + BAR - 5}">{escape(value)}'
                + (f' <tspan fill="#555">{escape(bar.note)}</tspan>' if bar.note else "") + "</text>"]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def charts(paths: list[Path]) -> dict[str, str]:
    """file name -> SVG text, for each chart the inputs hold data for."""
    runs = [(p.stem, run) for p in paths if (run := _load(p)) is not None]
    found = {}
    if decode := decode_bars(runs):
        found["decode_step.svg"] = svg_bars("Decode step by path", "ms per decode step, batch 1 (shorter is faster)",
                                            decode)
    if any(run.get("mode") == "mtp" for _, run in runs):
        found["spec_tok_s.svg"] = svg_bars("Decode tok/s by speculation method and acceptance length",
                                           "tokens per second, batch 1 (synthetic acceptance for MTP)", spec_bars(runs))
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m ling_bench.charts", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="ling_bench.fullsize JSON files (others are skipped)")
    ap.add_argument("--out", type=Path, required=True, help="folder for the SVG files (created)")
    args = ap.parse_args(argv)
    found = charts(args.results)
    if not found:
        print("ling_bench.charts: no ling_bench.fullsize result among the files: nothing to draw", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    for name, svg in found.items():
        (args.out / name).write_text(svg)
        print(args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
