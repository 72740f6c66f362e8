"""The INT4 MoE kernels' token layout at decode sizes, in one Triton program instead of vLLM's two kernels.

Before its expert GEMMs, every fused-MoE path of vLLM (Marlin, Humming, Triton wna16) sorts the routed rows by
expert and pads each expert's rows to the GEMM's block size (`moe_align_block_size`): for T tokens routed to k
experts each (numel = T·k rows, row r = token r // k), with c_e rows on expert e,
  padded_e = ceil(c_e / B) · B,   start_e = Σ_{e' < e} padded_e',   total = Σ_e padded_e,
  sorted_ids[start_e + rank] = r (rank: r's place among expert e's rows), every other entry = numel (skipped),
  expert_ids[b] = the expert whose range holds row b·B (TAIL_EXPERT past the total), num_tokens_post_pad = total.
vLLM's CUDA op spends two launches on it for 512 experts (its one-kernel path stops at 64 experts): 6 µs per
MoE layer at batch 1 on the H200, 240 µs of a decode step on the routed experts' critical path (a profile of
2026-12-01, docs/speed.md §Kernels). Here one program of 4 warps holds every row (numel <= MAX_ROWS: 16 tokens at
top-8) and computes each row's place from pairwise comparisons of the expert ids, in registers.

The order of rows within one expert is free (vLLM's CUDA op orders them by atomics); ours is the row order.
Opt-in (`VLLM_LING_MOE_ALIGN=ours`) until a GPU run measures it: `install()` wraps vLLM's
`_custom_ops.moe_align_block_size`, and every other call (more rows, an expert map, a CPU tensor) goes to
vLLM's op unchanged.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm.triton_utils import tl, triton

from vllm_ling import envs

logger = logging.getLogger("vllm_ling")

ALIGN_ENV = "VLLM_LING_MOE_ALIGN"
ALIGNS = envs.VARIABLES[ALIGN_ENV].choices  # vLLM's CUDA op (default until measured), or this kernel at decode sizes
MAX_ROWS = 128  # routed rows one program holds: the pairwise [rows, rows] comparisons live in registers
# The expert id of the blocks past the total: -1, as vLLM 0.33's CUDA op writes there (seen on the H200 on
# 2026-12-02, tests/gpu/test_moe_align_gpu.py at 8 and 16 tokens, where routed ids repeat and the array has a
# tail). vLLM's expert kernels stop at the total, and its Triton MoE skips a block of expert -1, so no kernel
# reads them; the GPU test compares the whole array with the installed vLLM's op all the same.
TAIL_EXPERT = -1
_FILL = 1024  # sentinel entries written per step


@triton.jit
def _moe_align_kernel(topk_ptr, sorted_ptr, expert_ids_ptr, total_ptr, scatter_ptr, numel, num_experts,
                      block_size, sorted_len, blocks_len,
                      ROWS: tl.constexpr, FILL: tl.constexpr, TAIL: tl.constexpr, HAS_SCATTER: tl.constexpr):
    r = tl.arange(0, ROWS)
    e = tl.load(topk_ptr + r, mask=r < numel, other=-1).to(tl.int32)
    valid = (r < numel) & (e >= 0) & (e < num_experts)  # ids out of range are skipped, as vLLM's op does
    same = (e[:, None] == e[None, :]) & valid[:, None] & valid[None, :]
    rank = tl.sum((same & (r[None, :] < r[:, None])).to(tl.int32), axis=1)  # earlier rows on my expert
    count = tl.sum(same.to(tl.int32), axis=1)
    padded = (count + block_size - 1) // block_size * block_size
    first = valid & (rank == 0)  # one row speaks for each expert present
    below = first[None, :] & (e[None, :] < e[:, None])
    start = tl.sum(tl.where(below, padded[None, :], 0), axis=1)
    total = tl.sum(tl.where(first, padded, 0), axis=0)
    for p0 in range(0, sorted_len, FILL):
        p = p0 + tl.arange(0, FILL)
        tl.store(sorted_ptr + p, numel, mask=p < sorted_len)
    tl.debug_barrier()  # the sentinels land before the rows (other threads may write the same entries)
    tl.store(sorted_ptr + start + rank, r, mask=valid)
    end = start + padded
    for b0 in range(0, blocks_len, ROWS):
        b = b0 + tl.arange(0, ROWS)
        row = b * block_size
        holds = first[None, :] & (start[None, :] <= row[:, None]) & (row[:, None] < end[None, :])
        expert = tl.where(row < total, tl.sum(tl.where(holds, e[None, :], 0), axis=1), TAIL)
        tl.store(expert_ids_ptr + b, expert, mask=b < blocks_len)
    tl.store(total_ptr, total)
    if HAS_SCATTER:
        tl.store(scatter_ptr + r, tl.where(valid, r, -1), mask=r < numel)


def moe_align_small(topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_token_ids: torch.Tensor,
                    expert_ids: torch.Tensor, num_tokens_post_pad: torch.Tensor,
                    scatter_idx: torch.Tensor | None = None) -> None:
    """Fill vLLM's preallocated outputs (the `_custom_ops.moe_align_block_size` contract) for numel <= MAX_ROWS."""
    numel = topk_ids.numel()
    if numel > MAX_ROWS:
        raise ValueError(f"moe_align_small: {numel} routed rows > MAX_ROWS={MAX_ROWS}; use vLLM's op for these")
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1), sorted_token_ids, expert_ids, num_tokens_post_pad,
        scatter_idx if scatter_idx is not None else num_tokens_post_pad, numel, num_experts, block_size,
        sorted_token_ids.numel(), expert_ids.numel(),
        ROWS=max(16, triton.next_power_of_2(numel)), FILL=_FILL, TAIL=TAIL_EXPERT, HAS_SCATTER=scatter_idx is not None,
        num_warps=4,
    )


def wrap(vllm_op):
    """vLLM's op with decode sizes taken by `moe_align_small`; the same signature (0.33 adds `scatter_idx`)."""
    @functools.wraps(vllm_op)
    def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                             num_tokens_post_pad, expert_map=None, scatter_idx=None):
        if expert_map is None and topk_ids.is_cuda and 0 < topk_ids.numel() <= MAX_ROWS:
            return moe_align_small(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                                   num_tokens_post_pad, scatter_idx)
        extra = {} if scatter_idx is None else {"scatter_idx": scatter_idx}
        return vllm_op(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, num_tokens_post_pad,
                       expert_map, **extra)

    moe_align_block_size.vllm_ling_wraps = vllm_op
    return moe_align_block_size


def align_choice() -> str:
    """VLLM_LING_MOE_ALIGN: `vllm` (default) or `ours`; anything else is refused with the choices."""
    return envs.read(ALIGN_ENV)


def install() -> bool:
    """Route vLLM's MoE alignment op through `wrap` when VLLM_LING_MOE_ALIGN=ours (once per process, whichever
    model serves); True if ours is in place."""
    if align_choice() != "ours":
        return False
    from vllm import _custom_ops as ops

    if not hasattr(ops.moe_align_block_size, "vllm_ling_wraps"):
        ops.moe_align_block_size = wrap(ops.moe_align_block_size)
        logger.info("vllm-ling: MoE token alignment at <= %d routed rows on our one-program kernel "
                    "(%s=ours; unset for vLLM's op)", MAX_ROWS, ALIGN_ENV)
    return True
