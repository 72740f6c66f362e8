"""What users load is what we test: the bundled config against the released one, our config class against
the released fields, and which class (and so which head_dim) each way of loading a `bailing_hybrid` folder
yields, with and without vllm-ling's plugin (docs/architecture.md §Config has the table).

Run as a script (`python test_config_loading.py PLUGIN DIR...`) it is the probe the table test starts in a
fresh process: registering a config class cannot be undone inside one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_ling.config import FLASH_ONLY_FIELDS

REPO = Path(__file__).resolve().parents[2]

# The released BF16 Ling-3.0-flash config.json, key for key (a public verbatim copy, written out here by
# hand as this test's own oracle).
RELEASED_FLASH: dict[str, Any] = {
    "architectures": ["BailingMoeV3ForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_bailing_moe_v3.BailingMoeV3Config",
                 "AutoModel": "modeling_bailing_moe_v3.BailingMoeV3Model",
                 "AutoModelForCausalLM": "modeling_bailing_moe_v3.BailingMoeV3ForCausalLM"},
    "embedding_dropout": 0.0, "eos_token_id": 156895, "expert_swiglu_limit_list": [0] * 35 + [4] * 7,
    "first_k_dense_replace": 2, "gated_attention_proj_granularity_type": "head_wise", "group_norm_size": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 6144, "kda_lower_bound": -5.0, "kda_safe_gate": True, "kv_lora_rank": 512,
    "layer_group_size": 6, "linear_silu": True, "max_position_embeddings": 262144, "max_window_layers": 20,
    "moe_intermediate_size": 768, "moe_router_enable_expert_bias": True, "moe_shared_expert_intermediate_size": 768,
    "mtp_loss_scaling_factor": 0, "mtp_use_kda": False, "n_group": 8, "no_kda_lora": True, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts": 512, "num_experts_per_tok": 8, "num_hidden_layers": 42,
    "num_key_value_heads": 32, "num_kv_heads_for_linear_attn": 0, "num_nextn_predict_layers": 1,
    "num_shared_experts": 1, "output_dropout": 0.0, "output_router_logits": False, "pad_token_id": 156892,
    "partial_rotary_factor": 0.5, "q_lora_rank": None, "qk_head_dim": 192, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_interleave": True, "rope_scaling": None,
    "rope_theta": 6000000, "rotary_dim": 64, "routed_scaling_factor": 2.5, "router_dtype": "fp32",
    "scale_router_input": False, "score_function": "sigmoid", "scoring_func": "sigmoid", "seq_aux": True,
    "share_expert_swiglu_limit_list": [0] * 34 + [5] * 6 + [7] * 2, "short_conv_kernel_size": 4,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "transformers_version": "4.45.0",
    "up_proj_norm": False, "use_bias": False, "use_cache": True, "use_kda_lora": False, "use_mla_nope": False,
    "use_nGPT": False, "use_qk_norm": True, "use_qkv_bias": False, "v_head_dim": 128, "value_norm": False,
    "vocab_size": 157184, "model_type": "bailing_hybrid", "torch_dtype": "bfloat16",
}

# A Ling-2.5-style config.json: the fields of the released Ling-2.5 configuration class (all of them, as
# save_pretrained writes them) at small widths, with its own auto_map.
LING25: dict[str, Any] = {
    "architectures": ["BailingMoeV2_5ForCausalLM"], "model_type": "bailing_hybrid",
    "auto_map": {"AutoConfig": "configuration_bailing_moe_v2_5.BailingMoeV2_5Config"},
    "vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 10,
    "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_act": "silu", "use_qkv_bias": False,
    "use_bias": False, "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "embedding_dropout": 0.0,
    "attention_dropout": 0.0, "output_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 8192,
    "rope_theta": 600000.0, "use_cache": True, "max_window_layers": 10, "rope_scaling": None,
    "pad_token_id": 4000, "eos_token_id": 4001, "num_experts": 16, "num_shared_experts": 1,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "moe_intermediate_size": 128,
    "first_k_dense_replace": 1, "head_dim": 128, "output_router_logits": False, "use_qk_norm": True,
    "num_nextn_predict_layers": 1, "mtp_loss_scaling_factor": 0, "moe_router_enable_expert_bias": True,
    "routed_scaling_factor": 2.5, "layer_group_size": 5, "group_norm_size": 4, "linear_silu": False,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "rope_interleave": True, "partial_rotary_factor": 0.5, "score_function": "sigmoid", "scoring_func": "sigmoid",
    "seq_aux": True, "topk_method": "noaux_tc", "router_dtype": "fp32",
}

# Stand-ins for the checkpoints' own configuration modules (ours, not the released files): each keeps the
# fields as written, with its head_dim, as the released classes do.
STAND_IN_V3 = '''from transformers import PretrainedConfig


class BailingMoeV3Config(PretrainedConfig):
    model_type = "bailing_hybrid"

    def __init__(self, head_dim=128, **kwargs):
        self.head_dim = head_dim
        super().__init__(**kwargs)
'''
STAND_IN_V25 = '''from transformers import PretrainedConfig


class BailingMoeV2_5Config(PretrainedConfig):
    model_type = "bailing_hybrid"

    def __init__(self, head_dim=None, hidden_size=2048, num_attention_heads=16, rope_theta=600000.0,
                 rope_scaling=None, partial_rotary_factor=0.5, **kwargs):
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.partial_rotary_factor = partial_rotary_factor
        super().__init__(**kwargs)
'''

# What the loaders' classes are called in the table.
CLASS_LABELS = {"vllm_ling.config.BailingMoeV3Config": "vllm-ling",
                "transformers.models.bailing_hybrid.configuration_bailing_hybrid.BailingHybridConfig": "transformers"}


def class_label(name: str) -> str:
    return "checkpoint" if name.startswith("transformers_modules.") else CLASS_LABELS.get(name, name)


def bundled() -> dict[str, Any]:
    from vllm_ling.configs import flash_config

    return flash_config()


# ----------------------------------------------------------------------------------------------- the files


def test_bundled_config_is_the_released_config_plus_the_int4_block():
    config = bundled()
    assert set(config) == set(RELEASED_FLASH) | {"quantization_config"}
    assert {k: v for k, v in config.items() if k != "quantization_config"} == RELEASED_FLASH
    assert config["quantization_config"]["format"] == "pack-quantized"


def test_tiny_int4_config_has_the_bundled_key_set(tmp_path):
    """The INT4 tiny checkpoint carries exactly the bundled key set (the BF16 one all but quantization_config:
    test_tiny.py), auto_map included, so loaders meet what they meet on the release."""
    from ling_tools.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(tmp_path / "int4", int4=True)
    config = json.loads((out / "config.json").read_text())
    assert set(config) == set(bundled())
    assert config["auto_map"] == RELEASED_FLASH["auto_map"]


def test_stale_tiny_caches_rebuild_after_the_config_change():
    from ling_tools.tiny.writer import GENERATOR_VERSION, stamp

    # version 2 built configs without the released keys: a cache stamped with it must not match
    assert GENERATOR_VERSION >= 3
    assert stamp(0, False, "default", None) != {**stamp(0, False, "default", None), "generator_version": 2}


# ------------------------------------------------------------------------------------------ our config class


def test_our_class_keeps_every_released_key_as_written():
    from vllm_ling.config import BailingMoeV3Config

    config = BailingMoeV3Config.from_dict(bundled())
    for key, value in RELEASED_FLASH.items():
        if key == "torch_dtype":  # transformers 5 stores it as `dtype`
            assert str(config.dtype).removeprefix("torch.") == value
        elif key == "rope_scaling":  # transformers 5 folds it (null) into rope_parameters
            assert config.rope_parameters.get("rope_type", "default") == "default"
        else:
            assert getattr(config, key) == value, key
    # the rotary width 0.5 is kept, for the record, and MLA ignores it
    from vllm_ling.config import mla_rope_parameters

    assert mla_rope_parameters(config) == {"rope_type": "default", "rope_theta": 6_000_000.0}


def test_flash_defaults_fill_ling3_configs_only():
    from vllm_ling.config import BailingMoeV3Config

    assert (BailingMoeV3Config().num_experts, BailingMoeV3Config().moe_shared_expert_intermediate_size) == (512, 768)
    assert BailingMoeV3Config(architectures=["BailingMoeV3ForCausalLM"], num_experts=16).n_group == 8
    other = BailingMoeV3Config(architectures=["BailingMoeV2_5ForCausalLM"], hidden_size=512)
    # vLLM's Ling-2.5 model sizes its shared expert by hasattr(config, "moe_shared_expert_intermediate_size")
    assert not hasattr(other, "moe_shared_expert_intermediate_size") and not hasattr(other, "num_experts")


def flipped(value: Any) -> Any:
    return (not value) if isinstance(value, bool) else value + 1


@pytest.mark.parametrize("key", sorted(FLASH_ONLY_FIELDS))
def test_a_released_key_that_asks_for_another_model_is_refused(key):
    from vllm_ling.config import check_supported

    config = bundled()
    check_supported(config)
    with pytest.raises(ValueError, match=rf"^{key}={flipped(config[key])!r} is not Ling-3.0-flash's model.*"
                                         rf"implements {key}={config[key]!r}"):
        check_supported({**config, key: flipped(config[key])})


@pytest.mark.parametrize(("key", "value", "want"), [("rotary_dim", 32, 64), ("qk_head_dim", 128, 192)])
def test_mla_widths_that_contradict_each_other_are_refused(key, value, want):
    from vllm_ling.config import check_supported

    with pytest.raises(ValueError, match=rf"{key}={value} contradicts .* needs {key}={want}"):
        check_supported({**bundled(), key: value})


# ---------------------------------------------------------------------------- loading: flag x config x plugin


def write_folder(path: Path, config: dict[str, Any], module: tuple[str, str] | None = None) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if module:
        (path / module[0]).write_text(module[1])
    return str(path)


@pytest.fixture(scope="module")
def loading(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """{"plugin|folder|flag|loader": result} for folders ling3 (the release's config, auto_map and a stand-in
    module), ling3-no-map (auto_map removed, like our bundled config before) and ling25."""
    tmp = tmp_path_factory.mktemp("loading")
    ling3 = {k: v for k, v in bundled().items() if k != "quantization_config"}
    folders = {
        "ling3": write_folder(tmp / "ling3", ling3, ("configuration_bailing_moe_v3.py", STAND_IN_V3)),
        "ling3-no-map": write_folder(tmp / "ling3-no-map", {k: v for k, v in ling3.items() if k != "auto_map"}),
        "ling25": write_folder(tmp / "ling25", LING25, ("configuration_bailing_moe_v2_5.py", STAND_IN_V25)),
    }
    by_path = {v: k for k, v in folders.items()}
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    results = {}
    for plugin in ("0", "1"):
        run = subprocess.run([sys.executable, __file__, plugin, *folders.values()], env=env, capture_output=True,
                             text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        for key, value in json.loads(run.stdout.strip().splitlines()[-1]).items():
            path, flag, loader = key.split("|")
            results[f"{'plugin' if plugin == '1' else 'none'}|{by_path[path]}|{flag}|{loader}"] = value
    return results


# plugin x config folder x trust_remote_code x loader -> (class, head_dim); docs/architecture.md §Config
EXPECTED_TABLE = {
    "none|ling3|True|transformers": ("checkpoint", 128), "none|ling3|True|vllm": ("checkpoint", 128),
    "none|ling3|False|transformers": ("transformers", 64), "none|ling3|False|vllm": ("transformers", 64),
    "none|ling3-no-map|True|transformers": ("transformers", 64), "none|ling3-no-map|True|vllm": ("transformers", 64),
    "none|ling3-no-map|False|transformers": ("transformers", 64),
    "none|ling3-no-map|False|vllm": ("transformers", 64),
    "plugin|ling3|True|transformers": ("vllm-ling", 128), "plugin|ling3|True|vllm": ("vllm-ling", 128),
    "plugin|ling3|False|transformers": ("vllm-ling", 128), "plugin|ling3|False|vllm": ("vllm-ling", 128),
    "plugin|ling3-no-map|True|transformers": ("vllm-ling", 128), "plugin|ling3-no-map|True|vllm": ("vllm-ling", 128),
    "plugin|ling3-no-map|False|transformers": ("vllm-ling", 128),
    "plugin|ling3-no-map|False|vllm": ("vllm-ling", 128),
}


def test_which_class_and_head_dim_each_way_of_loading_yields(loading):
    table = {key: (class_label(loading[key].get("class", loading[key].get("error", ""))), loading[key].get("head_dim"))
             for key in EXPECTED_TABLE}
    assert table == EXPECTED_TABLE


def test_ling25_reads_the_same_with_the_plugin_as_under_its_own_class(loading):
    """Our class replaces every bailing_hybrid config in vLLM; for Ling-2.5 it must mean what the checkpoint's
    own class means (what vLLM builds with --trust-remote-code without the plugin), field by field."""
    own = loading["none|ling25|True|vllm"]
    assert class_label(own["class"]) == "checkpoint"
    for flag in ("True", "False"):
        ours = loading[f"plugin|ling25|{flag}|vllm"]
        assert class_label(ours["class"]) == "vllm-ling"
        assert ours["fields"] == own["fields"]
    # the linear attention keeps its half rotary width (partial_rotary_factor 0.5)
    assert own["fields"]["linear_attention_rope"]["partial_rotary_factor"] == 0.5


def test_ling25_without_the_flag_differs_under_transformers_class_only_in_head_dim(loading):
    """Without the flag and without the plugin, transformers' class rewrites Ling-2.5's head_dim to
    qk_rope_head_dim as it does Ling-3.0's (its linear attention then runs at half width); ours keeps
    config.json's 128 like the checkpoint's class. The one other difference is a field Ling-2.5's config.json
    lacks: transformers fills in Flash's norm_topk_prob=True, ours leaves it absent, which vLLM's Ling-2.5 MoE
    reads as True (`True if norm_topk_prob is None`)."""
    native, ours = loading["none|ling25|False|vllm"], loading["plugin|ling25|False|vllm"]
    assert class_label(native["class"]) == "transformers"
    differ = {k: (ours["fields"][k], native["fields"][k]) for k in ours["fields"]
              if ours["fields"][k] != native["fields"][k]}
    assert differ == {"head_dim": (128, 64), "norm_topk_prob": ("<absent>", True)}


if __name__ == "__main__":
    def describe(config: Any) -> dict[str, Any]:
        from vllm.model_executor.layers.mamba.linear.bailing_linear_attn import _build_rope_parameters

        # what vLLM's Ling-2.5 model, its linear attention and its MTP draft read (vllm/model_executor/models/
        # bailing_moe_linear.py, bailing_moe_mtp.py, layers/mamba/linear/)
        names = ("block", "first_k_dense_replace", "group_norm_size", "head_dim", "hidden_size", "intermediate_size",
                 "kv_lora_rank", "layer_group_size", "linear_rope", "linear_silu", "max_position_embeddings",
                 "moe_intermediate_size", "moe_router_enable_expert_bias", "moe_shared_expert_intermediate_size",
                 "n_group", "norm_topk_prob", "num_attention_heads", "num_experts", "num_experts_per_tok",
                 "num_hidden_layers", "num_nextn_predict_layers", "num_shared_experts", "q_lora_rank",
                 "qk_nope_head_dim", "qk_rope_head_dim", "rms_norm_eps", "rope_theta", "routed_scaling_factor",
                 "router_dtype", "score_function", "tie_word_embeddings", "topk_group", "use_bias",
                 "use_linear_silu", "use_qk_norm", "use_qkv_bias", "v_head_dim", "vocab_size")
        fields = {name: getattr(config, name, "<absent>") for name in names}
        fields["linear_attention_rope"] = _build_rope_parameters(config)
        return {"class": f"{type(config).__module__}.{type(config).__name__}", "head_dim": config.head_dim,
                "fields": json.loads(json.dumps(fields, default=str))}

    def probe(plugin: bool, folders: list[str]) -> dict[str, Any]:
        from transformers import AutoConfig
        from vllm.transformers_utils.config import get_config

        if plugin:  # what vllm-ling's plugin does in every vLLM process
            from vllm_ling import compat
            from vllm_ling.config import BailingMoeV3Config

            compat.register_config_class(BailingMoeV3Config)
        loaders = {"transformers": lambda path, flag: AutoConfig.from_pretrained(path, trust_remote_code=flag),
                   "vllm": lambda path, flag: get_config(path, trust_remote_code=flag)}
        results = {}
        for folder in folders:
            for flag in (True, False):
                for name, load in loaders.items():
                    try:
                        results[f"{folder}|{flag}|{name}"] = describe(load(folder, flag))
                    except Exception as e:  # noqa: BLE001 - a failing combination is a result too
                        results[f"{folder}|{flag}|{name}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
        return results

    print(json.dumps(probe(sys.argv[1] == "1", sys.argv[2:])))
