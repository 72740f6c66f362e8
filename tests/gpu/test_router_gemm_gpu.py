"""Our fp32 router GEMM on the GPU: the logits of an fp64 product, and its time per call beside the cuBLAS GEMM that
vLLM's GateLinear falls back to for Ling-3.0-flash's shape (recorded, not asserted; docs/speed.md §Kernels).

Ling-3.0-flash's router: 512 experts x 2,560 wide, fp32 weights (5.2 MB a layer), bf16 input, fp32 logits. The
timing rotates over COPIES weights (> 4x the H200's 60 MB L2) inside one CUDA graph, so each call reads its weight
from HBM as each of the step's 40 router GEMMs does.
Run: pytest tests/gpu/test_router_gemm_gpu.py -q -s
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import graph_us, record  # importing gpu_helpers skips the module without CUDA

from vllm_ling.ops.router_gemm import MAX_TOKENS, block_experts, router_gemm_small, router_logits

E, K = 512, 2560
COPIES = 48  # 48 x 5.2 MB = 252 MB of weights per pass
MS = (1, 2, 3, 4, 8, 16)
BLOCK_ES = (1, 2, 4, 8)  # experts per program, timed side by side (the kernel picks `block_experts(M)`)
TOLERANCE = 1e-5  # relative to the largest logit (fp32 accumulation)


def _inputs(m: int, copies: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16).cuda()
    return x, [(torch.randn(E, K, generator=gen) / K ** 0.5).cuda() for _ in range(copies)]


@pytest.mark.parametrize("m", [*MS, MAX_TOKENS + 1, 64])
def test_logits_match_an_fp64_product(m):
    """Up to MAX_TOKENS rows on our kernel, past it on torch's fp32 GEMM: the same logits either way."""
    x, (w,) = _inputs(m)
    ref = x.double() @ w.double().t()
    got = router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, E)
    assert (got.double() - ref).abs().max().item() <= TOLERANCE * ref.abs().max().item()


def _us_per_call(fn, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    def calls():
        for w in weights:
            fn(x, w)
    return graph_us(calls, len(weights))


def _cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(torch.float32), w)  # GateLinear's last tier, as it runs for our shape


def test_router_gemm_time_per_call_beside_cublas():
    rows = {}
    for m in MS:
        x, weights = _inputs(m, COPIES)
        rows[m] = {f"ours_block_e{be}_us": round(_us_per_call(lambda a, b, be=be: router_gemm_small(a, b, block_e=be),
                                                             x, weights), 3) for be in BLOCK_ES}
        rows[m]["cublas_fp32_us"] = round(_us_per_call(_cublas, x, weights), 3)
    record("router_gemm_kernel", {"experts": E, "width": K, "block_experts": {m: block_experts(m) for m in MS}, "weights_per_pass": COPIES,
                                  "per_m": rows, "device": torch.cuda.get_device_name()})
    print(rows)
    assert all(v > 0 for r in rows.values() for v in r.values())
