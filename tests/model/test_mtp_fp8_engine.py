"""MTP k=1 with the FP8 LM head and FP8 linears (`--quantization ling_fp8`) on the CPU engine, fp32 activations.

The integration trap: the draft must run on the target's FP8 head. A draft reading FP8 bytes as BF16 guesses
garbage and is accepted ~0% with no error. Here the `mtp_echo` draft (built to agree with the target) must be
accepted within 3 points of the same draft with BF16 weights, the draft check inside vLLM must report the
shared FP8 head, and greedy output with MTP must equal greedy output without it (the FP8 model, both runs).
"""

from __future__ import annotations

import random

import pytest
from model_helpers import CPU_ENGINE_ENV, NO_CLAMPS, first_difference, run_scripts, spec_acceptance

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

MTP = {"method": "mtp", "num_speculative_tokens": 1}
FP8 = {"quantization": "ling_fp8"}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ling_tools.tiny import ensure_tiny

    rng = random.Random(11)
    base = {"model": str(ensure_tiny(variant="mtp_echo")), "max_tokens": MAX_TOKENS, "dtype": "float32",
            "prompts": [[rng.randrange(10, 900) for _ in range(n)] for n in (3, 17, 64)], "max_model_len": 512,
            "max_num_batched_tokens": 32, "prompt_logprobs": False, "hf_overrides": NO_CLAMPS}
    jobs = [("engine_runner.py", {**base, "engine_kwargs": FP8}, "plain-fp8"),
            ("engine_runner.py", {**base, "speculative_config": MTP, "engine_kwargs": FP8, "log_lines": True},
             "mtp-fp8"),
            ("engine_runner.py", {**base, "speculative_config": MTP}, "mtp-bf16")]
    plain, fp8, bf16 = run_scripts(jobs, tmp_path_factory.mktemp("mtp-fp8"), CPU_ENGINE_ENV)
    return plain, fp8, bf16


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
