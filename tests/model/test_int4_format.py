"""The INT4 tiny checkpoint is the official compressed-tensors pack-quantized layout (docs/architecture.md
§INT4): only routed experts are packed, the words decode by the documented nibble rule to what
compressed-tensors and our dequantizer produce, within int4 error of the BF16 weights, and the
quantization_config parses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig

from model_helpers import config_of, read_checkpoint

from ling_tools import tiny

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4")
    int4 = tiny.make_tiny_checkpoint(root / "int4", seed=0, int4=True)
    return {"bf16": tiny.make_tiny_checkpoint(root / "bf16", seed=0), "int4": int4,
            "deq": tiny.dequantize_checkpoint(int4, root / "deq")}


@pytest.fixture(scope="module")
def ckpt(dirs) -> dict[str, dict[str, torch.Tensor]]:
    return {k: read_checkpoint(v) for k, v in dirs.items()}


def decode_by_the_documented_rule(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/architecture.md §INT4: element j of a row is in word j // 8 at bits 4 (j % 8);
    w = (nibble - 8) * scale[row, j // 32]."""
    words = packed.to(torch.int64) & 0xFFFFFFFF  # the int32 words as unsigned
    nibbles = torch.stack([(words >> (4 * k)) & 0xF for k in range(8)], dim=-1).flatten(1)
    q = nibbles - 8
    w = (q.float() * scale.float().repeat_interleave(32, dim=1)).to(torch.bfloat16)
    return q, w


def expected_ignore(config: dict) -> list[str]:
    """Every Linear that is not a routed expert, in `.attention.` naming (docs/architecture.md §INT4)."""
    L, G = config["num_hidden_layers"], config["layer_group_size"]
    names = []
    for i in range(L + config["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        if i >= L:
            names.append(p + "eh_proj")
        if (i + 1) % G == 0 or i >= (L // G) * G:
            names += [p + "attention." + m for m in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "dense")]
        else:
            kda = ("q_proj", "k_proj", "v_proj", "f_proj", "g_proj", "b_proj", "o_proj")
            names += [p + "attention." + m for m in kda]
        if i < config["first_k_dense_replace"]:
            names += [p + "mlp." + m for m in ("gate_proj", "up_proj", "down_proj")]
        else:
            names += [p + "mlp.gate"] + [p + f"mlp.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj")]
    return names + ["lm_head"]


def test_only_routed_experts_are_packed_with_the_official_shapes(ckpt):
    bf16, int4 = ckpt["bf16"], ckpt["int4"]
    experts = [n for n in bf16 if EXPERT.match(n)]
    assert len(experts) == 6 * 16 * 3  # 5 MoE layers + MTP layer 6, all routed experts
    expected_names = {n for n in bf16 if n not in experts}
    for n in experts:
        prefix = n.removesuffix("weight")
        expected_names |= {prefix + "weight_packed", prefix + "weight_scale", prefix + "weight_shape"}
        out, inp = bf16[n].shape
        assert int4[prefix + "weight_packed"].dtype == torch.int32
        assert tuple(int4[prefix + "weight_packed"].shape) == (out, inp // 8)
        assert int4[prefix + "weight_scale"].dtype == torch.bfloat16
        assert tuple(int4[prefix + "weight_scale"].shape) == (out, inp // 32)
        assert int4[prefix + "weight_shape"].tolist() == [out, inp]
    assert set(int4) == expected_names
    for n in expected_names & set(bf16):  # everything else is the BF16 checkpoint's tensor, bit for bit
        assert int4[n].dtype == bf16[n].dtype and torch.equal(int4[n], bf16[n]), n


def test_packed_words_decode_by_the_documented_rule_to_the_library_and_our_dequantizer(dirs, ckpt):
    scheme = QuantizationConfig.model_validate(config_of(dirs["int4"])["quantization_config"]).config_groups["group_0"]
    int4, deq = ckpt["int4"], ckpt["deq"]
    for n in (n for n in ckpt["bf16"] if EXPERT.match(n)):
        prefix = n.removesuffix("weight")
        local = {k: int4[prefix + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
        q, ours = decode_by_the_documented_rule(local["weight_packed"], local["weight_scale"])
        library = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        assert library.dtype == torch.bfloat16 and torch.equal(library, ours), n
        assert torch.equal(deq[n], ours), n
        assert q.min() >= -8 and q.max() <= 7


def test_dequantized_weights_are_within_int4_error_of_the_bf16_weights(ckpt):
    bf16, int4, deq = ckpt["bf16"], ckpt["int4"], ckpt["deq"]
    for n in (n for n in bf16 if EXPERT.match(n)):
        w = bf16[n].float()
        scale = int4[n.removesuffix("weight") + "weight_scale"].float().repeat_interleave(32, dim=1)
        err = (deq[n].float() - w).abs()
        # round-to-nearest: half a step; bf16 rounding of the scale, of w / scale and of q * scale add
        # a few parts in 2^8 of |w| (measured worst case: 0.537 steps at |w| = 7.5 steps)
        assert (err <= 0.5 * scale + w.abs() * 2**-7 + 1e-6).all(), n
        # symmetric min-max: scale = absmax / 7.5 per group of 32 (compressed-tensors' rule)
        absmax = w.abs().unflatten(1, (-1, 32)).amax(-1).repeat_interleave(32, dim=1)
        assert torch.allclose(scale, absmax / 7.5, rtol=2**-7), n
    assert set(deq) == set(bf16)
    for n in (n for n in bf16 if not EXPERT.match(n)):
        assert torch.equal(deq[n], bf16[n]), n


def test_quantization_config_is_compressed_tensors_w4a16_group32(dirs):
    config = config_of(dirs["int4"])
    raw = config["quantization_config"]
    assert (raw["quant_method"], raw["format"], raw["quantization_status"]) == (
        "compressed-tensors", "pack-quantized", "compressed")
    qc = QuantizationConfig.model_validate(raw)
    (scheme,) = qc.config_groups.values()
    w = scheme.weights
    assert scheme.targets == ["Linear"] and scheme.input_activations is None
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size) == (4, "int", True, "group", 32)
    assert qc.ignore == expected_ignore(config)
    assert not any(".experts." in name for name in qc.ignore)


def test_dequantized_checkpoint_is_the_bf16_layout_without_quantization_config(dirs):
    config, deq_config = config_of(dirs["bf16"]), config_of(dirs["deq"])
    assert "quantization_config" not in deq_config and deq_config == config
    assert (dirs["deq"] / "tokenizer.json").read_bytes() == (dirs["bf16"] / "tokenizer.json").read_bytes()


def test_full_size_config_ignores_every_non_expert_linear_of_all_43_layers():
    config = tiny.full_config()
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.format == "pack-quantized" and qc.ignore == expected_ignore(config)
    assert len(qc.ignore) == 35 * 7 + 8 * 5 + 2 * 3 + 41 * 4 + 2  # KDA, MLA (+MTP), dense, MoE, eh_proj + lm_head
    assert "model.layers.42.eh_proj" in qc.ignore and "model.layers.42.attention.dense" in qc.ignore


def test_vllm_compressed_tensors_config_parses_it(dirs):
    ct = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors")
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
        find_matched_target,
        should_ignore_layer,
    )

    config = ct.CompressedTensorsConfig.from_config(config_of(dirs["int4"])["quantization_config"])
    assert config.quant_format == "pack-quantized" and list(config.target_scheme_map) == ["Linear"]
    weights = config.target_scheme_map["Linear"]["weights"]
    assert (weights.num_bits, weights.group_size, weights.symmetric) == (4, 32, True)
    linear = torch.nn.Linear(1, 1)
    expert = "model.layers.6.mlp.experts.15.down_proj"
    assert not should_ignore_layer(expert, config.ignore) and find_matched_target(expert, linear, ["Linear"])
    for name in ("model.layers.0.attention.q_proj", "model.layers.2.attention.dense", "model.layers.6.eh_proj",
                 "model.layers.3.mlp.shared_experts.up_proj", "model.layers.4.mlp.gate", "lm_head"):
        assert should_ignore_layer(name, config.ignore), name
