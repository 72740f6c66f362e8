import json

import pytest
from ling_tuning.shapes import (
    PRESETS,
    MoEShape,
    bundled_config_path,
    default_batch_sizes,
    resolve_model,
    shape_from_config,
)

LING_CT = {  # the INT4 checkpoint's relevant fields (docs/architecture.md §Config, §INT4)
    "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "hidden_size": 2560,
    "num_experts": 512, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                       "strategy": "group", "group_size": 32}}}},
}


def test_ling_config_gives_vllm_shape_and_int4_dtype():
    shape = shape_from_config(LING_CT)
    assert shape == PRESETS["ling-3.0-flash"]
    s = shape
    assert (s.num_experts, s.intermediate, s.hidden, s.top_k, s.group_size) == (512, 768, 2560, 8, 32)
    assert shape.dtype == "int4_w4a16"


def test_moe_width_not_dense_width_is_n_and_tp_splits_it():
    assert shape_from_config(LING_CT, tp=2).intermediate == 384
    with pytest.raises(ValueError, match="tp=5"):
        shape_from_config(LING_CT, tp=5)


def test_transformers_attribute_names_and_vl_wrapper_are_read():
    cfg = {k: v for k, v in LING_CT.items() if k != "num_experts_per_tok"} | {"num_experts_per_token": 8}
    assert shape_from_config({"text_config": cfg}) == PRESETS["ling-3.0-flash"]


def test_gptq_style_flat_quant_config():
    cfg = LING_CT | {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 64}}
    assert shape_from_config(cfg).group_size == 64


def test_bf16_and_8bit_checkpoints_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="not INT4"):
        shape_from_config({k: v for k, v in LING_CT.items() if k != "quantization_config"})
    with pytest.raises(ValueError, match="weight_bits=8"):
        shape_from_config(LING_CT | {"quantization_config": {"bits": 8, "group_size": 32}})


def test_expert_bytes_count_int4_weights_and_bf16_group_scales():
    # 3·768·2560 weights at 4 bit + one bf16 scale per 32 of them
    assert PRESETS["ling-3.0-flash"].expert_bytes == 3 * 768 * 2560 // 2 + 3 * 768 * 2560 // 32 * 2


def test_resolve_accepts_folder_file_and_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LING_CT))
    assert resolve_model(str(tmp_path))[0] == resolve_model(str(tmp_path / "config.json"))[0]
    assert resolve_model("ling-3.0-flash")[0] == PRESETS["ling-3.0-flash"]
    assert resolve_model("ling-3.0-flash", tp=2)[0].intermediate == 384  # the preset splits over TP like a file
    with pytest.raises(FileNotFoundError, match="ling-3.0-flash"):
        resolve_model(str(tmp_path / "nope"))


def test_bundled_ling_config_matches_the_preset():
    assert shape_from_config(json.loads(bundled_config_path().read_text())) == PRESETS["ling-3.0-flash"]


def test_batch_grid_is_vllms_up_to_the_prefill_chunk():
    assert default_batch_sizes(8192)[:4] == [1, 2, 4, 8] and default_batch_sizes(8192)[-2:] == [4096, 8192]
    assert default_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    with pytest.raises(ValueError):
        default_batch_sizes(0)


def test_group_must_divide_both_reductions():
    with pytest.raises(ValueError, match="group_size"):
        MoEShape(num_experts=8, intermediate=100, hidden=256, top_k=2, group_size=32)
