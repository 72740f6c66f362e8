"""The KDA layer's output gate, a slice of the merged in_proj's output, reaches the gated norm in a form that may
cross a boundary of vLLM's piecewise graph (vllm_ling/kda.py explains the GPU failure this guards: a 2,564-wide
GEMM output padded to row stride 2,568 by the compile, seen on the H200 in session 9)."""

from __future__ import annotations

import pytest
import torch


def _layer(vllm_config, runnable: bool = True):
    from vllm_ling.kda import BailingMoeV3KDA

    layer = BailingMoeV3KDA(vllm_config.model_config.hf_config, vllm_config, prefix="model.layers.0.self_attn")
    if not runnable:
        return layer
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    for m in layer.modules():  # as the loader does after the weights (vLLM's CPU linears set up their kernel here)
        if getattr(m, "quant_method", None) is not None:
            m.quant_method.process_weights_after_loading(m)
    return layer


def test_an_unaligned_gate_is_copied_before_the_op_and_the_real_width_is_not(tmp_path):
    """Tiny checkpoint (width 5·512 + 4 = 2,564): the gate handed to the norm is contiguous and equals the slice
    it came from. Ling-3.0-flash (20,512, a multiple of 16): no copy is made."""
    pytest.importorskip("vllm")
    from vllm.forward_context import set_forward_context

    from vllm_layers import vllm_layer_context
    from vllm_ling.tiny import ensure_tiny, write_full_config

    with vllm_layer_context(str(ensure_tiny(seed=0))) as vllm_config:
        layer = _layer(vllm_config)
        seen = {}
        norm = layer.o_norm.forward
        layer.o_norm.forward = lambda x, z: seen.setdefault("z", z) is not None and norm(x, z)
        x = torch.randn(3, vllm_config.model_config.hf_config.hidden_size)
        with set_forward_context(None, vllm_config):
            layer(x)
        width = layer.in_proj.output_size_per_partition
        assert width % 16 != 0 and layer.gate_copy
        z = seen["z"]
        assert z.is_contiguous(), z.stride()
        torch.testing.assert_close(z.reshape(3, -1), layer.in_proj(x)[0][:, -z[0].numel():], rtol=0, atol=0)
    with vllm_layer_context(str(write_full_config(tmp_path / "flash"))) as vllm_config:
        flash = _layer(vllm_config, runnable=False)
        assert flash.in_proj.output_size_per_partition == 20512 and not flash.gate_copy
