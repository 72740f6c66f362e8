"""MTP k=1 with the FP8 LM head and FP8 linears (`--quantization ling_fp8`) on the CPU engine, fp32 activations.

The integration trap: the draft must run on the target's FP8 head. A draft reading FP8 bytes as BF16 guesses
garbage and is accepted ~0% with no error. Here the `mtp_echo` draft (built to agree with the target) must be
accepted within 3 points of the same draft with BF16 weights, the draft check inside vLLM must report the
shared FP8 head, and greedy output with MTP must equal greedy output without it (the FP8 model, both runs).
"""

from __future__ import annotations

import pytest
from model_helpers import first_difference, random_prompts, spec_acceptance
from shared_engines import ECHO, ECHO_MTP, Engine, declare

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

FP8 = {"quantization": "ling_fp8"}
MAX_TOKENS = 48


def _fp8(engine: Engine) -> Engine:
    """`engine` with FP8 weights."""
    return Engine(f"{engine.name}-fp8", engine.tiny, {**engine.settings, "engine_kwargs": FP8}, engine.env)


JOB = {"prompts": random_prompts([3, 17, 64], seed=11), "max_tokens": MAX_TOKENS, "prompt_logprobs": False}
PLAIN_FP8 = declare(_fp8(ECHO), "mtp-fp8", **JOB)
MTP_FP8 = declare(_fp8(ECHO_MTP), "mtp-fp8", **JOB, log_lines=True)
MTP_BF16 = declare(ECHO_MTP, "mtp-fp8", **JOB)


@pytest.fixture(scope="module")
def runs(shared_engine):
    return tuple(shared_engine(r) for r in (PLAIN_FP8, MTP_FP8, MTP_BF16))


def test_the_draft_runs_on_the_targets_fp8_head(runs):
    lines = [x for x in runs[1]["log_lines"] if "MTP draft" in x]
    assert lines and "shared with the target's" in lines[-1] and "float8_e4m3fn" in lines[-1], lines


def test_fp8_draft_acceptance_is_within_3_points_of_bf16(runs):
    _, fp8, bf16 = runs
    assert spec_acceptance(bf16) > 0.5, "the echo draft should agree most of the time"
    assert abs(spec_acceptance(fp8) - spec_acceptance(bf16)) <= 0.03, (spec_acceptance(fp8), spec_acceptance(bf16))


def test_fp8_mtp_greedy_output_equals_fp8_plain_greedy(runs):
    plain, fp8, _ = runs
    for a, b in zip(plain["outputs"], fp8["outputs"]):
        assert first_difference(a["token_ids"], b["token_ids"]) is None
