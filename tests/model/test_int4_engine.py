"""The INT4 tiny checkpoint (compressed-tensors pack-quantized experts) through the CPU engine against the
transformers oracle on the same checkpoint dequantized to BF16 by compressed-tensors itself."""

from __future__ import annotations

import random

import pytest

from model_helpers import NO_CLAMPS, max_abs_diff

pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [5, 64, 130]


@pytest.fixture(scope="module")
def runs(run_engine, run_oracle, tmp_path_factory):
    from ling_tools.tiny import dequantize_checkpoint, ensure_tiny

    int4 = str(ensure_tiny(int4=True))
    reference = str(dequantize_checkpoint(int4, tmp_path_factory.mktemp("deq") / "bf16"))
    rng = random.Random(5)
    prompts = [[rng.randrange(10, 600) for _ in range(n)] for n in PROMPT_LENGTHS]
    engine = run_engine({"model": int4, "prompts": prompts, "max_tokens": 16, "hf_overrides": NO_CLAMPS,
                         "max_num_batched_tokens": 128}, "int4")
    oracle = run_oracle({"model": reference, "prompts": prompts, "max_tokens": 16,
                         "score": [p + o["token_ids"] for p, o in zip(prompts, engine["outputs"])]}, "int4-oracle")
    return prompts, engine, oracle


def test_int4_engine_matches_dequantized_oracle(runs):
    prompts, engine, oracle = runs
    assert engine["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"
    for p, got, want, scored in zip(prompts, engine["outputs"], oracle["outputs"], oracle["scored"]):
        assert got["token_ids"] == want["token_ids"], f"prompt of {len(p)} tokens diverged"
        err = max_abs_diff(got["prompt_logprobs"] + got["logprobs"], scored["logprobs"][: len(p)] + scored["logprobs"][len(p):])
        assert err <= 1e-3, f"prompt of {len(p)} tokens: logprob error {err:.2e}"
