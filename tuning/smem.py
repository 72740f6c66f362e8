"""Shared memory per block: the device's real limit, and what each wna16 kernel config asks for.

GB10 (sm_121) allows 101,376 B per block; a Triton launch that needs more raises
`OutOfResources: shared memory, Required: ..., Hardware limit: 101376`. The tuner prunes on these
estimates before compiling anything, and checks the compiled kernel's real figure after.

Triton `fused_moe_kernel_gptq_awq` (vLLM 0.26), int4, bf16 activations:

    smem = max(BM·BK·2 + BK·BN·2,  BM·BN·2)

the bf16 A tile plus the dequantized bf16 B tile that feeds tl.dot, or the bf16 output tile the
epilogue re-lays out, whichever is larger. num_stages does not enter: B is loaded as uint8 and
dequantized in registers, so Triton's pipeliner leaves the loop single-buffered. Fitted on the
compiled `metadata.shared` of the whole vLLM search space with Triton 3.6 and 3.9 for sm_90 and
sm_121 (exact where both compile; see tuning-report.md). The CUDA `moe_wna16_gemm` stages only the
activations: BM·BK·2 bytes of dynamic shared memory, launched without an opt-in, so <= 48 KiB.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

GB10_SMEM_PER_BLOCK = 101_376
CUDA_DYNAMIC_SMEM_DEFAULT = 48 * 1024
SMEM_LIMIT_ENV = "LING_SMEM_LIMIT"
BF16 = 2


def triton_wna16_smem(cfg: Mapping[str, int]) -> int:
    """Estimated bytes of shared memory the Triton wna16 kernel compiles to for `cfg`."""
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    return max(bm * bk * BF16 + bk * bn * BF16, bm * bn * BF16)


def cuda_wna16_smem(block_m: int, block_k: int) -> int:
    """Dynamic shared memory of csrc/moe/moe_wna16.cu: the BM x BK activation tile in bf16."""
    return block_m * block_k * BF16


def device_smem_limit(device: int | None = None, honour_env: bool = True) -> int:
    """Opt-in shared memory per block of a CUDA device (what Triton checks a launch against).

    `LING_SMEM_LIMIT` overrides it, to emulate a smaller GPU (101376 = GB10) on a bigger one."""
    if honour_env and os.environ.get(SMEM_LIMIT_ENV):
        return int(os.environ[SMEM_LIMIT_ENV])
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
