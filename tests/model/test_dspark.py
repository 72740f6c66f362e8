"""DSpark groundwork that the CPU can prove (docs/dspark.md): the target's aux hidden states, the drafter's config
normalisation and validation, and the tiny drafter writer. vLLM's DSpark runtime is CUDA-only
(tests/gpu/test_dspark_gpu.py runs it).

The aux-capture test runs one CPU engine on the tiny checkpoint, asks our model for vLLM's aux layers of a drafter
config through vLLM's own mapping (`get_eagle3_aux_layers_from_config`), and holds the captured tensors against
the transformers oracle's per-layer hidden states. Run as a script (python test_dspark.py engine|oracle SPEC OUT),
this file is also the engine / oracle side of that test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

HERE = Path(__file__).parent
# Tiny drafter target ids, SGLang's "after layer i": 1 (KDA), 2 (MLA), 4 (KDA) of the tiny model's 6 layers.
TINY_TARGET_IDS = [1, 2, 4]
TOL = 2e-4  # fp32 engine vs fp32 oracle, relative to the stream's scale


# ---------------------------------------------------------------------------- subprocess sides (script mode)

def _engine(spec: dict) -> dict:
    """One CPU engine; our model captures the aux layers `spec["aux"]`; one prefill of `spec["prompt"]`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="float32", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2,
              enable_prefix_caching=False, enforce_eager=True, hf_overrides=spec["hf_overrides"], seed=0)
    outputs: list[object] = []

    def wrap(model) -> None:
        forward = model.forward

        def forward_keeping_aux(*args, **kwargs):
            out = forward(*args, **kwargs)
            outputs.append(out)
            return out[0] if isinstance(out, tuple) else out

        model.forward = forward_keeping_aux

    def ask(model) -> None:
        model.set_aux_hidden_state_layers(tuple(spec["aux"]))  # vLLM's SupportsEagle3 method, as its runner calls it

    prompt, params = [TokensPrompt(prompt_token_ids=spec["prompt"])], SamplingParams(temperature=0.0, max_tokens=1)
    llm.apply_model(wrap)
    llm.generate(prompt, params)  # no drafter: the model returns a plain tensor
    plain = [type(o).__name__ for o in outputs]
    outputs.clear()
    llm.apply_model(ask)
    llm.generate(prompt, params)
    prefill = next(o for o in outputs if isinstance(o, tuple) and o[0].shape[0] == len(spec["prompt"]))
    torch.save([t.detach().float().cpu().clone() for t in prefill[1]], spec["out_path"])
    return {"plain_types": sorted(set(plain)), "captured": len(prefill[1])}


def _oracle(spec: dict) -> dict:
    """transformers' BailingHybrid (fp32, its torch KDA path): `output_hidden_states` and, to pin its indexing,
    each decoder layer's output by a forward hook."""
    sys.path.insert(0, str(HERE))
    import oracle  # noqa: F401  hides fla / causal_conv1d: transformers' torch path
    from transformers import BailingHybridForCausalLM

    model = BailingHybridForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    after: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda _m, _i, out: after.append((out[0] if isinstance(out, tuple) else out)[0]))
    with torch.no_grad():
        out = model(torch.tensor([spec["prompt"]]), output_hidden_states=True)
    torch.save({"hidden_states": [h[0].float() for h in out.hidden_states], "after_layer": after},
               spec["out_path"])
    return {"hidden_states": len(out.hidden_states), "layers": len(after)}


def _route(spec: dict) -> dict:
    """vLLM's speculative config for method "dspark" with a tiny Ling drafter, the plugin loaded as vLLM loads
    it: where the drafter's config ends up (the engine itself is refused on the CPU: DSpark is MRV2-only)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    args = EngineArgs(model=spec["model"], dtype="bfloat16", skip_tokenizer_init=True,
                      speculative_config={"method": "dspark", "model": spec["draft"]})
    target = args.create_model_config()
    spec_config = args.create_speculative_config(target, ParallelConfig())
    draft = spec_config.draft_model_config
    return {"architectures": list(draft.hf_config.architectures), "model_type": draft.hf_config.model_type,
            "resolved": draft.architecture, "k": spec_config.num_speculative_tokens,
            "aux": list(get_eagle3_aux_layers_from_config(spec_config)), "markov_rank": draft.hf_config.markov_rank,
            "mask": (draft.hf_config.dflash_config or {}).get("mask_token_id")}


# ---------------------------------------------------------------------------- the aux hidden states

def vllm_aux_layers(draft_config: dict) -> tuple[int, ...]:
    """The aux layer ids vLLM's runner asks the target for, given a drafter's config (vLLM's own mapping)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**draft_config)))
    return get_eagle3_aux_layers_from_config(spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def aux_capture(tiny_bf16, tmp_path_factory):
    """(captured aux tensors, oracle hidden states, oracle per-layer outputs, engine facts, aux ids)."""
    from model_helpers import CPU_ENGINE_ENV, NO_CLAMPS, random_prompts, run_scripts

    from vllm_ling.draft.dspark import normalise_draft_config

    tmp = tmp_path_factory.mktemp("dspark-aux")
    draft = normalise_draft_config({"architectures": ["LingDSparkModel"], "model_type": "qwen3",
                                    "dspark_target_layer_ids": TINY_TARGET_IDS, "block_size": 8, "markov_rank": 16})
    aux = vllm_aux_layers(draft)
    prompt = random_prompts([40], seed=11)[0]
    common = {"model": tiny_bf16, "prompt": prompt, "aux": list(aux), "hf_overrides": NO_CLAMPS}
    engine, oracle_out = run_scripts(
        [("test_dspark.py", {**common, "side": "engine", "out_path": str(tmp / "aux.pt")}, "engine"),
         ("test_dspark.py", {**common, "side": "oracle", "out_path": str(tmp / "hs.pt")}, "oracle")],
        tmp, envs=[CPU_ENGINE_ENV, {}])
    ref = torch.load(tmp / "hs.pt")
    return torch.load(tmp / "aux.pt"), ref["hidden_states"], ref["after_layer"], engine, aux


def test_vllm_asks_for_the_stream_after_each_target_layer():
    """vLLM's +1: a DSpark target id i (captured after layer i, SGLang) becomes aux id i + 1 (before layer i + 1)."""
    assert vllm_aux_layers({"dspark_target_layer_ids": [1, 11, 23, 29, 35]}) == (2, 12, 24, 30, 36)


@pytest.mark.engine
def test_aux_hidden_states_equal_the_oracle(aux_capture):
    captured, hidden, after, engine, aux = aux_capture
    assert engine["plain_types"] == ["Tensor"], "with no drafter asking, forward must return a plain tensor"
    assert len(captured) == len(aux) == len(TINY_TARGET_IDS)
    # transformers' hidden_states[j] is the stream entering layer j (0: the embedding) = after layer j - 1
    for j in range(1, len(after)):
        assert _rel(hidden[j], after[j - 1]) < 1e-6, f"oracle hidden_states[{j}] is not the output of layer {j - 1}"
    for target_id, tensor in zip(TINY_TARGET_IDS, captured):
        assert _rel(tensor, after[target_id]) < TOL, f"aux for target layer {target_id} differs from the oracle"


@pytest.mark.engine
def test_an_off_by_one_layer_choice_fails(aux_capture):
    """The comparison can fail: the stream one layer earlier or later is far outside the tolerance."""
    captured, _, after, _, _ = aux_capture
    for target_id, tensor in zip(TINY_TARGET_IDS, captured):
        for wrong in (target_id - 1, target_id + 1):
            assert _rel(tensor, after[wrong]) > 100 * TOL, (target_id, wrong)


# ---------------------------------------------------------------------------- the drafter's config

def _card_drafter(**changes) -> dict:
    """The released drafter's fields (model card) in SGLang's prefixed spelling, before normalisation."""
    config = {"architectures": ["LingDSparkModel"], "model_type": "qwen3", "hidden_size": 2560,
              "vocab_size": 157184, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 32,
              "dspark_block_size": 8, "dspark_markov_rank": 256, "dspark_markov_head_type": "vanilla",
              "dspark_target_layer_ids": [1, 11, 23, 29, 35], "dspark_noise_token_id": 156892,
              "enable_confidence_head": True}
    config.update(changes)
    return config


def test_normalise_puts_lings_drafter_on_vllms_qwen3_dspark_path():
    from vllm_ling.draft.dspark import normalise_draft_config

    c = normalise_draft_config(_card_drafter())
    assert c["architectures"] == ["LingDSparkModel", "Qwen3DSparkModel"]
    assert (c["block_size"], c["markov_rank"], c["markov_head_type"]) == (8, 256, "vanilla")
    assert c["dspark_target_layer_ids"] == [1, 11, 23, 29, 35] and c["use_aux_hidden_state"] is True
    assert c["mask_token_id"] == c["dflash_config"]["mask_token_id"] == 156892
    assert normalise_draft_config(dict(c)) == c  # idempotent: vLLM may apply its override twice
    qwen3 = {"architectures": ["Qwen3DSparkModel"], "block_size": 7}
    assert normalise_draft_config(dict(qwen3)) == qwen3  # other drafters untouched


def test_normalise_refuses_two_spellings_that_disagree():
    from vllm_ling.draft.dspark import normalise_draft_config

    with pytest.raises(ValueError, match=r"block_size twice.*dspark_block_size.*8.*block_size.*4"):
        normalise_draft_config(_card_drafter(block_size=4))


def test_the_released_drafter_fits_flash():
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import drafter_problems, normalise_draft_config

    draft = normalise_draft_config(_card_drafter())
    assert drafter_problems(flash_config(), draft, num_speculative_tokens=7) == []
    assert drafter_problems(flash_config(), draft) == []  # K defaults to block_size


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 4096}, ["hidden_size", "4096", "2560"]),
    ({"dspark_target_layer_ids": [1, 11, 23, 29, 42]}, ["dspark_target_layer_ids", "[42]", "num_hidden_layers=42"]),
    ({"dspark_target_layer_ids": [11, 1]}, ["dspark_target_layer_ids", "strictly increasing"]),
    ({"dspark_markov_rank": None}, ["markov_rank=None", "Markov head"]),
    ({"dspark_markov_head_type": "gated"}, ["markov_head_type='gated'", "vanilla"]),
    ({"vocab_size": 151936}, ["vocab_size", "151936", "157184"]),  # a Qwen3 drafter
])
def test_a_bad_drafter_is_refused_with_the_field_the_values_and_the_fix(change, words):
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import check_drafter, normalise_draft_config

    with pytest.raises(ValueError) as err:
        check_drafter(flash_config(), normalise_draft_config(_card_drafter(**change)))
    for word in [*words, "Fix: serve the drafter trained for this target"]:
        assert word in str(err.value), (word, str(err.value))


def test_k_beyond_the_block_is_refused():
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import check_drafter, normalise_draft_config

    with pytest.raises(ValueError, match=r"num_speculative_tokens=9 is outside 1..block_size=8"):
        check_drafter(flash_config(), normalise_draft_config(_card_drafter()), num_speculative_tokens=9)


def test_vllm_routes_the_drafter_to_our_qwen3_dspark_class(tiny_bf16, tmp_path):
    """vLLM's own speculative config, the plugin loaded: our drafter class, K = the block size, the aux layers."""
    from model_helpers import run_script

    from ling_tools.tiny.dspark import TINY_TARGET_LAYER_IDS, make_tiny_dspark

    draft = make_tiny_dspark(tmp_path / "draft", Path(tiny_bf16))
    out = run_script("test_dspark.py", {"side": "route", "model": tiny_bf16, "draft": str(draft)}, tmp_path,
                     "route", {"VLLM_LING_FORCE": "1"})
    assert out["resolved"] == "LingDSparkModel" and out["model_type"] == "qwen3"  # not the DeepSeek-V4 branch
    assert out["architectures"] == ["LingDSparkModel", "Qwen3DSparkModel"]
    assert (out["k"], out["markov_rank"]) == (8, 256)
    assert out["aux"] == [i + 1 for i in TINY_TARGET_LAYER_IDS]


# ---------------------------------------------------------------------------- the tiny drafter

def test_tiny_drafter_has_the_real_names_and_fits_its_target(tiny_bf16, tmp_path):
    from safetensors.torch import load_file

    from vllm_ling.draft.dspark import check_drafter, check_drafter_tensors, normalise_draft_config, required_tensors
    from ling_tools.tiny.dspark import make_tiny_dspark

    out = make_tiny_dspark(tmp_path / "d", Path(tiny_bf16))
    config = normalise_draft_config(json.loads((out / "config.json").read_text()))
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(required_tensors(config))
    assert not [n for n in tensors if "lm_head" in n or "embed_tokens" in n]  # the target's, shared
    target = json.loads((Path(tiny_bf16) / "config.json").read_text())
    assert tensors["fc.weight"].shape == (target["hidden_size"], 3 * target["hidden_size"])
    assert tensors["markov_head.markov_w2.weight"].shape == (target["vocab_size"], 256)
    check_drafter(target, config)
    check_drafter_tensors(config, tensors)
    with pytest.raises(ValueError, match="lacks markov_head.markov_w1.weight, markov_head.markov_w2.weight"):
        check_drafter_tensors(config, [n for n in tensors if not n.startswith("markov_head.")])


def test_the_agreeing_drafter_drafts_the_echo_targets_next_token(tmp_path):
    """Markov bias argmax = f(prev) for every token; the random drafter's almost never is."""
    from safetensors.torch import load_file

    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark, target_echo

    target = ensure_tiny(variant="mtp_echo")
    echo = target_echo(target, json.loads((target / "config.json").read_text()))

    def markov_choice(agree: bool) -> torch.Tensor:
        w = load_file(make_tiny_dspark(tmp_path / str(agree), target, agree=agree) / "model.safetensors")
        return (w["markov_head.markov_w1.weight"].float() @ w["markov_head.markov_w2.weight"].float().T).argmax(-1)

    assert (markov_choice(True) == echo).float().mean() == 1.0
    assert (markov_choice(False) == echo).float().mean() < 0.01


# ---------------------------------------------------------------------------- the shared (FP8) LM head

@pytest.fixture
def fp8_target(tiny_bf16):
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm_layers import vllm_layer_context

    from vllm_ling import fp8
    from vllm_ling.draft import check as draft_check

    with vllm_layer_context(tiny_bf16):
        torch.manual_seed(0)
        head = ParallelLMHead(512, 256, quant_config=fp8.LingFp8Config(kernel="w8a8"), prefix="lm_head")
        head.weight.weight_loader(head.weight, torch.randn(512, 256, dtype=torch.bfloat16) / 16)
        target = nn.Module()
        target.lm_head, target.model = head, nn.Module()
        target.model.embed_tokens = VocabParallelEmbedding(512, 256)
        draft_check._targets.clear()
        draft_check.register_target(target)
        yield target
        draft_check._targets.clear()


def _draft_without_head(target):
    """A drafter as vLLM's DSpark loader builds it: its own BF16 head and embedding, no checkpoint tensors
    for them (has_own_lm_head / has_own_embed_tokens stay False)."""
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    draft = nn.Module()
    draft.lm_head, draft.model = ParallelLMHead(512, 256, prefix="lm_head"), nn.Module()
    draft.model.embed_tokens = VocabParallelEmbedding(512, 256)
    return draft


def test_vllms_dspark_loader_installs_the_targets_fp8_head_module_itself(fp8_target, tiny_bf16):
    from vllm.v1.worker.gpu.spec_decode.eagle import utils
    from vllm_layers import vllm_layer_context

    from vllm_ling.draft.dspark import check_draft_shares_target

    with vllm_layer_context(tiny_bf16):
        draft = _draft_without_head(fp8_target)
        utils.maybe_share_target_embed(draft, draft.model, fp8_target.model)  # what load_dspark_model calls
        if hasattr(utils, "share_target_lm_head"):  # 0.34
            utils.share_target_lm_head(draft, fp8_target.lm_head, None, can_share=True)
        else:  # 0.32/0.33 load_dspark_model, inline: replace the draft's head when _should_share says so
            assert utils._should_share(draft, "has_own_lm_head", draft.lm_head, fp8_target.lm_head)
            draft.lm_head = fp8_target.lm_head
    assert draft.lm_head is fp8_target.lm_head and draft.model.embed_tokens is fp8_target.model.embed_tokens
    line = check_draft_shares_target(draft)
    assert "shared with" in line and "Fp8" in line and "float8_e4m3fn" in line


def test_a_drafter_reading_the_fp8_bytes_through_a_bf16_head_is_refused(fp8_target, tiny_bf16):
    from vllm_layers import vllm_layer_context

    from vllm_ling.draft.dspark import check_draft_shares_target

    with vllm_layer_context(tiny_bf16):
        draft = _draft_without_head(fp8_target)
    draft.lm_head.weight = fp8_target.lm_head.weight  # the FP8 tensor under UnquantizedEmbeddingMethod
    draft.model.embed_tokens = fp8_target.model.embed_tokens
    with pytest.raises(RuntimeError, match=r"DSpark drafter's lm_head runs Unquantized.* where the target runs Fp8"):
        check_draft_shares_target(draft)


def test_our_drafter_class_refuses_missing_tensors_and_checks_its_head(fp8_target, tiny_bf16, tmp_path, monkeypatch):
    """`LingDSparkForCausalLM` (what vLLM builds for the drafter): vLLM's loading underneath, our two checks on top."""
    from safetensors.torch import load_file
    from torch import nn
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_ling.draft.dspark import LingDSparkForCausalLM, normalise_draft_config
    from ling_tools.tiny.dspark import make_tiny_dspark

    assert issubclass(LingDSparkForCausalLM, Qwen3DSparkForCausalLM)
    out = make_tiny_dspark(tmp_path / "d", Path(tiny_bf16))
    monkeypatch.setattr(Qwen3DSparkForCausalLM, "load_weights", lambda self, weights: [n for n, _ in weights])
    drafter = LingDSparkForCausalLM.__new__(LingDSparkForCausalLM)
    nn.Module.__init__(drafter)
    drafter.config = normalise_draft_config(json.loads((out / "config.json").read_text()))
    tensors = load_file(out / "model.safetensors")
    drafter.load_weights(tensors.items())
    with pytest.raises(ValueError, match="lacks markov_head.markov_w2.weight"):
        drafter.load_weights((n, t) for n, t in tensors.items() if n != "markov_head.markov_w2.weight")
    drafter.lm_head, drafter.model = fp8_target.lm_head, nn.Module()
    drafter.model.embed_tokens = fp8_target.model.embed_tokens
    drafter._check_shares_once()
    assert drafter._shares_checked


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = {"engine": _engine, "oracle": _oracle, "route": _route}[spec["side"]](spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    from model_helpers import exit_at_once  # this script's folder is on sys.path

    exit_at_once()
