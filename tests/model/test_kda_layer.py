"""The KDA layer: its merged in_proj is padded to an aligned width (vllm_ling/kda.py says why: on the H200 the
compile padded the tiny checkpoint's 2,564-wide GEMM output to row stride 2,568 and the output gate then failed
the next graph piece's stride check; a CUTLASS FP8 kernel asserts on such a width), and what the
layer hands the KDA op under each VLLM_LING_KDA_GATE."""

from __future__ import annotations

import pytest
import torch


def _layer(vllm_config, runnable: bool = True):
    from vllm_ling.kda import BailingMoeV3KDA

    layer = BailingMoeV3KDA(vllm_config.model_config.hf_config, vllm_config, prefix="model.layers.0.self_attn")
    return _init(layer) if runnable else layer


def _init(layer):
    """Random weights (padding rows zeroed again, as a checkpoint never writes them), then what the loader does
    after the weights (vLLM's CPU linears set up their kernel there)."""
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layer._zero_in_proj_pad()
    for m in layer.modules():
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    return layer


def test_in_proj_is_padded_to_16_with_zero_rows_and_the_real_width_is_not(tmp_path):
    """Tiny checkpoint (5·512 + 4 = 2,564 outputs): 12 zero rows make 2,576, and the outputs before them are the
    checkpoint's six projections unchanged. Ling-3.0-flash (20,512, a multiple of 16): no padding."""
    pytest.importorskip("vllm")
    from vllm.forward_context import set_forward_context

    from vllm_layers import vllm_layer_context
    from ling_tools.tiny import ensure_tiny, write_full_config

    with vllm_layer_context(str(ensure_tiny(seed=0))) as vllm_config:
        layer = _layer(vllm_config, runnable=False)
        assert layer.in_proj_pad == 12 and layer.in_proj.output_size_per_partition == 2576
        assert bool((layer.in_proj.weight[-12:] == 0).all()), "padding rows must start at zero"
        _init(layer)
        x = torch.randn(3, vllm_config.model_config.hf_config.hidden_size)
        seen = {}
        norm = layer.o_norm.forward
        layer.o_norm.forward = lambda o, z: seen.setdefault("z", z) is not None and norm(o, z)
        with set_forward_context(None, vllm_config):
            layer(x)
        full = layer.in_proj(x)[0]
        assert bool((full[:, -12:] == 0).all())
        torch.testing.assert_close(seen["z"].reshape(3, -1), full[:, 2564 - 512:2564], rtol=0, atol=0)
    with vllm_layer_context(str(write_full_config(tmp_path / "flash"))) as vllm_config:
        flash = _layer(vllm_config, runnable=False)
        assert flash.in_proj.output_size_per_partition == 20512 and flash.in_proj_pad == 0


def _op_inputs(layer, x, vllm_config):
    """What the layer's forward hands the KDA op (qkv, g, β), recorded in place of the op's core."""
    from vllm.forward_context import set_forward_context

    seen = {}
    layer.core = lambda qkv, g, beta, out: seen.update(qkv=qkv, g=g, beta=beta)
    with set_forward_context(None, vllm_config):
        layer(x)
    return seen


@pytest.mark.parametrize("mode", ["ours", "kernel"])
def test_the_op_gets_our_fp32_gate_or_the_raw_projections(monkeypatch, mode):
    """VLLM_LING_KDA_GATE=ours: g = the safe gate and β = σ(b), fp32. =kernel: the raw f and b slices of in_proj's
    output, for vLLM's kernels to gate; the CPU core then applies the same law (kda_core.gate_torch)."""
    pytest.importorskip("vllm")
    from vllm_ling import kda_core
    from vllm_ling.kda import GATE_ENV
    from vllm_ling.ops.kda import kda_safe_gate
    from vllm_layers import vllm_layer_context
    from ling_tools.tiny import ensure_tiny

    monkeypatch.setenv(GATE_ENV, mode)
    with vllm_layer_context(str(ensure_tiny(seed=0))) as vllm_config:
        layer = _layer(vllm_config)
        assert layer.gate_in_kernel == (mode == "kernel")
        x = torch.randn(3, vllm_config.model_config.hf_config.hidden_size)
        seen = _op_inputs(layer, x, vllm_config)
        p, h = layer.local_heads * layer.head_dim, layer.local_heads
        _, b, f, _ = layer.in_proj(x)[0][:, :5 * p + h].split([3 * p, h, p, p], dim=-1)
        lower_bound = vllm_config.model_config.hf_config.kda_lower_bound  # the tiny config serves the safe law
        want_g, want_beta = kda_safe_gate(f, layer.A_log, layer.dt_bias, lower_bound), b.float().sigmoid()
        if mode == "kernel":
            torch.testing.assert_close(seen["g"], f, rtol=0, atol=0)
            torch.testing.assert_close(seen["beta"], b, rtol=0, atol=0)
            seen["g"], seen["beta"] = kda_core.gate_torch(seen["g"], seen["beta"], layer.gate_params)
        assert seen["g"].dtype == seen["beta"].dtype == torch.float32
        torch.testing.assert_close(seen["g"], want_g, rtol=0, atol=0)
        torch.testing.assert_close(seen["beta"], want_beta, rtol=0, atol=0)


def test_the_gate_switch_on_cuda_defaults_to_the_kernels_and_refuses_unknown_values(monkeypatch, caplog):
    """On CUDA the default is vLLM's raw-gate kernels (every supported release ships them; the choice is logged
    once, the self-check reads that line), =ours keeps our gate, and a value outside the list is refused with
    the choices."""
    pytest.importorskip("vllm")
    from vllm_ling import compat, kda

    monkeypatch.setattr(compat, "is_cpu", lambda: False)
    kda._gate_in_kernel.cache_clear()
    monkeypatch.delenv(kda.GATE_ENV, raising=False)
    try:
        with caplog.at_level("INFO", logger="vllm_ling"):
            assert kda.gate_in_kernel() is True
        assert "KDA gate and β inside vLLM's KDA kernels" in caplog.text
        monkeypatch.setenv(kda.GATE_ENV, "ours")
        assert kda.gate_in_kernel() is False
        monkeypatch.setenv(kda.GATE_ENV, "fused")
        with pytest.raises(ValueError, match="VLLM_LING_KDA_GATE='fused' is not one of ours, kernel"):
            kda.gate_in_kernel()
    finally:
        kda._gate_in_kernel.cache_clear()


@pytest.mark.parametrize("env, method, kernel, want", [
    (None, None, "torch chunk_kda", True),  # the default: on where the prefill writes them
    (None, None, "FlashKDA", True),
    (None, None, "Triton chunk_kda", False),  # Triton cannot write one
    ("0", None, "FlashKDA", False),
    (None, "mtp", "FlashKDA", True),  # MTP changes nothing
    (None, "dspark", "FlashKDA", False),  # DSpark's smaller KV block: vLLM plans checkpoints its manager refuses
    (None, "dspark", "torch chunk_kda", False),
    ("0", "mtp", "FlashKDA", False),
])
def test_in_prefill_checkpoints_follow_the_rule(monkeypatch, caplog, env, method, kernel, want):
    """vllm_ling.kda.checkpoint_alignment: with the prefix cache (align mode), declared on FlashKDA's 16-token grid
    where the prefill kernel writes them, by default, without a drafter or with MTP; never with DSpark (saying why)
    nor without the prefix cache."""
    pytest.importorskip("vllm")
    import logging
    from types import SimpleNamespace

    from vllm_ling import kda
    from vllm_ling.flashkda import PrefillChoice

    if env is None:
        monkeypatch.delenv(kda.CHECKPOINT_ENV, raising=False)
    else:
        monkeypatch.setenv(kda.CHECKPOINT_ENV, env)
    kda._say_checkpoints.cache_clear()
    choice = PrefillChoice(kernel, "test", "auto")

    def config(mode: str | None):
        drafter = SimpleNamespace(method=method, num_speculative_tokens=4) if method else None
        return SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode=mode), speculative_config=drafter)

    with caplog.at_level(logging.INFO, logger=kda.logger.name):
        assert kda.checkpoint_alignment(config("align"), choice) == (16 if want else None)
    if method == "dspark" and env is None:
        assert "checkpoints OFF (DSpark" in caplog.text, caplog.text
    assert kda.checkpoint_alignment(config("none"), choice) is None
