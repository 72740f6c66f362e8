"""What the tuner needs from a device: measure one MoE layer call. The CUDA implementation lives in
`ling_tuning.gpu_bench`; tests inject a fake, so the whole CLI runs on a CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

from ling_tuning.space import Config

# ‖out − ref‖ / ‖ref‖ above which a config computes something else. bf16 intermediates and the CUDA
# kernel's bf16 atomicAdd over K tiles cost ~1e-2 at worst; a dropped K tile of 80 costs ~1e-1.
REL_TOL = 5e-2


class NoDevice(RuntimeError):
    """No CUDA device to measure on."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # raw CUDA name, e.g. "NVIDIA GB10"
    smem_limit: int  # real opt-in shared memory per block, bytes
    copy_gbs: float  # device-to-device copy, bytes read + written per second / 1e9
    triton_version: str | None = None
    vllm_version: str | None = None
    vllm_file_name: str | None = None  # vLLM's own get_config_file_name, when vLLM is importable


class Measured(NamedTuple):
    """One config at one M: median µs per layer call (None when rejected before timing)."""

    us: float | None
    rel_err: float
    smem: int | None = None


class Runner(Protocol):
    device: DeviceInfo

    def triton(self, m: int, config: Config | None, folder: Path | None = None) -> Measured:
        """vLLM's fused_experts (wna16 CUDA/Triton kernels). `config` overrides the tiles; with
        None, vLLM looks them up itself (`folder` as VLLM_TUNED_CONFIG_FOLDER, else its default).
        Checks against the dequantized reference first; times only if rel_err <= REL_TOL."""

    def marlin(self, m: int) -> Measured:
        """vLLM's fused_marlin_moe on the same weights, checked and timed the same way."""

    def experts_touched(self, m: int) -> float:
        """Mean distinct experts per timed call at batch size m (the bytes actually streamed)."""
