"""Shared memory per block: the one home of the GB10 limit and of the per-GPU table (docs/ops-walls.md W6).

A GB10 (sm_121) allows 101,376 B per block; a Triton launch that needs more fails with `OutOfResources: shared
memory ... Hardware limit: 101376`, and an autotuner that fails mid-serve wedged a Spark (W6). The opt-in limit
per compute capability is the CUDA programming guide's table; GB10's was measured by Spark owners.

Standard library only at import: `ling_common.smem` loads this file alone for the tools that may not import the
plugin (the watchdog), so the table has this one home.
"""

from __future__ import annotations


GB10_SMEM_PER_BLOCK = 101_376
SMEM_LIMIT_ENV = "LING_SMEM_LIMIT"  # emulate a smaller GPU (101376 = GB10) on a bigger one
SMEM_PER_BLOCK = {
    (7, 0): 98_304, (7, 5): 65_536, (8, 0): 166_912, (8, 6): 101_376, (8, 7): 166_912,
    (8, 9): 101_376, (9, 0): 232_448, (10, 0): 232_448, (10, 3): 232_448, (12, 0): 101_376,
    (12, 1): 101_376,
}


def env_limit() -> int | None:
    from vllm_ling import envs  # here, not at the top: ling_common.smem loads this file alone

    return envs.read(SMEM_LIMIT_ENV)


def device_smem_limit(device: int | None = None, honour_env: bool = True) -> int:
    """Opt-in shared memory per block of a CUDA device (what Triton checks a launch against); initializes CUDA.

    `LING_SMEM_LIMIT` overrides it, to emulate a smaller GPU on a bigger one."""
    if honour_env and (limit := env_limit()) is not None:
        return limit
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"no CUDA device to read the shared-memory limit from; set {SMEM_LIMIT_ENV}")
    idx = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(idx)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if not limit:
        from triton.runtime import driver

        limit = driver.active.utils.get_device_properties(idx)["max_shared_mem"]
    return int(limit)


def platform_smem_limit() -> int | None:
    """The limit of vLLM's current CUDA device without creating a CUDA context (vLLM reads the capability
    through NVML): safe in `register()`, which runs in the API server too. None off CUDA or when unknown."""
    if (limit := env_limit()) is not None:
        return limit
    from vllm_ling.compat import cuda_capability  # imports vLLM: never on the watchdog's by-path load of this file

    capability = cuda_capability()
    return SMEM_PER_BLOCK.get(capability) if capability is not None else None
