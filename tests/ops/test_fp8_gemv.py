"""Our FP8 GEMV (vllm_ling.ops.fp8_gemv) and the `gemv` FP8 method that serves it, against torch references.

The kernel runs in Triton's interpreter in a child process (as tests/ops/test_routing.py explains), where it
multiplies in fp32: so with fp32 activations it must equal x · (s ⊙ W8)ᵀ to fp32 rounding, and with BF16 ones to
one BF16 rounding of the output. The method test builds a vLLM linear with `--quantization ling_fp8` on the
`gemv` kernel: up to 16 tokens it must give the weight-only result (BF16 x times the dequantized FP8 weight),
above that vLLM's W8A8 kernel (x quantized too), the same numbers as the `w8a8` kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHILD = r"""
import json, sys
import torch
from vllm_ling.ops.fp8_gemv import Tile, fp8_gemv

out = {"kernel": [], "method": {}}
gen = torch.Generator().manual_seed(0)
for m, n, k, pad, bias, dtype, tile in json.loads(sys.argv[1]):
    w = torch.randn(n, k, generator=gen)
    s = w.abs().amax(-1, keepdim=True) / 448
    w8 = (w / s).to(torch.float8_e4m3fn)
    padded = torch.nn.functional.pad(w8.view(torch.uint8), (0, pad, 0, pad)).view(torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
    b = torch.randn(n, generator=gen).to(x.dtype) if bias else None
    y = fp8_gemv(x, padded.t(), torch.nn.functional.pad(s, (0, 0, 0, pad), value=1.0), b, out_features=n,
                 tile=Tile(*tile) if tile else None)
    ref = x.float() @ (w8.float() * s).t() + (b.float() if bias else 0)
    out["kernel"].append({"shape": list(y.shape), "dtype": str(y.dtype),
                          "rel_err": ((y.float() - ref).abs().max() / ref.abs().max()).item()})

sys.path.insert(0, sys.argv[2])
from vllm_layers import vllm_layer_context
from vllm_ling import fp8
from vllm.model_executor.layers.linear import ReplicatedLinear
with vllm_layer_context(sys.argv[3]):
    w = torch.randn(64, 256, generator=gen).bfloat16() / 16
    layers = {}
    for kernel in ("gemv", "w8a8"):
        layers[kernel] = ReplicatedLinear(256, 64, bias=False, quant_config=fp8.LingFp8Config(kernel=kernel),
                                          prefix="model.layers.0.self_attn.o_proj")
        layers[kernel].weight.weight_loader(layers[kernel].weight, w)
    layer = layers["gemv"]
    dequant = layer.weight.t().float() * layer.weight_scale.reshape(-1, 1)
    for m in (3, 16, 20):
        x = torch.randn(m, 256, generator=gen).bfloat16()
        got = layer(x)[0].float()
        weight_only = x.float() @ dequant.t()
        out["method"][m] = {"type": type(layer.quant_method).__name__,
                            "unquantized_input": getattr(layer, "requires_unquantized_input", False),
                            "vs_weight_only": (got - weight_only).abs().max().item(),
                            "vs_w8a8": (got - layers["w8a8"](x)[0].float()).abs().max().item()}
print(json.dumps(out))
"""

# tokens, outputs, inputs, zero padding of the stored weight (as vLLM's CUTLASS layout pads to 16), bias, x dtype,
# a launch configuration other than the heuristic's (BLOCK_N, BLOCK_K, warps, stages, dot)
CASES = [
    (1, 48, 300, 0, False, "float32", None),  # K not a multiple of the tile
    (5, 40, 512, 16, True, "float32", None),  # padded weight and scale, bias
    (16, 8200, 64, 0, False, "float32", None),  # the wide tile (N >= 8192), M at the limit
    (2, 96, 256, 0, True, "bfloat16", None),  # BF16 activations and output
    (3, 42, 300, 0, True, "float32", (4, 128, 4, 3, False)),  # narrow FMA tile: N and K ragged, M padded to 4
]


@pytest.fixture(scope="module")
def results(interpret) -> dict:
    pytest.importorskip("vllm")
    from vllm_ling.tiny import ensure_tiny

    tiny_bf16 = ensure_tiny(seed=0)  # a model folder for vLLM's config; its weights are not read
    tests_model = Path(__file__).resolve().parents[1] / "model"
    return interpret(CHILD, json.dumps(CASES), str(tests_model), str(tiny_bf16), timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"M{c[0]}-N{c[1]}-K{c[2]}-{c[5]}" + ("-tile" if c[6] else "") for c in CASES])
def test_gemv_equals_the_dequantized_product(results, case):
    r, (m, n, *_, dtype, _tile) = results["kernel"][case], CASES[case]
    assert r["shape"] == [m, n] and r["dtype"] == f"torch.{dtype}"
    assert r["rel_err"] <= (1e-5 if dtype == "float32" else 2 ** -7)  # of the largest output: fp32 sums, or BF16


def test_gemv_method_is_weight_only_up_to_16_tokens_and_w8a8_above(results):
    small, edge, large = (results["method"][str(m)] for m in (3, 16, 20))
    assert small["type"] == "Fp8GemvLinearMethod" and small["unquantized_input"]
    for r in (small, edge):  # our kernel: BF16 x, so it differs from W8A8, which rounds x to e4m3 too
        assert r["vs_weight_only"] <= 2e-2 and r["vs_w8a8"] > 3 * r["vs_weight_only"], results["method"]
    assert large["vs_w8a8"] == 0.0 and large["vs_weight_only"] > 1e-3
