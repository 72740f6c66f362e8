"""ling-tune: tune vLLM's INT4 fused-MoE tiles for one model on this GPU, once per machine.

    ling-tune --model ling-3.0-flash            # or a checkpoint folder / config.json
    export VLLM_TUNED_CONFIG_FOLDER=~/.cache/vllm-ling/moe-configs   # printed at the end

Steps: shapes from the config -> candidates pruned by the shared-memory limit -> each checked
against a dequantized reference and timed (resumable log, bounded budget) -> the tuned file under
vLLM's exact name -> vLLM's own lookup proves it loads -> default vs tuned vs Marlin per M -> on vLLM >= 0.28,
Marlin vs Humming vs tuned Triton as decode steps of one engine each (ling_tuning.engine_compare) ->
backend_choice.json. `--smem-limit 101376` emulates GB10 on a larger GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ling_tuning.choice import write_choice
from ling_tuning.compare import compare
from ling_tuning.configfile import TUNED_FOLDER_ENV, build_table, config_file_name, unsafe_lookups, write_table
from ling_tuning.engine_compare import BACKENDS as ENGINE_BACKENDS
from ling_tuning.engine_compare import EngineResult, check_backends, compare_engines
from ling_tuning.engine_compare import report as engine_report
from ling_tuning.report import summary_table, tuning_table
from ling_tuning.runner import REL_TOL, NoDevice, Runner
from ling_tuning.shapes import MoEShape, default_batch_sizes, positive_ints, resolve_model
from ling_tuning.smem import triton_wna16_smem
from ling_tuning.space import SPACES, Config, uses_cuda_kernel
from ling_tuning.store import ResultStore
from ling_tuning.tuner import DeviceBroken, MOutcome, tune

DEFAULT_OUT = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-ling" / "moe-configs"
RunnerFactory = Callable[[MoEShape, argparse.Namespace], Runner]
Prover = Callable[[Path, MoEShape, dict[int, Config]], dict[str, Any]]
EngineCompare = Callable[..., list[EngineResult]]  # compare_engines' signature
ENGINE_MAX_M = 1024  # decode batches an engine comparison runs (M = 1..1024; beyond it is prefill)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ling-tune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="preset (ling-3.0-flash), checkpoint folder or config.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (N = moe_intermediate_size / tp)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="largest MoE batch served (vLLM --max-num-batched-tokens); sets the default M grid")
    p.add_argument("--batch-sizes", type=positive_ints, help="M values to tune (default: vLLM's grid up to the max)")
    p.add_argument("--bench-batch-sizes", type=positive_ints,
                   help="M values for the default/tuned/Marlin comparison (default: the tuned ones)")
    p.add_argument("--space", choices=sorted(SPACES), default="quick", help="Triton search space (M > 6E/top_k)")
    p.add_argument("--smem-limit", type=int,
                   help="shared memory per block in bytes (default: the device's; 101376 emulates GB10)")
    p.add_argument("--budget", type=float, default=60.0, help="minutes for the tuning loop (resume to go on)")
    p.add_argument("--max-candidates", type=int,
                   help="Triton-kernel M: time at most this many configs (a seeded sample; each one compiles)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"tuned-config folder (default {DEFAULT_OUT})")
    p.add_argument("--decode-max-m", type=int, default=64,
                   help="largest M that counts as decode for the backend choice")
    p.add_argument("--margin", type=float, default=0.05, help="speed-up Triton needs over Marlin to be chosen")
    p.add_argument("--no-marlin", action="store_true", help="skip the Marlin comparison")
    p.add_argument("--engine-backends", default="auto",
                   help=f"backends to race as engine decode steps, of {list(ENGINE_BACKENDS)}; 'auto': all of them "
                        "on vLLM >= 0.28 with CUDA, else none; 'none' skips (the kernel comparison decides)")
    p.add_argument("--engine-layers", type=int, default=8, help="MLA + MoE layers of the engine comparison's model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--report", type=Path, help="also write the full report JSON here")
    return p


def cuda_runner(shape: MoEShape, args: argparse.Namespace) -> Runner:
    from ling_tuning.gpu_bench import CudaRunner

    return CudaRunner(shape, seed=args.seed)


def vllm_prover(folder: Path, shape: MoEShape, table: dict[int, Config]) -> dict[str, Any]:
    from ling_tuning.vllm_check import prove_vllm_loads

    return prove_vllm_loads(folder, shape, table)


def _smem_model_check(store: ResultStore, ms: list[int], shape: MoEShape) -> dict[str, Any]:
    """Estimate vs compiled shared memory over every Triton config measured (underestimates matter)."""
    pairs = [(r.config, triton_wna16_smem(r.config), r.smem) for m in ms if not uses_cuda_kernel(m, shape)
             for r in store.results(m) if r.smem is not None and "BLOCK_SIZE_N" in r.config]
    under = [{"config": c, "estimate": est, "compiled": got} for c, est, got in pairs if got > est]
    return {"checked": len(pairs), "exact": sum(est == got for _, est, got in pairs),
            "underestimates": under[:20], "max_overestimate": max((est - got for _, est, got in pairs), default=0)}


def _outcome_json(o: MOutcome) -> dict[str, Any]:
    best, default = o.best, o.default
    return {"M": o.m, "kernel": o.kernel, "candidates": o.candidates, "pruned": o.pruned,
            "measured": o.measured, "reused": o.reused, "skipped": o.skipped, "rejected": o.rejected,
            "best": None if best is None else {"config": best.config, "us": best.us, "rel_err": best.rel_err,
                                                "smem": best.smem},
            "default": None if default is None else {"config": default.config, "status": default.status,
                                                      "us": default.us, "detail": default.detail}}


def engine_backends(text: str) -> list[str]:
    """--engine-backends resolved: 'auto' is every backend on a GPU (every supported vLLM honours --moe-backend
    for compressed-tensors INT4 experts), none without one."""
    if text == "none":
        return []
    if text == "auto":
        import torch

        return list(ENGINE_BACKENDS) if torch.cuda.is_available() else []
    try:
        return check_backends([b for b in text.split(",") if b])
    except ValueError as e:
        raise ValueError(f"--engine-backends {text}: {e}, auto or none") from None


def _engine_report(args: argparse.Namespace, source: str, ms: list[int], out: Path,
                   engine: EngineCompare) -> tuple[list[EngineResult], dict[str, Any]]:
    backends = engine_backends(args.engine_backends)
    ms = [m for m in ms if m <= ENGINE_MAX_M]
    if not backends:
        return [], {"skipped": "no backends (--engine-backends none, or vLLM < 0.28 / no CUDA under auto)"}
    if not Path(source).is_file():
        return [], {"skipped": f"needs a config.json, the model resolved to {source}"}
    print(f"ling-tune: engine comparison of {backends} at M={ms} ({args.engine_layers} layers)", file=sys.stderr)
    results = engine(Path(source), backends, ms, out / ".ling-tune", tuned_folder=out, layers=args.engine_layers)
    return results, engine_report(results, ms, args.engine_layers)


def run(args: argparse.Namespace, runner_factory: RunnerFactory = cuda_runner,
        prover: Prover | None = vllm_prover, clock: Callable[[], float] | None = None,
        engine: EngineCompare = compare_engines) -> dict[str, Any]:
    """The whole flow; returns the report (also written to <out>/tune-report.json)."""
    shape, source = resolve_model(args.model, args.tp)
    max_tokens = args.max_num_batched_tokens
    ms = args.batch_sizes or default_batch_sizes(max_tokens)
    if ms[-1] > max_tokens:
        raise SystemExit(f"--batch-sizes up to {ms[-1]} exceed --max-num-batched-tokens {max_tokens}; "
                         "raise the latter or drop the larger sizes")
    print(f"ling-tune: {source}: E={shape.num_experts} N={shape.intermediate} hidden={shape.hidden} "
          f"top-{shape.top_k} group {shape.group_size} -> dtype={shape.dtype}; M={ms}", file=sys.stderr)
    runner = runner_factory(shape, args)
    dev = runner.device
    limit = args.smem_limit or dev.smem_limit
    if limit > dev.smem_limit:
        raise SystemExit(f"--smem-limit {limit} exceeds this device's {dev.smem_limit} B per block; "
                         "a limit can only emulate a smaller GPU (GB10: 101376)")
    name = dev.vllm_file_name or config_file_name(shape, dev.name)
    out = args.out.expanduser().resolve()
    meta = {"shape": shape.to_dict(), "device": dev.name, "vllm": dev.vllm_version, "triton": dev.triton_version,
            "rel_tol": REL_TOL, "seed": args.seed, "runner": getattr(runner, "meta", {})}
    store = ResultStore(out / ".ling-tune", meta)
    kwargs = {"clock": clock} if clock else {}
    outcomes = tune(shape, ms, runner, store, limit, args.space, args.budget * 60, progress=not args.no_progress,
                    max_candidates=args.max_candidates, **kwargs)
    best = {m: o.best.config for m, o in outcomes.items() if o.best}
    report: dict[str, Any] = {
        "model": source, "shape": shape.to_dict(), "device": dataclasses.asdict(dev),
        "smem_limit": limit, "emulated": limit < dev.smem_limit, "batch_sizes": ms, "space": args.space,
        "tuning": [_outcome_json(outcomes[m]) for m in ms], "results_log": str(store.path),
        "smem_model": _smem_model_check(store, ms, shape),
        "file_name": {"vllm": dev.vllm_file_name, "ours": config_file_name(shape, dev.name)},
    }
    if not best:
        report["error"] = "no candidate passed the correctness check at any M; nothing written"
        return report
    table = build_table(best, shape)
    report["unsafe_lookups"] = unsafe_lookups(table, shape, limit, max(max_tokens, ms[-1]))
    if report["unsafe_lookups"]:
        report["error"] = "tuned table would send some M to a config its kernel rejects; not written"
        return report
    path = write_table(out, name, table, dev.triton_version)
    report |= {"tuned_file": str(path), "table": {str(k): v for k, v in table.items()},
               "env": {TUNED_FOLDER_ENV: str(out)}}
    if prover is not None:
        try:
            report["vllm_check"] = prover(out, shape, table)
        except Exception as e:
            report["vllm_check"] = {"loaded": False, "error": f"{type(e).__name__}: {e}"}
    rows = compare(shape, args.bench_batch_sizes or ms, runner, out, table, with_marlin=not args.no_marlin)
    report["comparison"] = [r.to_dict() for r in rows]
    engine_results, report["engine_comparison"] = _engine_report(args, source, args.bench_batch_sizes or ms, out,
                                                                 engine)
    report["choice"] = write_choice(out, dev.name, rows, args.decode_max_m, args.margin,
                                    extra={"shape": shape.to_dict(), "tuned_file": str(path),
                                           "vllm_version": dev.vllm_version, "triton_version": dev.triton_version},
                                    engine=engine_results)
    report["timing_mode"] = getattr(runner, "timing_mode", None)
    report["summary_md"] = summary_table(rows, shape.expert_bytes, dev.copy_gbs)
    report["tuning_md"] = tuning_table(outcomes)
    return report


def main(argv: list[str] | None = None, runner_factory: RunnerFactory = cuda_runner,
         prover: Prover | None = vllm_prover, clock: Callable[[], float] | None = None,
         engine: EngineCompare = compare_engines) -> int:
    args = parser().parse_args(argv)
    for flag in ("tp", "budget", "smem_limit", "max_candidates", "max_num_batched_tokens", "engine_layers"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            parser().error(f"--{flag.replace('_', '-')} {value}: must be positive")
    if args.engine_backends != "auto":  # bad input is refused before an hour of tuning, not after
        try:
            engine_backends(args.engine_backends)
        except ValueError as e:
            parser().error(str(e))
    try:
        report = run(args, runner_factory, prover, clock, engine)
    except (FileNotFoundError, ValueError, KeyError, NoDevice) as e:
        print(f"ling-tune: {e}", file=sys.stderr)
        return 2
    except DeviceBroken as e:
        print(f"ling-tune: {e}", file=sys.stderr)
        return 3
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=2, default=str) + "\n"
    (out / "tune-report.json").write_text(text)
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    if "error" in report:
        print(f"ling-tune: {report['error']}", file=sys.stderr)
        return 1
    print(report["tuning_md"] + "\n\n" + report["summary_md"])
    check = report.get("vllm_check") or {}
    choice = report["choice"]
    print(f"\ntuned file: {report['tuned_file']}")
    print(f"vLLM loads it: {check.get('loaded')} (default-config warning: {check.get('default_warning')})")
    print(f"MoE backend for this device: {choice['moe_backend']} ({choice['reason']})")
    print(f"serve with: export {TUNED_FOLDER_ENV}={out}")
    return 0 if check.get("loaded", prover is None) else 1


if __name__ == "__main__":
    sys.exit(main())
