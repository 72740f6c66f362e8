"""Peak GPU memory from a fake nvidia-smi."""

from __future__ import annotations

import time
from pathlib import Path

from bench_fake_server import write_fake_nvidia_smi

from ling_bench.gpu_memory import GpuMemSampler



def test_gpu_sampler_is_silent_without_nvidia_smi():
    with GpuMemSampler(command="ling-bench-no-such-nvidia-smi") as gpu:
        pass
    assert gpu.peak_mib is None


def _run_until_called(tmp_path: Path, state: Path, calls: int) -> GpuMemSampler:
    with GpuMemSampler(interval_s=0.01, command=str(tmp_path / "nvidia-smi")) as gpu:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not state.exists() or int(state.read_text() or 0) < calls):
            time.sleep(0.01)
    return gpu


def test_gpu_sampler_keeps_the_peak_of_each_gpu(tmp_path):
    state = write_fake_nvidia_smi(tmp_path, ["100\n5\n", "300\n2\n", "200\n9\n"])
    assert _run_until_called(tmp_path, state, 3).peak_mib == [300, 9]


def test_gpu_sampler_ignores_not_supported_readings(tmp_path):
    state = write_fake_nvidia_smi(tmp_path, ["[N/A]\n"])
    assert _run_until_called(tmp_path, state, 2).peak_mib is None
