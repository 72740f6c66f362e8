"""Our one-kernel router on the GPU: the same experts as the torch reference and as vLLM's fused grouped_topk,
and its time per call beside vLLM's kernel, inside a CUDA graph as the engine runs it (recorded, not asserted).

Ling-3.0-flash's shape: 512 experts in 8 groups, top-4 groups, top-8 experts, renormalised, × 2.5.
Run: pytest tests/gpu/test_routing_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import graph_us, record  # importing gpu_helpers skips the module without CUDA
from vllm import _custom_ops as ops

from vllm_ling.ops.moe import grouped_topk
from vllm_ling.ops.routing import ling_grouped_topk

E, G, TG, K, SCALE = 512, 8, 4, 8, 2.5
MS = (1, 2, 8, 64, 512, 8192)
REPLAYS = 200


def _inputs(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m)
    return (torch.randn(m, E, generator=gen) * 3).cuda(), (torch.randn(E, generator=gen) * 0.2).cuda()


def _vllm(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.grouped_topk(logits, G, TG, K, True, SCALE, bias, 1)  # scoring_func 1 = sigmoid


def _ours(logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return ling_grouped_topk(logits, bias, G, TG, K, True, SCALE)


def _same_choice(a: tuple, b: tuple) -> tuple[bool, float]:
    """Same expert sets per token (orders may differ between kernels), and the largest weight difference."""
    ia, oa = a[1].long().sort(-1)
    ib, ob = b[1].long().sort(-1)
    return torch.equal(ia, ib), (a[0].gather(1, oa) - b[0].gather(1, ob)).abs().max().item()


def _us_per_call(fn, logits, bias) -> float:
    """Mean time per call: REPLAYS calls captured in one CUDA graph (as the engine launches them)."""
    def calls():
        for _ in range(REPLAYS):
            fn(logits, bias)
    return graph_us(calls, REPLAYS)


@pytest.mark.parametrize("m", MS)
def test_router_kernel_picks_the_reference_experts(m):
    logits, bias = _inputs(m)
    ours = _ours(logits, bias)
    ref = grouped_topk(logits, bias, G, TG, K, True, SCALE)
    same, err = _same_choice(ours, ref)
    assert same and err <= 1e-5
    same_vllm, err_vllm = _same_choice(ours, _vllm(logits, bias))
    assert same_vllm and err_vllm <= 1e-5


def test_router_time_per_call_beside_vllms_kernel():
    rows = {}
    for m in MS:
        logits, bias = _inputs(m)
        rows[m] = {"ours_us": round(_us_per_call(_ours, logits, bias), 3),
                   "vllm_grouped_topk_us": round(_us_per_call(_vllm, logits, bias), 3)}
    record("routing_kernel", {"experts": E, "groups": G, "topk_group": TG, "top_k": K, "calls_per_graph": REPLAYS,
                              "per_m": rows, "device": torch.cuda.get_device_name()})
    print(rows)
    assert all(r["ours_us"] > 0 and r["vllm_grouped_topk_us"] > 0 for r in rows.values())
