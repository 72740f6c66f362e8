"""FP8-weight GEMV for decode sizes: y = (x · W8ᵀ) ⊙ s, activations in BF16, one fp32 scale per output channel.

Why: at batch 1 every linear is a matrix-vector product bound by the bytes of its weight. vLLM's W8A8 path first
quantizes x (one more kernel per linear) and its CUTLASS GEMM read the step's 3.1 GB of FP8 weights at ~1.95 TB/s
on the H200 (1.61 ms for 239 calls, session 8: 47% of the copy bandwidth; docs/speed.md §FP8). This kernel
reads each weight row once, in tiles of BLOCK_N output channels x BLOCK_K inputs, converts e4m3 to BF16 in
registers and multiplies on the tensor cores (M padded to 16), accumulating in fp32; the scale is applied once
per output. It keeps the activations in BF16 (weight-only FP8, as FP8-Marlin), which also rounds less.

The weight is vLLM's FP8 layout after loading: `layer.weight` [K, N] column-major (a transposed view of an
[N, K] row-major e4m3 tensor, possibly zero-padded to multiples of 16), `layer.weight_scale` [N, 1] fp32.
Triton's CPU interpreter (TRITON_INTERPRET=1, the tests' way to run this on a CPU) cannot multiply BF16: its
numpy emulation returns garbage. So on a CPU tensor the kernel multiplies in exact fp32; the indexing, masking
and scaling are the same code.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm.triton_utils import tl, triton

GEMV_MAX_M = 16  # tokens; above this a GEMM kernel is the right tool


class Tile(NamedTuple):
    """One launch configuration: BLOCK_N output channels x BLOCK_K inputs per step of a program, warps,
    pipeline stages, and whether the product runs on the tensor cores (`dot`: M padded to 16, BLOCK_N >= 16)
    or as fp32 multiply-adds (`fma`: M padded to a power of two only, any BLOCK_N; cheaper for one token)."""

    n: int
    k: int
    warps: int = 4
    stages: int = 3
    dot: bool = True


def tiles(n: int, k: int) -> Tile:
    """Wide rows of K in flight per program (bandwidth wants ~36 KB in flight per H200 SM), enough programs to
    fill the GPU (N / BLOCK_N; 16 rows give 160 programs for N = 2560), and a shared-memory footprint that fits a
    GB10 block (101,376 B): stages x (x tile 16 x BLOCK_K BF16 + w tile BLOCK_N x BLOCK_K e4m3) = 72 KB at
    (16, 512), 48 KB at (32, 256). A heuristic, not yet timed against the alternatives (the GPU benchmark
    tests/gpu/fp8_gemm_bench.py sweeps them)."""
    if n >= 8192:
        return Tile(32, 256)
    return Tile(16, 512 if k >= 2048 else 256)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_BF16: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                    mask=(n[:, None] < N) & (k[None, :] < K), other=0)
        w = w.to(tl.float8e4nv, bitcast=True)
        if DOT_BF16:
            acc += tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    y = acc * tl.load(s_ptr + n, mask=n < N, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def fp8_gemv(x: torch.Tensor, weight_kn: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
             out_features: int | None = None, tile: Tile | None = None) -> torch.Tensor:
    """x [..., K] (M = tokens <= GEMV_MAX_M) · FP8 weight -> [..., out_features] in x's dtype.

    weight_kn: vLLM's [K(+pad), N(+pad)] column-major e4m3 view; scale: [N(+pad)] or [N(+pad), 1] fp32;
    tile: a launch configuration other than `tiles(N, K)` (the benchmark's sweep).
    """
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > GEMV_MAX_M:
        raise ValueError(f"fp8_gemv: {m} tokens > GEMV_MAX_M={GEMV_MAX_M}; use a GEMM for these")
    w = weight_kn.t()  # [N(+pad), K(+pad)], row-major: each output channel's weights are contiguous
    if w.stride(-1) != 1 or w.shape[1] < k:
        raise ValueError(f"fp8_gemv: weight must be a column-major [K, N] FP8 view with K >= {k}, got "
                         f"shape {list(weight_kn.shape)} strides {list(weight_kn.stride())}")
    n = out_features or w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        t = tile or tiles(n, k)
        dot = t.dot and x.is_cuda
        _fp8_gemv_kernel[(triton.cdiv(n, t.n),)](
            x2, w.view(torch.uint8), scale.reshape(-1), bias if bias is not None else scale, y,
            m, n, k, x2.stride(0), w.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16 if dot else triton.next_power_of_2(m), BLOCK_N=t.n,
            BLOCK_K=t.k, DOT_BF16=dot, num_warps=t.warps, num_stages=t.stages,
        )
    return y.view(*x.shape[:-1], n)
