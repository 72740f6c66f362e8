"""ling_bench.charts on the full-size runs the H200 wrote (results/), and on files that hold nothing to draw."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from ling_bench.charts import Bar, main, path_label, svg_bars

RUN = Path(__file__).resolve().parents[2] / "results" / "h200-2026-12-03-side-by-side" / "v033"
SVG = "{http://www.w3.org/2000/svg}"


def _texts(svg: Path) -> str:
    return " ".join("".join(t.itertext()) for t in ET.parse(svg).getroot().iter(f"{SVG}text"))


def test_the_headline_charts_from_the_raw_json(tmp_path, capsys):
    files = [str(RUN / f"{n}.json") for n in ("fs_plain", "fs_intree", "fs_nofp8", "fs_mtp")]
    assert main([*files, "--out", str(tmp_path)]) == 0
    decode = _texts(tmp_path / "decode_step.svg")
    assert "ours + FP8 w8a8, vLLM 0.33.0 (fs_plain)" in decode and "3.99" in decode  # 3.990 ms (BENCHMARKS.md)
    assert "vLLM in-tree, vLLM 0.33.0 (fs_intree)" in decode and "5.435" in decode
    assert "fs_mtp" not in decode  # an MTP run has no plain decode step
    spec = _texts(tmp_path / "spec_tok_s.svg")
    assert "MTP k=1, length 1.94 (fs_mtp)" in spec and "444.9" in spec and "94.0% accepted" in spec
    assert "MTP k=1, length 1.7 (fs_mtp)" in spec
    assert "no speculation (fs_plain)" in spec
    assert capsys.readouterr().out.split() == [str(tmp_path / "decode_step.svg"), str(tmp_path / "spec_tok_s.svg")]


def test_bars_are_proportional_and_the_longest_fills_the_plot():
    root = ET.fromstring(svg_bars("t", "u", [Bar("a", 2.0), Bar("b", 4.0)]))
    widths = [float(r.get("width")) for r in root.iter(f"{SVG}rect") if r.get("fill") != "white"]
    assert widths[1] == 2 * widths[0] and widths[1] > 300


def test_labels_are_escaped():
    root = ET.fromstring(svg_bars("a <b> & c", "u", [Bar("x & <y>", 1.0, note="<n>")]))
    assert "x & <y>" in " ".join("".join(t.itertext()) for t in root.iter(f"{SVG}text"))


def test_a_path_is_named_by_what_differs_from_the_recipe():
    assert path_label({"impl": "ours", "fp8": "w8a8", "kda_gate_asked": "ours", "vllm": "0.33.0"}) == \
        "ours + FP8 w8a8 + our KDA gate, vLLM 0.33.0"
    assert path_label({"impl": "vllm", "fp8": None}) == "vLLM in-tree"
    assert path_label({"impl": "ours", "fp8": "off", "vllm": "0.33.0"}) == "ours, vLLM 0.33.0"


def test_files_without_a_fullsize_run_are_skipped_and_nothing_drawn_is_an_error(tmp_path, capsys):
    records = tmp_path / "records.json"
    records.write_text(json.dumps({"tests": []}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert main([str(records), str(broken), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "skipped" in err and "nothing to draw" in err
    assert not (tmp_path / "out").exists()
