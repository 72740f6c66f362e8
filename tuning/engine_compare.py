"""Per batch size, every INT4 MoE backend of vLLM >= 0.28 timed where it serves: inside vLLM's engine.

The kernel comparison (`ling_tuning.compare`) calls Marlin and the wna16 kernels directly; Humming (vLLM
0.33's default on sm_90) is reachable only through vLLM's modular MoE kernel and its own weight conversion,
so the fair race of all of them is one engine per backend (`--moe-backend`), alike in everything else:

* a short model with the real MoE shape: the model's config cut to `layers` MLA + MoE layers (no KDA, whose
  Triton JIT would dominate the run; no MTP) and a small vocabulary (so the LM head does not hide the MoE),
  dummy weights, eager (the MoE kernels are the ones CUDA graphs replay; no compile or capture to wait for);
* at each M, M requests decoding together: GPU kernel µs per decode step, from the torch profiler over
  (1 + D tokens) − (1 token), so the prefill and the host's overhead (which rules a short model's step) drop out.

Steps differ between backends only in their MoE, so (step_b − step_marlin) / layers is the per-layer
difference. Each engine runs in its own process (vLLM does not give GPU memory back between engines), and
vLLM's log must name the backend asked for, or that backend's timings are discarded. Correctness of each
backend is the GPU model test's job (tests/gpu/test_model_gpu.py runs the tiny INT4 model on each of them).

    python -m ling_tuning.engine_compare --model ling-3.0-flash --backends marlin,humming --ms 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ling_common.vllm_log import served_int4_backend
from ling_tuning.shapes import positive_ints, resolve_model

BACKENDS = ("marlin", "humming", "triton")
Spawn = Callable[[list[str], dict[str, str], float], tuple[int, str]]


@dataclass(frozen=True)
class EngineResult:
    """One backend: GPU kernel µs per decode step at each M (and kernels per step), what vLLM's log says served,
    or why it has no timings."""

    backend: str
    step_us: dict[int, float] = field(default_factory=dict)
    served: str | None = None
    error: str | None = None
    kernels: dict[int, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def short_config(config: dict[str, Any], layers: int = 8, vocab: int = 4096) -> dict[str, Any]:
    """The model's config with `layers` layers, each MLA attention + the routed-expert MoE (layer_group_size 1
    makes every layer MLA; first_k_dense_replace 0 makes every one MoE), no MTP, a `vocab`-token vocabulary.
    The MoE shape (experts, widths, top-k, INT4 scheme) is untouched: it is what is measured."""
    cfg = dict(config)
    if layers < 1:
        raise ValueError(f"layers={layers}: need at least one MoE layer")
    cfg |= {"num_hidden_layers": layers, "layer_group_size": 1, "first_k_dense_replace": 0,
            "num_nextn_predict_layers": 0, "vocab_size": vocab, "eos_token_id": vocab - 1,
            "pad_token_id": vocab - 2}
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):  # the deepest layers' limits
        if isinstance(cfg.get(key), list):
            cfg[key] = (cfg[key] * layers)[-layers:] if len(cfg[key]) < layers else cfg[key][-layers:]
    return cfg


def write_short_model(config_path: Path, folder: Path, layers: int = 8) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    cfg = short_config(json.loads(Path(config_path).read_text()), layers)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


def served_backend(log: str) -> str | None:
    """The INT4 MoE backend vLLM's log names, lower case (the self-check's reading of the same line)."""
    found = served_int4_backend(log)
    return found[0] if found else None


def _subprocess(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run one engine; its own session so a timeout takes vLLM's children with it."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return 124, (out or "") + f"\n[timed out after {timeout:.0f} s]"
    return proc.returncode, out or ""


def check_backends(backends: list[str]) -> list[str]:
    """The backends, if each is one the race can ask vLLM for; else ValueError naming the others."""
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise ValueError(f"unknown MoE backends {unknown}; choose from {list(BACKENDS)}")
    return backends


def compare_engines(config_path: Path, backends: list[str], ms: list[int], workdir: Path,
                    tuned_folder: Path | None = None, layers: int = 8, timeout: float = 600.0,
                    spawn: Spawn = _subprocess,
                    done: Callable[[list[EngineResult]], None] | None = None) -> list[EngineResult]:
    """One engine process per backend on the short model; triton reads the tuned tiles in `tuned_folder`
    (vLLM's default wna16 tiles crash at M <= 2 for Ling's shape). `done` sees the results so far after each
    engine, so a run cut short keeps the backends it finished."""
    check_backends(backends)
    model = write_short_model(config_path, workdir / "short-model", layers)
    results = []
    for backend in backends:
        if backend == "triton" and tuned_folder is None:
            results.append(EngineResult(backend, error="triton needs the tuned tile file (vLLM's default tiles "
                                                         "crash at M <= 2 for this shape): not measured"))
            continue
        out = workdir / f"engine-{backend}.json"
        out.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k != "VLLM_TUNED_CONFIG_FOLDER"}
        if tuned_folder is not None:
            env["VLLM_TUNED_CONFIG_FOLDER"] = str(tuned_folder)
        cmd = [sys.executable, "-m", "ling_tuning.engine_compare", "--worker", str(model), "--backends", backend,
               "--ms", ",".join(map(str, ms)), "--out", str(out)]
        rc, log = spawn(cmd, env, timeout)
        (workdir / f"engine-{backend}.log").write_text(log)  # the whole engine log, kept beside its timings
        results.append(_result(backend, rc, log, out))
        print(f"ling-tune: engine {backend}: served {results[-1].served}, "
              f"{results[-1].error or f'{len(results[-1].step_us)} batch sizes timed'}", file=sys.stderr)
        if done is not None:
            done(results)
    return results


def _result(backend: str, rc: int, log: str, out: Path) -> EngineResult:
    served = served_backend(log)
    if rc != 0 or not out.is_file():
        tail = " | ".join(line for line in log.strip().splitlines()[-3:])
        return EngineResult(backend, served=served, error=f"engine exited {rc}: {tail[-400:]}")
    if served != backend:
        return EngineResult(backend, served=served,
                            error=f"asked for {backend}, vLLM's log names {served or 'no INT4 MoE backend'}")
    doc = json.loads(out.read_text())
    return EngineResult(backend, step_us={int(m): float(us) for m, us in doc["step_us"].items()}, served=served,
                        kernels={int(m): float(n) for m, n in doc.get("kernels_per_step", {}).items()})


def per_layer_delta_us(results: list[EngineResult], layers: int, baseline: str = "marlin") -> dict[str, dict[int, float]]:
    """(step_b − step_baseline) / layers at each M both measured: the per-MoE-layer difference."""
    base = next((r for r in results if r.backend == baseline and r.step_us), None)
    if base is None:
        return {}
    return {r.backend: {m: (us - base.step_us[m]) / layers for m, us in r.step_us.items() if m in base.step_us}
            for r in results if r.step_us and r.backend != baseline}


def report(results: list[EngineResult], ms: list[int], layers: int) -> dict[str, Any]:
    """The race's JSON document (ling-tune's `engine_comparison`, this module's --out)."""
    return {"ms": ms, "layers": layers, "results": [r.to_dict() for r in results],
            "per_layer_delta_us_vs_marlin": per_layer_delta_us(results, layers)}


# --- the worker: one engine, in its own process ---------------------------------------------------------------

def measure(model: str, backend: str, ms: list[int], decode: int = 8, prompt_len: int = 8,
            util: float = 0.3) -> dict[str, Any]:
    """GPU µs per decode step at each M for one backend: the kernels' own time (torch profiler, as
    `ling_bench.fullsize --kernels`), so host overhead, which dominates a short model's step, drops out and
    eager mode (no compile, no graph capture: a quick start) times the same MoE kernels graphs would replay."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ling_tuning.step_kernels import kernels_per_step
    from vllm import LLM

    top = max(ms)
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, moe_backend=backend, seed=0,
              max_model_len=prompt_len + decode + 8, max_num_seqs=top, enforce_eager=True,
              max_num_batched_tokens=max(8192, prompt_len * top), gpu_memory_utilization=util,
              enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    steps, kernels = {}, {}
    for m in ms:  # distinct prompts: identical ones would route every sequence to the same experts
        prompts = [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(m)]
        got = kernels_per_step(llm, prompts, decode)
        steps[m], kernels[m] = got["gpu_us_per_step"], got["kernels_per_step"]
        print(f"[engine_compare] {backend} M={m}: {steps[m]:.1f} GPU us/step, {kernels[m]:.0f} kernels",
              file=sys.stderr, flush=True)
    return {"backend": backend, "step_us": steps, "kernels_per_step": kernels, "vllm": __import__("vllm").__version__}


def main(argv: list[str] | None = None, spawn: Spawn = _subprocess) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling_tuning.engine_compare", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ling-3.0-flash", help="preset, checkpoint folder or config.json")
    ap.add_argument("--backends", default="marlin,humming", help=f"comma-separated, of {list(BACKENDS)}")
    ap.add_argument("--ms", type=positive_ints, default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024])
    ap.add_argument("--layers", type=int, default=8, help="MLA + MoE layers of the short model")
    ap.add_argument("--tuned-folder", type=Path, help="ling-tune's --out, for --backends triton")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per engine (start-up included)")
    ap.add_argument("--workdir", type=Path, help="keep the short model and each engine's log here (default: temp)")
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    ap.add_argument("--worker", metavar="MODEL_DIR", help=argparse.SUPPRESS)  # one engine (internal)
    a = ap.parse_args(argv)
    backends = [b for b in a.backends.split(",") if b]
    if a.worker:  # write, then leave at once: an in-process engine's teardown was seen to hang past the timeout
        doc = measure(a.worker, backends[0], a.ms)
        if a.out:
            a.out.write_text(json.dumps(doc, indent=2) + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    _, source = resolve_model(a.model)
    if not Path(source).is_file():
        ap.error(f"--model {a.model}: the engine comparison needs a config.json, got {source}")

    def written(results: list[EngineResult]) -> dict[str, Any]:
        doc = report(results, a.ms, a.layers)
        if a.out:  # after every engine: a run cut short keeps what it finished
            a.out.write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    with tempfile.TemporaryDirectory(prefix="ling-engine-") as tmp:
        try:
            results = compare_engines(Path(source), backends, a.ms, a.workdir or Path(tmp), a.tuned_folder,
                                      a.layers, a.timeout, spawn, done=written)
        except ValueError as e:
            ap.error(str(e))
    print(json.dumps(written(results), indent=2))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
