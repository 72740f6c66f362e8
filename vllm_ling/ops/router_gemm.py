"""The MoE router's logits at decode sizes, logits = x · Wᵀ in fp32, in one Triton kernel of ours.

The router stays fp32 (docs/architecture.md §MoE): W is [E, K] fp32 (512 x 2,560 for Ling-3.0-flash, 5.2 MB a
layer), x the layer's bf16 input, the logits fp32. vLLM's `GateLinear` has fast small-M kernels only for five other
models' shapes on sm_90/sm_100 and for cute-DSL kernels that need an extra package; for ours it falls back to
cuBLAS, always so on a GB10 (sm_121). On the H200 cuBLAS took 4.3 µs a layer for one row (`gemvx`) and 11.9 µs for
two (`gemmSN_TN`), the MTP verify step's shape: +315 µs per verify step over 40 layers, on the routed experts'
critical path (a profile of 2026-12-02, docs/speed.md §Kernels).

Here each program owns a few experts (`block_experts`) and every row (M <= MAX_TOKENS), and reads its slice of W once
whatever M is: M = 2 costs about what M = 1 does. Products and sums are fp32 FMAs (no tf32 dot), over K in
fixed chunks: a row's logits depend on its own input only, never on the batch's other rows. Larger batches go to torch's fp32
GEMM. The default since 2026-12-02: inside the engine on the H200, two rows took 5.6 µs a layer against cuBLAS's
12.0 (-0.26 ms of GPU time per MTP verify step), one row 4.8 against 4.3, both at 4 experts a program, before
`block_experts` chose fewer (docs/speed.md §Kernels). `VLLM_LING_ROUTER_GEMM=vllm` goes back to GateLinear.
The same kernel, with a per-row scale, gives the MTP draft's logits over a draft vocabulary (vllm_ling/draft/vocab.py).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm.triton_utils import tl, triton
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_ling import envs

logger = logging.getLogger("vllm_ling")

GEMM_ENV = "VLLM_LING_ROUTER_GEMM"
GEMMS = envs.VARIABLES[GEMM_ENV].choices  # this kernel up to MAX_TOKENS rows (the default), or vLLM's GateLinear
DEFAULT_GEMM = envs.VARIABLES[GEMM_ENV].default
MAX_TOKENS = 16  # rows one program holds: decode batches and MTP verify steps of a few sequences
PRODUCT = 8192  # BLOCK_M x BLOCK_E x BLOCK_K products per step: 64 fp32 registers a thread at 4 warps


@triton.jit
def _router_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, K, E, stride_xm, stride_we, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr):
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * stride_we + k[None, :], mask=(e < E)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    if HAS_SCALE:  # a per-row weight scale (an FP8 weight's), applied to the fp32 sums
        acc *= tl.load(s_ptr + e, mask=e < E, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + e[None, :], acc, mask=(m < M)[:, None] & (e < E)[None, :])


def block_experts(m: int) -> int:
    """Experts per program for M rows: 2 for one row, 1 for more. Timed on the H200 (2026-12-02, µs a call, W from
    HBM, 512 x 2,560): one row 4.7 / 4.0 / 5.0 / 6.6 at 1 / 2 / 4 / 8 experts a program; two rows 4.3 / 5.0 / 5.8 /
    8.8; sixteen rows 15.2 / 24.8 / 49.8 / 79.1. More programs (512 at one expert) keep more loads in flight, and
    fewer experts a program leave room for the rows' products in registers."""
    return 2 if m == 1 else 1


def router_gemm_small(x: torch.Tensor, weight: torch.Tensor, block_e: int | None = None,
                      scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits [M, E] = x [M, K] · weight [E, K]ᵀ (· scale [E], per weight row) for 1 <= M <= MAX_TOKENS, on
    the kernel above (`block_e` weight rows a program; `block_experts(M)` unless given). Any weight dtype Triton
    loads (fp32 for the router, FP8 e4m3 rows with their scales for the draft vocabulary's head) is read as is
    and widened to fp32 in registers."""
    m, k = x.shape
    e = weight.shape[0]
    if not 0 < m <= MAX_TOKENS or weight.shape[1] != k:
        raise ValueError(f"router_gemm_small: x {tuple(x.shape)}, weight {tuple(weight.shape)}: needs 1 <= M <= "
                         f"{MAX_TOKENS} rows of the weight's width; use torch's GEMM for these")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty(m, e, dtype=torch.float32, device=x.device)
    block_m = triton.next_power_of_2(m)
    block_e = block_e or block_experts(m)
    _router_gemm_kernel[(triton.cdiv(e, block_e),)](
        x, weight, out if scale is None else scale, out, m, k, e, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_K=max(16, PRODUCT // (block_m * block_e)),
        HAS_SCALE=scale is not None, num_warps=4,
    )
    return out


def _router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Opaque to torch.compile, so the row count picks the kernel when the step runs, not when it is traced."""
    if x.is_cuda and 0 < x.shape[0] <= MAX_TOKENS:
        return router_gemm_small(x, weight)
    return torch.nn.functional.linear(x.to(torch.float32), weight)


def _router_logits_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


direct_register_custom_op(op_name="vllm_ling_router_logits", op_func=_router_logits, mutates_args=[],
                          fake_impl=_router_logits_fake)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits through the custom op (any M; the kernel above up to MAX_TOKENS rows on CUDA)."""
    return torch.ops.vllm.vllm_ling_router_logits(x, weight)


def gemm_choice() -> str:
    """VLLM_LING_ROUTER_GEMM: `ours` (default) or `vllm`; anything else is refused with the choices."""
    asked = envs.read(GEMM_ENV)
    _log_choice(asked)
    return asked


@functools.cache
def _log_choice(choice: str) -> None:
    if choice == "ours":
        logger.info("vllm-ling: MoE router logits at <= %d rows on our fp32 kernel (%s=vllm for vLLM's "
                    "GateLinear)", MAX_TOKENS, GEMM_ENV)
    else:
        logger.info("vllm-ling: MoE router logits on vLLM's GateLinear (%s=vllm; unset for our fp32 kernel)",
                    GEMM_ENV)
