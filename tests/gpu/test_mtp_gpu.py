"""MTP speculative decoding (k=1) on a GPU with vLLM 0.26: lossless, and accepted when the draft is right.

Two tiny checkpoints: the default one (random draft: acceptance near 0, verification rejects) and
`mtp_echo`, whose draft is built to predict the target's next token (acceptance near 1). For both,
greedy output with MTP must equal greedy output without it, token for token, over >= 128 new tokens.
Run on the device: VLLM_LING_GPU_RESULTS=$OUT python -m pytest tests/gpu/test_mtp_gpu.py -q
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from gpu_helpers import GPU_ENV, record, run_script  # noqa: E402  (skips the module without CUDA)
PROMPT_LENGTHS = [3, 17, 64, 130, 400]
MAX_TOKENS = 128
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 900) for _ in range(n)] for n in PROMPT_LENGTHS]


def _acceptance(run: dict) -> float:
    c = run["spec_decode"]
    return c.get("num_accepted_tokens", 0.0) / max(c.get("num_draft_tokens", 0.0), 1.0)


@pytest.fixture(scope="module", params=["stable_router", "mtp_echo"])
def pair(request, tmp_path_factory):
    from vllm_ling.tiny import ensure_tiny

    model = str(ensure_tiny(variant=request.param))
    tmp = tmp_path_factory.mktemp(f"mtp-{request.param}")
    base = {"model": model, "prompts": _prompts(), "max_tokens": MAX_TOKENS, "dtype": "bfloat16",
            "enforce_eager": False, "gpu_memory_utilization": 0.3, "max_model_len": 2048,
            "max_num_batched_tokens": 512, "prompt_logprobs": False}
    plain = run_script("engine_runner.py", base, tmp, "plain", GPU_ENV)
    spec = run_script("engine_runner.py", {**base, "speculative_config": MTP}, tmp, "mtp", GPU_ENV)
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(plain["outputs"], spec["outputs"]))
    record(f"mtp_{request.param}", {"acceptance": _acceptance(spec), "counters": spec["spec_decode"],
                                    "identical_requests": same, "requests": len(PROMPT_LENGTHS),
                                    "new_tokens_each": MAX_TOKENS})
    return request.param, plain, spec


def test_mtp_is_lossless(pair):
    name, plain, spec = pair
    for n, a, b in zip(PROMPT_LENGTHS, plain["outputs"], spec["outputs"]):
        first = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"])) if x != y), None)
        assert first is None, f"{name}: prompt of {n} tokens differs with MTP from new token {first}"


def test_acceptance_tracks_draft_quality(pair):
    """And the start-up self-check's acceptance probe passes the good draft and fails the random one."""
    from vllm_ling.selfcheck import judge_acceptance

    name, _, spec = pair
    rate = _acceptance(spec)
    verdict = judge_acceptance({}, spec["spec_decode"], minimum=0.3)
    assert verdict.failed == (name == "stable_router"), verdict.line()
    assert spec["spec_decode"].get("num_drafts", 0) > 0, "MTP never drafted"
    if name == "mtp_echo":
        assert rate >= 0.8, f"a draft built to agree was accepted only {rate:.2%}"
    else:
        assert rate <= 0.2, f"a random draft was accepted {rate:.2%}: verification is not checking"
