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

    from vllm_ling.dspark import normalise_draft_config

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


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = _engine(spec) if spec["side"] == "engine" else _oracle(spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
