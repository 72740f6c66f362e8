"""MTP speculative decoding (k=1) through a real vLLM engine on CPU, fp32: lossless and accepted when right.

The CPU engine verifies drafts with our torch KDA path (`kda_core._verify_torch`), which resumes each
sequence from the state slot of its last accepted token, as vLLM's CUDA kernels do. In fp32 near-ties do
not flip, so greedy output with MTP must equal greedy output without it token for token: with the
`mtp_echo` draft (built to agree: drafts mostly accepted, the KDA state resumes after accepted drafts) and
with the random `stable_router` draft (drafts rejected, every step rolls back). The GPU twin is
tests/gpu/test_mtp_gpu.py (bf16, CUDA kernels).
"""

from __future__ import annotations

import random

import pytest

from model_helpers import CPU_ENGINE_ENV, first_difference, run_script, spec_acceptance

pytest.importorskip("vllm")

PROMPT_LENGTHS = [3, 17, 64]  # the 64-token prompt is prefilled in chunks of 32 (budget) before drafting
MAX_TOKENS = 48
MTP = {"method": "mtp", "num_speculative_tokens": 1}


@pytest.fixture(scope="module", params=["mtp_echo", "stable_router"])
def pair(request, tmp_path_factory):
    from vllm_ling.tiny import ensure_tiny

    rng = random.Random(11)
    prompts = [[rng.randrange(10, 900) for _ in range(n)] for n in PROMPT_LENGTHS]
    tmp = tmp_path_factory.mktemp(f"mtp-cpu-{request.param}")
    base = {"model": str(ensure_tiny(variant=request.param)), "prompts": prompts, "max_tokens": MAX_TOKENS,
            "dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 32, "prompt_logprobs": False}
    plain = run_script("engine_runner.py", base, tmp, "plain", CPU_ENGINE_ENV)
    spec = run_script("engine_runner.py", {**base, "speculative_config": MTP}, tmp, "mtp", CPU_ENGINE_ENV)
    return request.param, plain, spec


def test_mtp_greedy_output_is_identical_to_plain_greedy(pair):
    name, plain, spec = pair
    for n, a, b in zip(PROMPT_LENGTHS, plain["outputs"], spec["outputs"]):
        first = first_difference(a["token_ids"], b["token_ids"])
        assert first is None, f"{name}: the {n}-token prompt's output differs with MTP from new token {first}"
        assert len(b["token_ids"]) == MAX_TOKENS


def test_acceptance_tracks_draft_quality_and_the_self_check_judges_it(pair):
    from vllm_ling.selfcheck import judge_acceptance

    name, _, spec = pair
    assert spec["spec_decode"].get("num_drafts", 0) > 0, "MTP never drafted"
    rate = spec_acceptance(spec)
    verdict = judge_acceptance({}, spec["spec_decode"], minimum=0.3)
    if name == "mtp_echo":
        assert rate >= 0.8, f"a draft built to agree was accepted only {rate:.1%}"
        assert not verdict.failed, verdict.line()
    else:
        assert rate <= 0.2, f"a random draft was accepted {rate:.1%}: verification is not checking"
        assert verdict.failed, verdict.line()
