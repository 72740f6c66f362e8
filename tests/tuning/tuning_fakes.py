"""A fake device for the tuner: a deterministic cost model and a fake clock, so the whole ling-tune
flow (tune, write, compare, choose) runs on a CPU without CUDA."""

from __future__ import annotations

from pathlib import Path

from ling_tuning.configfile import config_file_name, lookup, read_table
from ling_tuning.runner import DeviceInfo, Measured
from ling_tuning.shapes import PRESETS, MoEShape
from ling_tuning.space import Config, cuda_heuristic_tiles, uses_cuda_kernel, violations, vllm_default_config

LING = PRESETS["ling-3.0-flash"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeRunner:
    """Times come from a formula with a unique optimum per M; some configs compute garbage
    (BLOCK_SIZE_N == 512 on the CUDA kernel) and some raise (num_warps 8 with num_stages 4)."""

    def __init__(self, shape: MoEShape = LING, clock: FakeClock | None = None, cost_s: float = 1.0,
                 name: str = "NVIDIA GB10", smem: int = 101_376, marlin_us: float = 50.0):
        self.shape, self.clock, self.cost_s, self.marlin_us = shape, clock or FakeClock(), cost_s, marlin_us
        self.device = DeviceInfo(name=name, smem_limit=smem, copy_gbs=200.0, triton_version="3.6.0",
                                 vllm_version="0.34.0", vllm_file_name=None)
        self.calls: list[tuple[int, Config | None]] = []
        self.meta = {"fake": True}

    def cost(self, m: int, cfg: Config) -> float:
        """µs: minimal at BLOCK_SIZE_M ~ tokens per expert, BLOCK_SIZE_N 128, BLOCK_SIZE_K 128."""
        per_expert = max(1, m * self.shape.top_k // self.shape.num_experts)
        us = 10.0 + 0.01 * m
        us += abs(cfg["BLOCK_SIZE_M"] - min(64, max(1, per_expert))) * 0.5
        us += abs(cfg.get("BLOCK_SIZE_N", 128) - 128) / 64 + abs(cfg.get("BLOCK_SIZE_K", 128) - 128) / 32
        us += cfg.get("num_stages", 2) * 0.1 + cfg.get("GROUP_SIZE_M", 1) * 0.01 + cfg.get("num_warps", 4) * 0.01
        return us

    def triton(self, m: int, config: Config | None, folder: Path | None = None) -> Measured:
        self.clock.t += self.cost_s
        self.calls.append((m, config))
        if config is None:
            if folder is None:  # vLLM's default: the CUDA heuristic fails at M <= 2, like the real one
                config = vllm_default_config(m, self.shape)
            else:
                table = read_table(Path(folder) / config_file_name(self.shape, self.device.name))
                config = table[lookup(table, m)]
        if violations(m, config, self.shape, self.device.smem_limit):
            raise RuntimeError(f"kernel rejected {config}")
        if config.get("num_warps") == 8 and config.get("num_stages") == 4:
            raise RuntimeError("PassManager::run failed")
        if uses_cuda_kernel(m, self.shape) and config.get("BLOCK_SIZE_N") == 512:
            return Measured(None, 0.9)
        smem = None if uses_cuda_kernel(m, self.shape) else 4096
        return Measured(self.cost(m, self.resolved(m, config)), 0.004, smem)

    def resolved(self, m: int, cfg: Config) -> Config:
        """The tiles a launch uses: an entry without N/K gets vLLM's CUDA heuristic (first GEMM's)."""
        if "BLOCK_SIZE_N" in cfg:
            return cfg
        bn, bk = cuda_heuristic_tiles(m, self.shape, cfg["BLOCK_SIZE_M"])[0]
        return cfg | {"BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk}

    def marlin(self, m: int) -> Measured:
        return Measured(self.marlin_us + 0.02 * m, 0.003)

    def experts_touched(self, m: int) -> float:
        return float(min(self.shape.num_experts, m * self.shape.top_k))
