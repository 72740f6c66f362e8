"""Ling's noaux_tc router as one Triton kernel: sigmoid, bias, group choice, top-k, renormalise, scale.

The equations are those of `vllm_ling.ops.moe.grouped_topk` (the torch reference beside it, in fp32):
s = σ(logits); the top `topk_group` of `n_group` groups by the sum of their top-2 biased scores s + b; the
top-k experts of those groups by s + b; their weights are the unbiased s, renormalised, times `scale`.

Why a kernel of our own: at decode sizes routing is a latency problem, not a bandwidth one. vLLM 0.33's
fused `grouped_topk` kernel took 9.4-11.6 µs per MoE layer for one token on the H200 (40 calls, 376-465 µs of
a 4.9-5.1 ms step; docs/speed.md), for 512 scores. Here one program routes one token with every
reduction in registers. All arithmetic is fp32; ties go to the lower expert index (`tl.argmax`).
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm.triton_utils import tl, triton

from vllm_ling import envs

logger = logging.getLogger("vllm_ling")

ROUTER_ENV = "VLLM_LING_ROUTER"
ROUTERS = envs.VARIABLES[ROUTER_ENV].choices  # our one-kernel router (vllm_ling.ops.routing), or vLLM's grouped_topk


@triton.jit
def _ling_route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scale,
                       N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                       TOP_K: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr,
                       RENORMALIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, PER_GROUP)
    expert = g[:, None] * PER_GROUP + j[None, :]  # [BLOCK_G, PER_GROUP]; expert id = flat index
    valid = (g < N_GROUP)[:, None] & (j < PER_GROUP)[None, :]
    x = tl.load(logits_ptr + t * stride_t + expert, mask=valid, other=0.0).to(tl.float32)
    s = tl.sigmoid(x)
    b = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    biased = tl.where(valid, s + b, float("-inf"))

    # group score = sum of the group's two largest biased scores
    first = tl.max(biased, axis=1)
    first_at = tl.argmax(biased, axis=1)
    second = tl.max(tl.where(j[None, :] == first_at[:, None], float("-inf"), biased), axis=1)
    group_score = tl.where(g < N_GROUP, first + second, float("-inf"))
    keep = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.argmax(group_score, axis=0)
        keep = keep | (g == best)
        group_score = tl.where(g == best, float("-inf"), group_score)

    cand = tl.reshape(tl.where(keep[:, None], biased, float("-inf")), [BLOCK_G * PER_GROUP])
    unbiased = tl.reshape(s, [BLOCK_G * PER_GROUP])
    flat = tl.arange(0, BLOCK_G * PER_GROUP)
    k = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.minimum(tl.argmax(cand, axis=0), N_GROUP * PER_GROUP - 1)  # NaN scores: still a real expert
        ids = tl.where(k == i, best.to(tl.int32), ids)
        weights = tl.where(k == i, tl.sum(tl.where(flat == best, unbiased, 0.0), axis=0), weights)
        cand = tl.where(flat == best, float("-inf"), cand)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    out = k < TOP_K
    tl.store(weights_ptr + t * TOP_K + k, weights * scale, mask=out)
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=out)


def check_routing_shape(num_experts: int, n_group: int, topk_group: int, top_k: int) -> None:
    """The kernel's rules: groups of equal power-of-two size, enough experts in the chosen groups."""
    per = num_experts // max(n_group, 1)
    if n_group < 1 or num_experts % n_group or per & (per - 1) or per < 2:
        raise ValueError(f"vllm-ling router kernel: {num_experts} experts in {n_group} groups must split into "
                         f"equal groups of a power-of-two size >= 2; use vLLM's grouped_topk "
                         f"(VLLM_LING_ROUTER=vllm)")
    if not 1 <= topk_group <= n_group or not 1 <= top_k <= topk_group * per:
        raise ValueError(f"vllm-ling router kernel: top_k {top_k} from topk_group {topk_group} of {n_group} "
                         f"groups of {per} is not a valid choice; use VLLM_LING_ROUTER=vllm")


def ling_grouped_topk(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                      renormalize: bool = True, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], expert ids int32 [T, k]) for logits [T, E]; see the module docstring."""
    t, e = logits.shape
    check_routing_shape(e, n_group, topk_group, top_k)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _ling_route_kernel[(t,)](
            logits, bias, weights, ids, logits.stride(0), float(scale),
            N_GROUP=n_group, PER_GROUP=e // n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
            BLOCK_G=triton.next_power_of_2(n_group), BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=bool(renormalize), num_warps=4,
        )
    return weights, ids


def router_choice() -> str:
    """VLLM_LING_ROUTER: `ours` (default) or `vllm`; anything else is refused with the choices."""
    asked = envs.read(ROUTER_ENV)
    _log_router(asked)
    return asked


@functools.cache
def _log_router(choice: str) -> None:
    logger.info("vllm-ling: MoE routing on %s", "our one-kernel router (VLLM_LING_ROUTER=vllm for vLLM's "
                "grouped_topk)" if choice == "ours" else "vLLM's grouped_topk (VLLM_LING_ROUTER=vllm)")
