"""Shared memory per block: the device's real limit, and what each wna16 kernel config asks for.

GB10 (sm_121) allows 101,376 B per block; a Triton launch that needs more raises
`OutOfResources: shared memory, Required: ..., Hardware limit: 101376`. The tuner prunes on these
estimates before compiling anything, and checks the compiled kernel's real figure after.

Triton `fused_moe_kernel_gptq_awq` (identical in vLLM 0.32, 0.33 and 0.34), int4, bf16 activations:

    smem = max(num_stages·BM·BK·2 + BK·BN·2,  BM·BN·2)

the bf16 A tile, multi-buffered num_stages times by Triton's pipeliner, plus the dequantized bf16
B tile that feeds tl.dot (once), or the bf16 output tile the epilogue re-lays out, whichever is
larger. Measured on the H200 (Triton 3.6, sm_90, `metadata.shared` of the kernels vLLM compiled):
exact for (64,128,128,w8,s3) 81,920, (64,128,256,w8,s3) 163,840, (64,128,64,w4,s2) 32,768,
(128,128,256,w8,s2) 196,608, (128,64,64,w4,s2) 40,960 (BM,BN,BK); an over-estimate where Triton
allocates fewer A buffers than stages ((32,256,128,w4,s4) 90,112 = 3 buffers; (16,128,64,w8,s2)
18,432 = 1 buffer), which only prunes more. The earlier offline compiles (tests/tuning/data, no GPU) were
not pipelined at all, so there it over-estimates by (num_stages-1)·BM·BK·2: never under. The CUDA
`moe_wna16_gemm` stages only the activations: BM·BK·2 bytes of dynamic shared memory, launched
without an opt-in, so <= 48 KiB.
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_ling.smem import GB10_SMEM_PER_BLOCK, SMEM_LIMIT_ENV, device_smem_limit  # noqa: F401  (one home)

CUDA_DYNAMIC_SMEM_DEFAULT = 48 * 1024
BF16 = 2
TRITON_DEFAULT_STAGES = 3  # what a launch without num_stages gets (vLLM's default config sets none)


def triton_wna16_smem(cfg: Mapping[str, int]) -> int:
    """Upper bound on the Triton wna16 kernel's shared memory for `cfg`:
    max(stages·BM·BK·2 + BK·BN·2, BM·BN·2), stages = cfg's num_stages (Triton's default 3 if absent)."""
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    stages = cfg.get("num_stages", TRITON_DEFAULT_STAGES)
    return max(stages * bm * bk * BF16 + bk * bn * BF16, bm * bn * BF16)


def cuda_wna16_smem(block_m: int, block_k: int) -> int:
    """Dynamic shared memory of csrc/moe/moe_wna16.cu: the BM x BK activation tile in bf16."""
    return block_m * block_k * BF16


def emulate_launch_limit(limit: int) -> dict[str, int]:
    """Make every Triton kernel launched from now on in this process meet `limit` bytes of shared memory, as a
    smaller GPU's driver would (GB10: 101,376): a kernel compiled over it raises Triton's own `OutOfResources` at
    its first launch, where Triton checks the device's limit (`CompiledKernel._init_handles`); a bigger GPU then
    fails what a Spark would. Autotuners skip such a config while benchmarking, as they do on the real device.
    Compiling without launching (the KDA guard's probe) is not affected. Returns the live record of launched
    kernels, name -> the most shared memory any of its compiled variants asked for. Triton kernels only: CUDA
    kernels (FlashAttention, Marlin, Humming) pick their shared memory per architecture and are not emulated."""
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.errors import OutOfResources

    launched: dict[str, int] = {}
    real = getattr(CompiledKernel._init_handles, "vllm_ling_real", CompiledKernel._init_handles)

    def init_handles(self) -> None:
        if self.module is None:  # first launch of this compiled variant
            shared = int(self.metadata.shared)
            launched[self.name] = max(shared, launched.get(self.name, 0))
            if shared > limit:
                raise OutOfResources(shared, limit, "shared memory")
        real(self)

    init_handles.vllm_ling_real = real
    CompiledKernel._init_handles = init_handles
    return launched
