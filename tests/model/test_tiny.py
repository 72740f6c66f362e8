"""The tiny-checkpoint maker: determinism, the checkpoint's tensor table, config/tokenizer loading with stock
transformers, clamps and routing bias that really matter, the cache, the CLI and the full-size config."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from model_helpers import config_of, read_checkpoint

from ling_tools import tiny
from vllm_ling.config import BailingMoeV3Config
from vllm_ling.layout import is_mla_layer

FP32_SUFFIXES = ("A_log", "dt_bias", "_conv1d.weight", "expert_bias")
PROMPTS = ["The weather in the mountains", "def fibonacci(n):", "Please summarize the report."]

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------------------------- helpers


def expected_tensors(c: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint table written from docs/architecture.md §Layers/§MTP/§Tensors, independently of
    ling_tools.tensors (the table the writer reads)."""
    H, V, L, G = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["layer_group_size"]
    heads, d, K = c["num_attention_heads"], c["head_dim"], c["short_conv_kernel_size"]
    P, E, I, Ie = heads * d, c["num_experts"], c["intermediate_size"], c["moe_intermediate_size"]
    Is = c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    r, nope, rope, vd = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    t: dict[str, tuple[int, ...]] = {
        "model.word_embeddings.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(L + c["num_nextn_predict_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = t[p + "post_attention_layernorm.weight"] = (H,)
        a = p + "attention."
        if (i + 1) % G == 0 or i >= (L // G) * G:  # MLA (MTP layers i >= L fall under the tail clause)
            if c["q_lora_rank"]:
                rq = c["q_lora_rank"]
                t |= {a + "q_a_proj.weight": (rq, H), a + "q_a_layernorm.weight": (rq,),
                      a + "q_b_proj.weight": (heads * (nope + rope), rq)}
            else:
                t[a + "q_proj.weight"] = (heads * (nope + rope), H)
            t |= {a + "kv_a_proj_with_mqa.weight": (r + rope, H), a + "kv_a_layernorm.weight": (r,),
                  a + "kv_b_proj.weight": (heads * (nope + vd), r), a + "g_proj.weight": (heads, H),
                  a + "dense.weight": (H, heads * vd)}
        else:
            for x in "qkvfg":
                t[a + f"{x}_proj.weight"] = (P, H)
            for x in "qkv":
                t[a + f"{x}_conv1d.weight"] = (P, 1, K)
            t |= {a + "b_proj.weight": (heads, H), a + "A_log": (heads,), a + "dt_bias": (P,),
                  a + "o_norm.weight": (d,), a + "o_proj.weight": (H, P)}
        m = p + "mlp."
        if i < c["first_k_dense_replace"]:
            t |= {m + "gate_proj.weight": (I, H), m + "up_proj.weight": (I, H), m + "down_proj.weight": (H, I)}
        else:
            t |= {m + "gate.weight": (E, H), m + "gate.expert_bias": (E,)}
            for name, w in [("shared_experts", Is)] + [(f"experts.{e}", Ie) for e in range(E)]:
                t |= {m + f"{name}.gate_proj.weight": (w, H), m + f"{name}.up_proj.weight": (w, H),
                      m + f"{name}.down_proj.weight": (H, w)}
        if i >= L:
            t |= {p + "enorm.weight": (H,), p + "hnorm.weight": (H,), p + "final_layernorm.weight": (H,),
                  p + "eh_proj.weight": (H, 2 * H)}
    return t


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return tiny.make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16", seed=0)


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    """transformers' native model in fp32, on its torch KDA path (FLA's Triton kernels need a GPU)."""
    import transformers.models.bailing_hybrid.modeling_bailing_hybrid as tfm
    from transformers import BailingHybridForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
            mp.setattr(tfm, name, inspect.unwrap(getattr(tfm, name)))
        model, info = BailingHybridForCausalLM.from_pretrained(
            tiny_dir, dtype=torch.float32, output_loading_info=True)
        yield model.eval(), info


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


# --------------------------------------------------------------------------------------------- files


def test_same_seed_gives_byte_identical_files_and_another_seed_other_weights(tiny_dir, tmp_path):
    again = tiny.make_tiny_checkpoint(tmp_path / "again", seed=0)
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    for name in files:
        assert (tiny_dir / name).read_bytes() == (again / name).read_bytes(), name

    other = read_checkpoint(tiny.make_tiny_checkpoint(tmp_path / "seed1", seed=1))
    base = read_checkpoint(tiny_dir)
    assert base.keys() == other.keys()
    differing = [k for k in base if not torch.equal(base[k], other[k])]
    assert len(differing) > 0.9 * len(base)


@pytest.mark.parametrize(
    "variant,overrides",
    [("default", {}), ("qlora", {}),
     # 5 layers with G = 3: layer 2 by the modulo rule, layers 3 and 4 by the tail rule are MLA
     ("default", {"num_hidden_layers": 5, "expert_swiglu_limit_list": [0, 0, 0, 1, 1],
                  "share_expert_swiglu_limit_list": [0, 0, 1, 1, 1]})],
    ids=["default", "qlora", "tail-rule"])
def test_tensor_names_shapes_and_dtypes_follow_the_architecture_rules(variant, overrides, tmp_path):
    out = tiny.make_tiny_checkpoint(tmp_path / variant, variant=variant, overrides=overrides)
    tensors = read_checkpoint(out)
    expected = expected_tensors(config_of(out))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    for name, t in tensors.items():
        assert t.dtype == (torch.float32 if name.endswith(FP32_SUFFIXES) else torch.bfloat16), name


def test_tail_rule_makes_trailing_layers_mla(tmp_path):
    config = tiny.tiny_config(overrides={"num_hidden_layers": 5})
    assert [is_mla_layer(config, i) for i in range(6)] == [False, False, True, True, True, True]


def test_layer_rule_reads_the_served_config_object_like_the_dict():
    config = tiny.tiny_config(overrides={"num_hidden_layers": 5})
    served = BailingMoeV3Config(**config)  # what vLLM hands the plugin
    assert [is_mla_layer(served, i) for i in range(6)] == [is_mla_layer(config, i) for i in range(6)]


def test_checkpoint_is_two_shards_with_a_complete_index(tiny_dir):
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"]) == set(read_checkpoint(tiny_dir))
    assert index["metadata"]["total_size"] == sum((tiny_dir / s).stat().st_size for s in shards)


def test_tiny_config_has_the_flash_field_set_and_the_tiny_values(tiny_dir):
    config = config_of(tiny_dir)
    flash = tiny.full_config()
    assert set(config) == set(flash) - {"quantization_config"}
    expected = {
        "architectures": ["BailingMoeV3ForCausalLM"], "model_type": "bailing_hybrid", "vocab_size": 2048,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "layer_group_size": 3,
        "first_k_dense_replace": 1, "num_attention_heads": 4, "head_dim": 128, "q_lora_rank": None,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_experts": 16, "num_experts_per_tok": 4,
        "n_group": 4, "topk_group": 2, "moe_intermediate_size": 128, "num_nextn_predict_layers": 1,
        "kda_safe_gate": True, "kda_lower_bound": -5.0, "partial_rotary_factor": 0.5,
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    assert {k: config[k] for k in expected} == expected
    assert len(config["expert_swiglu_limit_list"]) == len(config["share_expert_swiglu_limit_list"]) == 6
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["pad_token_id"]) == (config["eos_token_id"],
                                                                         config["pad_token_id"])


def test_bad_overrides_fail_with_the_value_and_the_rule(tmp_path):
    with pytest.raises(ValueError, match=r"expert_swiglu_limit_list has 6 entries but num_hidden_layers=4"):
        tiny.make_tiny_checkpoint(tmp_path / "a", overrides={"num_hidden_layers": 4})
    with pytest.raises(ValueError, match=r"num_experts=16, n_group=3"):
        tiny.make_tiny_checkpoint(tmp_path / "b", overrides={"n_group": 3})
    with pytest.raises(ValueError, match=r"vocab_size=512 does not cover the tokenizer"):
        tiny.make_tiny_checkpoint(tmp_path / "c", overrides={"vocab_size": 512})
    with pytest.raises(ValueError, match=r"variant='lora' is unknown"):
        tiny.make_tiny_checkpoint(tmp_path / "d", variant="lora")


# --------------------------------------------------------------------------------------------- transformers


def test_auto_map_sends_no_loader_to_remote_code_without_the_flag(tiny_dir):
    """The tiny config carries the release's auto_map but no configuration module: without trust_remote_code,
    transformers' AutoConfig and the oracle's model class parse it with a local class and never look for one."""
    from transformers import AutoConfig, BailingHybridConfig

    assert config_of(tiny_dir)["auto_map"]["AutoConfig"] == "configuration_bailing_moe_v3.BailingMoeV3Config"
    assert not list(tiny_dir.glob("*.py"))
    auto = AutoConfig.from_pretrained(tiny_dir, trust_remote_code=False)
    # transformers' class, or ours where this process registered it (a test that loads vLLM's plugins does)
    assert type(auto).__module__ in ("transformers.models.bailing_hybrid.configuration_bailing_hybrid",
                                     "vllm_ling.config")
    assert BailingHybridConfig.from_pretrained(tiny_dir).linear_head_dim == 128  # the oracle's config class


def test_transformers_autoconfig_reads_the_kda_head_dim_as_linear_head_dim(tiny_dir):
    # transformers' own class, by name: AutoConfig answers with whatever class this process registered last (a
    # test that loads vLLM's plugins registers ours for bailing_hybrid)
    from transformers import BailingHybridConfig as AutoConfig

    config = AutoConfig.from_pretrained(tiny_dir)
    assert type(config).__name__ == "BailingHybridConfig"
    # transformers 5.20 rewrites head_dim to the MLA rope dim and keeps the KDA dim as linear_head_dim
    assert (config.head_dim, config.linear_head_dim, config.qk_head_dim) == (64, 128, 192)
    expected_kinds = ["full_attention" if is_mla_layer(config_of(tiny_dir), i) else "linear_attention"
                      for i in range(6)]
    assert config.layer_types == expected_kinds
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * 5
    assert (config.num_local_experts, config.num_experts_per_tok, config.n_group) == (16, 4, 4)


def test_tokenizer_loads_without_remote_code_and_matches_the_config(tiny_dir, hf_tokenizer):
    from transformers import PreTrainedTokenizerFast

    config = config_of(tiny_dir)
    fast = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    for tok in (hf_tokenizer, fast):
        assert (tok.eos_token_id, tok.pad_token_id) == (config["eos_token_id"], config["pad_token_id"])
        assert tok.convert_ids_to_tokens(config["eos_token_id"]) == "<|endoftext|>"
        assert len(tok) <= config["vocab_size"]
    assert 900 <= len(hf_tokenizer) <= 1000
    tags = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
            "</arg_value>", "<|endoftext|>", "<|pad|>"]
    ids = hf_tokenizer.encode("".join(tags), add_special_tokens=False)
    assert hf_tokenizer.convert_ids_to_tokens(ids) == tags


def test_chat_template_opens_thinking_by_default_and_renders_tool_calls(hf_tokenizer):
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert prompt == "<role>HUMAN</role>Weather in Paris?<|role_end|><role>ASSISTANT</role><think>\n"
    no_think = hf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                                enable_thinking=False)
    assert no_think.endswith("<role>ASSISTANT</role>")
    assert not hf_tokenizer.apply_chat_template(chat, tokenize=False).endswith("<role>ASSISTANT</role>")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = chat + [{"role": "assistant", "content": "", "tool_calls": [call]},
                      {"role": "tool", "content": "sunny"}]
    text = hf_tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<role>SYSTEM</role>") and '"name": "get_weather"' in text
    assert ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>") in text
    assert "<role>OBSERVATION</role>sunny<|role_end|>" in text


def test_transformers_loads_the_bf16_checkpoint_with_only_the_mtp_layer_unused(hf_model):
    _, info = hf_model
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    assert info["unexpected_keys"] and all(k.startswith("model.layers.6.") for k in info["unexpected_keys"])


@torch.no_grad()
def test_transformers_greedy_generation_is_deterministic_and_not_degenerate(hf_model, hf_tokenizer):
    model, _ = hf_model
    for prompt in PROMPTS:
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        first = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        second = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
        assert first == second
        assert len(set(first)) >= 8, f"greedy output of {prompt!r} repeats: {first}"
        assert max(first) < len(hf_tokenizer), "padding ids past the tokenizer must not be generated"
        assert hf_tokenizer.decode(first)


@pytest.fixture(scope="module")
def moe_inputs(hf_model, hf_tokenizer) -> dict[int, torch.Tensor]:
    """The input of every MoE block (post-attention RMSNorm output) on a fixed 120-token prompt."""
    model, _ = hf_model
    captured: dict[int, torch.Tensor] = {}
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: captured.__setitem__(i, a[0][0]))
             for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]
    text = " ".join(PROMPTS) + " " + tiny.corpus()[:600]
    ids = hf_tokenizer(text, return_tensors="pt").input_ids[:, :120]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return captured


def _selected(scores: torch.Tensor, gate) -> torch.Tensor:
    """Grouped top-k (docs/architecture.md §MoE): groups ranked by their top-2 sum, top-k experts inside
    the kept groups."""
    t, e = scores.shape
    grouped = scores.view(t, gate.num_group, e // gate.num_group)
    keep = grouped.topk(2, -1).values.sum(-1).topk(gate.topk_group, -1).indices
    mask = torch.zeros(t, gate.num_group, dtype=torch.bool).scatter_(1, keep, True)
    masked = grouped.masked_fill(~mask[..., None], float("-inf")).view(t, e)
    return masked.topk(gate.top_k, -1).indices.sort(-1).values


def test_swiglu_clamps_bind_on_a_fixed_prompt(hf_model, tiny_dir, moe_inputs):
    """Pre-activations exceed the limit in every clamped layer, so a model without clamps computes
    something else there (transformers has no clamps: it is such a model)."""
    model, _ = hf_model
    config = config_of(tiny_dir)
    routed_limits, shared_limits = config["expert_swiglu_limit_list"], config["share_expert_swiglu_limit_list"]
    assert any(routed_limits) and any(shared_limits)
    for i, x in moe_inputs.items():
        mlp = model.model.layers[i].mlp
        _, _, chosen = mlp.gate(x)
        gate_up = torch.einsum("th,tkoh->tko", x, mlp.experts.gate_up_proj[chosen])
        g, u = gate_up.chunk(2, -1)
        if routed_limits[i]:
            lim = routed_limits[i]
            assert (g > lim).any() and (u.abs() > lim).any(), f"routed clamp of layer {i} never binds"
            clamped = torch.nn.functional.silu(g.clamp(max=lim)) * u.clamp(-lim, lim)
            assert not torch.allclose(clamped, torch.nn.functional.silu(g) * u)
        if shared_limits[i]:
            lim = shared_limits[i]
            sg, su = mlp.shared_experts.gate_proj(x), mlp.shared_experts.up_proj(x)
            assert (torch.nn.functional.silu(sg) > lim).any() and (su.abs() > lim).any(), (
                f"shared clamp of layer {i} never binds")


def test_router_bias_changes_expert_selection_on_some_tokens(hf_model, moe_inputs):
    model, _ = hf_model
    for i, x in moe_inputs.items():
        gate = model.model.layers[i].mlp.gate
        scores = torch.sigmoid(x.float() @ gate.weight.float().T)
        _, _, chosen = gate(x)
        with_bias = _selected(scores + gate.e_score_correction_bias, gate)
        assert torch.equal(with_bias, chosen.sort(-1).values)  # our reading of §MoE is transformers'
        changed = (with_bias != _selected(scores, gate)).any(-1).float().mean().item()
        assert 0.05 < changed < 1.0, f"layer {i}: the bias changes the selection of {changed:.0%} of tokens"


# --------------------------------------------------------------------------------------------- cache, CLI


def test_ensure_tiny_builds_once_into_the_cache_and_rebuilds_stale_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("LING_TINY_DIR", str(tmp_path))
    path = tiny.ensure_tiny(seed=3)
    assert path == tmp_path / "tiny-default-bf16-seed3" == tiny.default_tiny_dir(seed=3)
    mtime = (path / "config.json").stat().st_mtime_ns
    assert tiny.ensure_tiny(seed=3) == path and (path / "config.json").stat().st_mtime_ns == mtime
    stamp = json.loads((path / tiny.STAMP_FILE).read_text())
    (path / tiny.STAMP_FILE).write_text(json.dumps(stamp | {"generator_version": -1}))
    (path / "model-00001-of-00002.safetensors").write_bytes(b"half-written")
    rebuilt = tiny.ensure_tiny(seed=3)
    assert json.loads((rebuilt / tiny.STAMP_FILE).read_text()) == stamp
    assert read_checkpoint(rebuilt).keys() == expected_tensors(config_of(rebuilt)).keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-default-bf16-seed3"]  # no temp dirs left


def test_cli_without_out_builds_into_the_cache_and_prints_the_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LING_TINY_DIR", str(tmp_path))
    assert tiny.main(["--seed", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "tiny-default-bf16-seed2")
    assert (tmp_path / "tiny-default-bf16-seed2" / "config.json").exists()


def test_default_tiny_dir_without_env_is_in_the_user_cache(monkeypatch):
    monkeypatch.delenv("LING_TINY_DIR", raising=False)
    path = tiny.default_tiny_dir(seed=0, int4=True, variant="qlora")
    assert path == Path.home() / ".cache" / "vllm-ling" / "tiny-qlora-int4-seed0"


def test_cli_help_names_the_default_cache_path(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LING_TINY_DIR", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens otherwise
    with pytest.raises(SystemExit):
        tiny.main(["--help"])
    help_text = capsys.readouterr().out
    assert str(tmp_path / "tiny-VARIANT-") in help_text and "default_tiny_dir" not in help_text


def test_cli_refuses_a_non_empty_dir_unless_forced(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert tiny.main([str(tmp_path), "--seed", "1"]) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "keep.txt").exists()
    assert tiny.main([str(tmp_path), "--seed", "1", "--force"]) == 0
    assert not (tmp_path / "keep.txt").exists() and (tmp_path / "model.safetensors.index.json").exists()


def test_cli_full_config_writes_the_bundled_files(tmp_path):
    assert tiny.main([str(tmp_path / "flash"), "--full-config"]) == 0
    assert config_of(tmp_path / "flash") == tiny.full_config()
    assert json.loads((tmp_path / "flash" / "generation_config.json").read_text())["eos_token_id"] == 156895
    assert not (tmp_path / "flash" / "tokenizer.json").exists()


def test_cli_full_config_with_tokenizer_keeps_the_released_config_and_takes_text(tmp_path):
    """The folder a full-size dummy-weight server runs on for load benchmarks: the released config untouched, the
    tiny tokenizer beside it; an id past the tokenizer (the model emits any of its 157,184) decodes to nothing."""
    from transformers import AutoTokenizer

    flash = tmp_path / "flash"
    assert tiny.main([str(flash), "--full-config", "--tokenizer"]) == 0
    assert config_of(flash) == tiny.full_config()
    tok = AutoTokenizer.from_pretrained(flash)
    ids = tok("def fibonacci(n):")["input_ids"]
    assert ids and max(ids) < len(tok) < 1000 and tok.chat_template
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id != tiny.full_config()["eos_token_id"]
    assert tok.decode([ids[0], tiny.full_config()["vocab_size"] - 1]) == tok.decode([ids[0]])
    assert tiny.main([str(flash), "--full-config", "--tokenizer"]) == 2  # files there: --force to overwrite
    assert tiny.main([str(flash), "--full-config", "--tokenizer", "--force"]) == 0


def test_cli_tokenizer_goes_with_full_config(tmp_path, capsys):
    with pytest.raises(SystemExit):
        tiny.main([str(tmp_path), "--tokenizer"])
    assert "--tokenizer goes with --full-config" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- full size


def test_full_config_has_the_flash_layout():
    c = tiny.full_config()
    mla = [i for i in range(42) if is_mla_layer(c, i)]
    assert mla == [5, 11, 17, 23, 29, 35, 41] and is_mla_layer(c, 42)
    assert c["expert_swiglu_limit_list"] == [0] * 35 + [4] * 7
    assert c["share_expert_swiglu_limit_list"] == [0] * 34 + [5] * 6 + [7] * 2
    assert (c["vocab_size"], c["eos_token_id"], c["pad_token_id"]) == (157184, 156895, 156892)
    assert expected_tensors(c).keys() == tiny.tensor_specs(c).keys()


def test_full_config_parses_with_transformers(tmp_path):
    # transformers' own class, by name: AutoConfig answers with whatever class this process registered last (a
    # test that loads vLLM's plugins registers ours for bailing_hybrid)
    from transformers import BailingHybridConfig as AutoConfig

    tiny.write_full_config(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.linear_head_dim, config.num_hidden_layers, config.num_local_experts) == (128, 42, 512)
    assert config.layer_types.count("full_attention") == 7


def test_full_config_parameter_counts_match_the_public_figures():
    counts = tiny.param_counts(tiny.full_config())
    for key, public in [("main", 124.41e9), ("total", 127.49e9), ("active", 5.10e9)]:
        assert counts[key] == pytest.approx(public, rel=0.005), key
    shapes = expected_tensors(tiny.full_config())
    assert counts["total"] == sum(torch.Size(s).numel() for s in shapes.values())
