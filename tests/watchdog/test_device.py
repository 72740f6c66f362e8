"""nvidia-smi answers to a device: memory model, shared memory per block and how many GPUs."""
import subprocess

from ling_common.device import detect, parse_query


def test_gb10_is_unified_with_101376_bytes_of_shared_memory():
    d = parse_query("NVIDIA GB10, [N/A], 12.1")
    assert (d.kind, d.total_bytes, d.smem_bytes, d.capability) == ("unified", None, 101_376, (12, 1))


def test_h200_is_discrete_with_its_own_memory():
    d = parse_query("NVIDIA H200, 143771, 9.0")
    assert (d.kind, d.total_bytes, d.smem_bytes, d.capability) == ("discrete", 143771 << 20, 232_448, (9, 0))


def test_no_nvidia_smi_means_cpu():
    def missing(*a, **k):
        raise FileNotFoundError("nvidia-smi")
    assert detect(run=missing).kind == "cpu"


def test_a_failing_nvidia_smi_means_cpu():
    def failing(*a, **k):
        return subprocess.CompletedProcess(a, 9, "", "NVIDIA-SMI has failed")
    assert detect(run=failing).kind == "cpu"


def test_every_gpu_nvidia_smi_lists_is_counted():
    def two(*a, **k):
        return subprocess.CompletedProcess(a, 0, "NVIDIA H200, 143771, 9.0\nNVIDIA H200, 143771, 9.0\n", "")

    def spark(*a, **k):
        return subprocess.CompletedProcess(a, 0, "NVIDIA GB10, [N/A], 12.1\n", "")
    assert (detect(run=two).count, detect(run=two).kind) == (2, "discrete")
    assert (detect(run=spark).count, detect(run=spark).kind) == (1, "unified")


def test_a_gb10_is_unified_whatever_memory_total_its_driver_reports():
    """DGX Spark drivers report '[N/A]' for memory.total; a GB10 that reports a number is still unified."""
    assert parse_query("NVIDIA GB10, 122502, 12.1").kind == "unified"
    assert parse_query("NVIDIA GB10, [N/A], 12.1").total_bytes is None
    assert parse_query("NVIDIA GeForce RTX 5090, 32607, 12.0").kind == "discrete"
