"""Shared by the GPU engine tests: skip without CUDA/vLLM, run engine and oracle scripts, record results."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import run_script, run_scripts  # noqa: E402,F401

# In-process engine core (tests hook modules and read metrics); our plugin even where vLLM has Ling V3.
GPU_ENV = {"VLLM_LING_MODEL": "vllm-ling", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def record(name: str, data: dict) -> None:
    """Write a result as $LING_GPU_RESULTS/<name>.json (the device run brings that folder back)."""
    out = os.environ.get("LING_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2))


def graph_us(calls, n_calls: int, replays: int = 10, repeats: int = 5) -> float:
    """Microseconds per call of `calls()` (which makes `n_calls` calls), as the engine launches kernels: captured
    once in a CUDA graph on a side stream after a warm-up, replayed `replays` times per timing, median of `repeats`."""
    import statistics

    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        calls()  # warm-up: JIT, workspaces
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            calls()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (replays * n_calls))
    return statistics.median(times)
