"""Our FP8 GEMV on the GPU (tensor-core BF16 path) against the dequantized product, at Ling-3.0-flash's shapes.

The CPU test (tests/ops/test_fp8_gemv.py) runs the same kernel in Triton's interpreter, which multiplies in fp32;
this one checks the path a GPU takes (e4m3 -> BF16 in registers, tl.dot), with vLLM's padded weight layout.
Run: pytest tests/gpu/test_fp8_gemv_gpu.py -q
"""

from __future__ import annotations

import gpu_helpers  # noqa: F401  importing gpu_helpers skips the module without CUDA
import pytest
import torch

from vllm_ling.ops.fp8_gemv import fp8_gemv

# (N, K): KDA in_proj, KDA o_proj, a shared expert's gate_up, MLA q_proj, an LM-head slice
SHAPES = [(20512, 2560), (2560, 4096), (1536, 2560), (6144, 2560), (16384, 2560)]


@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 16])
def test_gemv_matches_the_dequantized_product_on_the_gpu(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    w = torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5
    s = w.abs().amax(-1, keepdim=True) / 448
    pad = (16 - n % 16) % 16 + 16  # at least one padded row, as vLLM's CUTLASS layout may have
    w8 = torch.nn.functional.pad((w / s).to(torch.float8_e4m3fn).view(torch.uint8), (0, 0, 0, pad))
    w8 = w8.view(torch.float8_e4m3fn)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    y = fp8_gemv(x, w8.t(), torch.nn.functional.pad(s, (0, 0, 0, pad), value=1.0), bias, out_features=n)
    ref = x.float() @ (w8[:n].float() * s).t() + bias.float()
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert ((y.float() - ref).abs().max() / ref.abs().max()).item() <= 2 ** -7  # one BF16 rounding
