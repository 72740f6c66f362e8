"""Every GPU step of the tuner in one process (one vLLM import, one set of weights), each step
catching and recording its own failure. Run by tests/gpu/tuning_run.sh on the H200 (lab scaffolding: it
stays out of the installed package):

    python3 tests/gpu/tuning_steps.py --out "$OUT"

1. ling-tune for Ling-3.0-flash on this GPU at a reduced M set (+ one Triton-kernel M);
2. the same with --smem-limit 101376 (GB10 emulated), reusing step 1's measurements;
3. vLLM's lookup proof and default vs tuned vs Marlin at M = 1..256 (inside each ling-tune run);
4. the KDA smem guard at 101,376 B on vLLM's vendored FLA kernels.
Writes tune_h200.json, tune_gb10emu.json, kda_guard.json, tuned_tables.json and summary.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ling_tuning import cli
from ling_tuning.shapes import PRESETS
from ling_tuning.smem import GB10_SMEM_PER_BLOCK

BENCH_MS = "1,2,4,8,16,64,256,1024"


def _step(name: str, status: dict[str, Any], fn: Callable[[], Any]) -> Any:
    t0 = time.monotonic()
    try:
        result = fn()
        status[name] = {"ok": True, "seconds": round(time.monotonic() - t0, 1)}
        return result
    except BaseException as e:  # a step's failure is a result; the next step still runs
        status[name] = {"ok": False, "seconds": round(time.monotonic() - t0, 1),
                        "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        print(f"[tuning_steps] {name} failed: {type(e).__name__}: {e}", flush=True)
        if isinstance(e, KeyboardInterrupt):
            raise
        return None


def _tune(runner: Any, folder: Path, report: Path, extra: list[str], budget_min: float, ms: str,
          max_candidates: int) -> dict[str, Any]:
    args = cli.parser().parse_args([
        "--model", "ling-3.0-flash", "--batch-sizes", ms, "--bench-batch-sizes", BENCH_MS, "--space", "quick",
        "--max-candidates", str(max_candidates), "--budget", str(budget_min), "--out", str(folder),
        "--no-progress", *extra])
    doc = cli.run(args, runner_factory=lambda shape, a: runner)
    report.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if "error" in doc:
        raise RuntimeError(doc["error"])
    print(doc["tuning_md"] + "\n\n" + doc["summary_md"], flush=True)
    return doc


def _summary(status: dict[str, Any], docs: dict[str, Any]) -> str:
    brief = {k: {kk: vv for kk, vv in v.items() if kk != "traceback"} if isinstance(v, dict) else v
             for k, v in status.items()}
    md = ["# ling-tune on the device", "", "```", json.dumps(brief, indent=1, default=str), "```"]
    for key, doc in docs.items():
        if not doc:
            continue
        check = doc.get("vllm_check") or {}
        md += ["", f"## {key}: smem limit {doc['smem_limit']} B (emulated: {doc['emulated']})", "",
               doc["tuning_md"], "", doc["summary_md"], "",
               f"- tuned file: `{doc['tuned_file']}`; vLLM loads it: {check.get('loaded')}, "
               f"default-config warning: {check.get('default_warning')}",
               f"- backend choice: {doc['choice']['moe_backend']} ({doc['choice']['reason']})",
               f"- smem model vs compiled: {json.dumps(doc['smem_model'])}",
               f"- timing: {doc.get('timing_mode')}"]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/ling-tune-device"))
    p.add_argument("--ms", default=BENCH_MS, help="batch sizes to tune")
    p.add_argument("--budget", type=float, default=float(os.environ.get("LING_TUNE_BUDGET_MIN", "2.0")),
                   help="minutes for the native tuning loop (the emulated run gets half)")
    p.add_argument("--max-candidates", type=int, default=int(os.environ.get("LING_TUNE_MAX_CANDIDATES", "16")))
    p.add_argument("--kda-seq-len", type=int, default=2048)
    p.add_argument("--engine-backends", default=os.environ.get("LING_TUNE_ENGINE_BACKENDS", "none"),
                   help="ling-tune's engine race on the native run (e.g. marlin,humming,triton: ~2-3 min an "
                        "engine); none keeps the step within its ~7 min")
    p.add_argument("--skip-kda", action="store_true")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(args.work, ignore_errors=True)
    status: dict[str, Any] = {}
    docs: dict[str, Any] = {}

    def flush() -> None:  # after every step, so a step killed by the outer timeout loses only itself
        (args.out / "steps.json").write_text(json.dumps(status, indent=2, default=str) + "\n")
        (args.out / "summary.md").write_text(_summary(status, docs))
        tables = {k: {f: d.get(f) for f in ("tuned_file", "table", "choice", "vllm_check", "file_name")}
                  for k, d in docs.items() if d}
        (args.out / "tuned_tables.json").write_text(json.dumps(tables, indent=2, default=str) + "\n")

    from ling_tuning.gpu_bench import CudaRunner, kda_guard_demo

    runner = _step("runner", status, lambda: CudaRunner(PRESETS["ling-3.0-flash"]))
    if runner is not None:
        status["device"] = vars(runner.device)
        native, emu = args.work / "tuned-h200", args.work / "tuned-gb10emu"
        engine = ["--engine-backends", args.engine_backends]  # the race reads the tuned file just written
        docs["h200"] = _step("tune_h200", status, lambda: _tune(
            runner, native, args.out / "tune_h200.json", engine, args.budget, args.ms, args.max_candidates))
        flush()

        def emulated() -> dict[str, Any]:
            if (native / ".ling-tune").is_dir():  # same device and shape: reuse every measurement
                shutil.copytree(native / ".ling-tune", emu / ".ling-tune", dirs_exist_ok=True)
            return _tune(runner, emu, args.out / "tune_gb10emu.json",  # no engine race under emulation
                         ["--smem-limit", str(GB10_SMEM_PER_BLOCK), "--engine-backends", "none"],
                         args.budget / 2, args.ms, args.max_candidates)
        docs["gb10emu"] = _step("tune_gb10emu", status, emulated)
        flush()
        del runner
    if not args.skip_kda:
        guard = _step("kda_guard", status, lambda: kda_guard_demo(GB10_SMEM_PER_BLOCK, args.kda_seq_len))
        if guard is not None:
            (args.out / "kda_guard.json").write_text(json.dumps(guard, indent=2, default=str) + "\n")
            status["kda_guard"]["guard_ok"] = guard["ok"]
    flush()
    return 0 if all(v.get("ok") for k, v in status.items() if k != "device") else 1


if __name__ == "__main__":
    raise SystemExit(main())
