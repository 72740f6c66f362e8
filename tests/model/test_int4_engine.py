"""The INT4 tiny checkpoint (compressed-tensors pack-quantized experts) through the CPU engine against the
transformers oracle on the same checkpoint dequantized to BF16 by compressed-tensors itself. Greedy identity is
judged on the oracle's teacher-forced scoring of the engine's tokens (tests/model/test_tp.py says why that is the
oracle's own greedy continuation)."""

from __future__ import annotations

import random

import pytest

from model_helpers import first_difference, max_abs_diff
from shared_engines import INT4, declare

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [5, 64, 130]  # the 130-token prompt is prefilled in chunks (shared_engines.CHUNKED)
MAX_TOKENS = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(10, 600) for _ in range(n)] for n in PROMPT_LENGTHS]


ENGINE = declare(INT4, "int4-engine", prompts=_prompts(), max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def runs(shared_engine, run_oracle, tmp_path_factory):
    from ling_tools.tiny import dequantize_checkpoint, ensure_tiny

    reference = str(dequantize_checkpoint(str(ensure_tiny(int4=True)), tmp_path_factory.mktemp("deq") / "bf16"))
    prompts, engine = _prompts(), shared_engine(ENGINE)
    oracle = run_oracle({"model": reference, "prompts": [],  # scoring only
                         "score": [p + o["token_ids"] for p, o in zip(prompts, engine["outputs"])]}, "int4-oracle")
    return prompts, engine, oracle


def test_int4_engine_matches_dequantized_oracle(runs):
    prompts, engine, oracle = runs
    assert engine["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"
    for p, got, scored in zip(prompts, engine["outputs"], oracle["scored"]):
        assert len(got["token_ids"]) == MAX_TOKENS
        first = first_difference(got["token_ids"], scored["argmax"][len(p):])
        assert first is None, f"prompt of {len(p)} tokens: new token {first} is not the oracle's argmax"
        err = max_abs_diff(got["prompt_logprobs"] + got["logprobs"], scored["logprobs"][: len(p)] + scored["logprobs"][len(p):])
        assert err <= 1e-3, f"prompt of {len(p)} tokens: logprob error {err:.2e}"
