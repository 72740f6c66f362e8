"""Candidate tiles for one batch size M, cut to what the kernel vLLM will run can accept.

Two kernels share one tuned entry per M (vLLM `dispatch_fused_moe_kernel`):

* M·top_k <= 6·E: the CUDA `moe_wna16_gemm`. It reads only BLOCK_SIZE_M/N/K and TORCH_CHECKs
  BLOCK_SIZE_M <= 64, K % BLOCK_SIZE_K == 0, BLOCK_SIZE_K % group == 0 and
  BLOCK_SIZE_K / group in {1, 2, 4, 8} (csrc/moe/moe_wna16.cu; its error text is the H200 baseline's
  failure at M <= 2). One thread per output column, so BLOCK_SIZE_N <= 1024; both GEMMs (K = hidden and
  K = N) use the same entry, so the K tile must divide both.
* otherwise the Triton `fused_moe_kernel_gptq_awq`, tuned over vLLM's benchmark_moe.py space and
  pruned by the shared-memory estimate in `ling_tuning.smem` before anything is compiled.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field

from ling_tuning.shapes import MoEShape
from ling_tuning.smem import CUDA_DYNAMIC_SMEM_DEFAULT, cuda_wna16_smem, triton_wna16_smem

Config = dict[str, int]

# vLLM benchmark_moe.py get_configs_compute_bound (CUDA): 1,920 configs.
TRITON_FULL: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16, 32, 64),
    "num_warps": (4, 8),
    "num_stages": (2, 3, 4, 5),
}
# vLLM's tiles with num_stages 2/3 only and GROUP_SIZE_M 1/16 (it reorders M blocks for L2 reuse,
# and an expert rarely has more than a few): 480 configs instead of 1,920, every tile shape
# included. Stages matter on hardware: the H200 compiled A multi-buffered (see ling_tuning.smem),
# so they change shared memory and may change speed; 4/5 only add smem on top of 3.
TRITON_QUICK: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (16, 32, 64, 128, 256),
    "BLOCK_SIZE_N": (32, 64, 128, 256),
    "BLOCK_SIZE_K": (64, 128, 256),
    "GROUP_SIZE_M": (1, 16),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}
CUDA_AXES: dict[str, tuple[int, ...]] = {
    "BLOCK_SIZE_M": (1, 2, 4, 8, 16, 32, 64),
    "BLOCK_SIZE_N": (32, 64, 128, 256, 512, 1024),
    "BLOCK_SIZE_K": (32, 64, 128, 256),
}
CUDA_GROUPS_PER_K_TILE = (1, 2, 4, 8)
SPACES = {"quick": TRITON_QUICK, "full": TRITON_FULL}
SHUFFLE_SEED = 0


def config_key(cfg: Config) -> str:
    """Canonical text of a config: the resume store's key and a stable sort order."""
    return json.dumps(cfg, sort_keys=True, separators=(",", ":"))


def uses_cuda_kernel(m: int, shape: MoEShape) -> bool:
    """vLLM `should_moe_wna16_use_cuda` on a CUDA device: 4-bit, group 32/64/128, M·top_k/E <= 6."""
    return shape.group_size in (32, 64, 128) and m * shape.top_k / shape.num_experts <= 6


def _ensure_k_divisible(size_k: int, bk: int, group: int) -> int:
    """vLLM `_ensure_block_size_k_divisible`: largest multiple of group <= bk dividing size_k."""
    if size_k % bk == 0 and bk % group == 0:
        return bk
    for cand in range(min(bk, size_k) // group * group, group - 1, -group):
        if size_k % cand == 0:
            return cand
    return group if size_k % group == 0 else size_k


def cuda_heuristic_tiles(m: int, shape: MoEShape, bm: int) -> list[tuple[int, int]]:
    """(BLOCK_SIZE_N, BLOCK_SIZE_K) that vLLM's `get_moe_wna16_block_config` picks for each GEMM
    when an entry leaves them out (line for line, including passing size_n as num_experts)."""
    tokens = m * shape.top_k
    tiles = []
    for size_k, size_n, top_k in ((shape.hidden, 2 * shape.intermediate, shape.top_k),
                                  (shape.intermediate, shape.hidden, 1)):
        bn, bk = 128, max(128, shape.group_size)
        n_blocks, k_blocks = size_k // bk, size_n // bk
        m_blocks = (tokens + bm - 1) / bm + size_n
        if tokens // top_k <= bm:
            m_blocks = min(m_blocks, tokens)
        blocks = m_blocks * n_blocks * k_blocks
        if size_k % 256 == 0 and blocks >= 256 and bk < 256:
            bk = 256
        if m_blocks <= 16 and size_k % (bk * 2) == 0 and bk <= 512 and blocks >= 512:
            bk, blocks = bk * 2, blocks // 2
        if blocks > 1024:
            bn, blocks = 256, blocks // 2
        if size_n <= 1024 and blocks >= 1024:
            bn = 1024
        tiles.append((bn, _ensure_k_divisible(size_k, bk, shape.group_size)))
    return tiles


def cuda_violations(cfg: Config, shape: MoEShape, smem_limit: int, m: int = 1) -> list[str]:
    """Why the CUDA moe_wna16_gemm would reject (TORCH_CHECK) or fail to launch `cfg` at batch
    size m, as 'rule: detail'. Entries without N/K are checked with vLLM's heuristic tiles."""
    bm = cfg["BLOCK_SIZE_M"]
    out = [f"cuda_block_m: BLOCK_SIZE_M={bm} > 64"] if bm > 64 else []
    if "BLOCK_SIZE_N" in cfg and "BLOCK_SIZE_K" in cfg:
        tiles = [(cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"])] * 2
    else:
        tiles = cuda_heuristic_tiles(m, shape, bm)
    for (bn, bk), size_k in zip(tiles, shape.gemm_ks, strict=True):
        if bk % shape.group_size or bk // shape.group_size not in CUDA_GROUPS_PER_K_TILE:
            out.append(f"cuda_k_groups: BLOCK_SIZE_K/group={bk}/{shape.group_size} not in {CUDA_GROUPS_PER_K_TILE}")
        if size_k % bk:
            out.append(f"cuda_k_divides: K={size_k} % BLOCK_SIZE_K={bk} != 0")
        if not 1 <= bn <= 1024:
            out.append(f"cuda_threads: BLOCK_SIZE_N={bn} threads per block not in [1, 1024]")
        limit = min(smem_limit, CUDA_DYNAMIC_SMEM_DEFAULT)
        if cuda_wna16_smem(bm, bk) > limit:
            out.append(f"smem: {cuda_wna16_smem(bm, bk)} B > {limit} B")
    return list(dict.fromkeys(out))


def triton_violations(cfg: Config, shape: MoEShape, smem_limit: int) -> list[str]:
    """Why the Triton wna16 kernel cannot run `cfg` with `smem_limit` B per block: 'rule: detail'."""
    out = [f"dot_min16: {k}={cfg[k]} < 16" for k in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K")
           if k in cfg and cfg[k] < 16]
    if "BLOCK_SIZE_N" in cfg and "BLOCK_SIZE_K" in cfg and triton_wna16_smem(cfg) > smem_limit:
        out.append(f"smem: estimated {triton_wna16_smem(cfg)} B > limit {smem_limit} B")
    return out


def violations(m: int, cfg: Config, shape: MoEShape, smem_limit: int) -> list[str]:
    """Why `cfg` cannot serve batch size `m` (empty when it can)."""
    if uses_cuda_kernel(m, shape):
        return cuda_violations(cfg, shape, smem_limit, m)
    return triton_violations(cfg, shape, smem_limit)


def _product(axes: dict[str, tuple[int, ...]]) -> list[Config]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


def max_useful_block_m(m: int, shape: MoEShape) -> int:
    """Tallest M tile worth timing: 8x an expert's mean token count (taller tiles are mostly padding)."""
    per_expert = -(-m * shape.top_k // shape.num_experts)
    return max(16, 8 * (1 << (per_expert - 1).bit_length()))


@dataclass
class Candidates:
    """The configs to time for one M, and how many each rule removed (for the log)."""

    m: int
    kernel: str
    kept: list[Config]
    dropped: dict[str, int] = field(default_factory=dict)


def candidates(m: int, shape: MoEShape, smem_limit: int, space: str = "quick",
               max_count: int | None = None) -> Candidates:
    """The configs for batch size `m` that the kernel accepts and that fit `smem_limit`.

    Pruning happens here, before anything is compiled or launched. The pool is shuffled (seeded)
    before pruning, so the order does not depend on the limit: a run cut short by its budget or
    `max_count` has timed an unbiased sample, and a run under a smaller limit (GB10 emulation)
    times the same configs minus those that do not fit, reusing their stored results. `max_count`
    caps the Triton kernel's list only: each of its configs costs a compile; the CUDA kernel's
    (at most 168) cost milliseconds."""
    if space not in SPACES:
        raise ValueError(f"space={space!r}: choose one of {sorted(SPACES)}")
    if uses_cuda_kernel(m, shape):
        kernel, pool = "cuda_wna16", _product(CUDA_AXES)
        pool = [c | {"SPLIT_K": 1} for c in pool if c["BLOCK_SIZE_M"] <= max(16, 1 << (m - 1).bit_length())]
    else:
        kernel, pool = "triton_wna16", _product(SPACES[space])
        pool = [c | {"SPLIT_K": 1} for c in pool if c["BLOCK_SIZE_M"] <= max_useful_block_m(m, shape)]
    random.Random(SHUFFLE_SEED + m).shuffle(pool)
    kept, dropped = [], {}
    for cfg in pool:
        reasons = violations(m, cfg, shape, smem_limit)
        if reasons:
            rule = reasons[0].split(":")[0]
            dropped[rule] = dropped.get(rule, 0) + 1
        else:
            kept.append(cfg)
    if kernel == "triton_wna16" and max_count is not None and len(kept) > max_count:
        dropped["max_count"] = len(kept) - max_count
        kept = kept[:max_count]
    return Candidates(m, kernel, kept, dropped)


def vllm_default_config(m: int, shape: MoEShape) -> Config:
    """What vLLM (0.32-0.34, one rule) runs with no tuned file (get_default_config + get_moe_wna16_block_config).

    CUDA path: BLOCK_SIZE_M = min(16, M); N/K come from a heuristic evaluated per GEMM at launch
    (left out here, as vLLM leaves them out). Triton path: M tile 16/32/64 by M, N/K 32/64 at
    M == 1 else 64/32, and Triton's own defaults num_warps=4, num_stages=3."""
    if uses_cuda_kernel(m, shape):
        return {"BLOCK_SIZE_M": min(16, m), "SPLIT_K": 1}
    bm = 16 if m <= 20 else 32 if m <= 40 else 64
    bn, bk = (32, 64) if m == 1 else (64, 32)
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1,
            "num_warps": 4, "num_stages": 3, "SPLIT_K": 1}


def explicit_default_config(m: int, shape: MoEShape) -> Config:
    """`vllm_default_config` as the tuner measures and may write it: on the CUDA path with the N/K
    vLLM's heuristic picks at this M filled in when both GEMMs get the same (the same launches, and
    an entry that cannot change with the M it later serves); else unchanged (vLLM fills them in)."""
    cfg = vllm_default_config(m, shape)
    if uses_cuda_kernel(m, shape):
        tiles = set(cuda_heuristic_tiles(m, shape, cfg["BLOCK_SIZE_M"]))
        if len(tiles) == 1:
            (bn, bk), = tiles
            cfg = {"BLOCK_SIZE_M": cfg["BLOCK_SIZE_M"], "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "SPLIT_K": 1}
    return cfg
