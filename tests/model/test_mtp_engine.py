"""MTP speculative decoding (k=1) through a real vLLM engine on CPU, fp32: lossless and accepted when right.

The CPU engine verifies drafts with our torch KDA path (`kda_core._verify_torch`), which resumes each
sequence from the state slot of its last accepted token, as vLLM's CUDA kernels do. In fp32 near-ties do
not flip, so greedy output with MTP must equal greedy output without it token for token: with the
`mtp_echo` draft (built to agree: drafts mostly accepted, the KDA state resumes after accepted drafts) and
with the random `stable_router` draft (drafts rejected, every step rolls back). And the engine's acceptance
counters must equal, draft for draft, what the draft equations predict (`references.mtp_draft_guesses` on the
transformers oracle's hidden states, replayed through k=1 verification): every draft that agrees with the
target is accepted and every other one rejected, so the echo draft's ~89% is its agreement, not a loss.
The SwiGLU clamps are off, as in every run held to the oracle (it has none). The GPU twin is
tests/gpu/test_mtp_gpu.py (bf16, CUDA kernels).
"""

from __future__ import annotations


import pytest
import torch
from model_helpers import first_difference, random_prompts, spec_acceptance
from references import mtp_draft_guesses
from shared_engines import declare, mtp_engines

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [3, 17, 64]  # the 64-token prompt is prefilled in chunks of 32 (budget) before drafting
MAX_TOKENS = 48


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=11)


# per draft: the plain engine's request and the MTP engine's (shared_engines.mtp_engines)
JOB = {"prompts": _prompts(), "max_tokens": MAX_TOKENS, "prompt_logprobs": False}
RUNS = {variant: tuple(declare(engine, "mtp-engine", **JOB) for engine in mtp_engines(variant))
        for variant in ("mtp_echo", "stable_router")}


@pytest.fixture(scope="module", params=list(RUNS))
def pair(request, shared_engine):
    plain, spec = RUNS[request.param]
    return request.param, shared_engine(plain), shared_engine(spec)


def test_mtp_greedy_output_is_identical_to_plain_greedy(pair):
    name, plain, spec = pair
    for n, a, b in zip(PROMPT_LENGTHS, plain["outputs"], spec["outputs"]):
        first = first_difference(a["token_ids"], b["token_ids"])
        assert first is None, f"{name}: the {n}-token prompt's output differs with MTP from new token {first}"
        assert len(b["token_ids"]) == MAX_TOKENS


def test_acceptance_tracks_draft_quality_and_the_self_check_judges_it(pair):
    from ling_tools.selfcheck import judge_acceptance

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


def _replay_k1(prompt_len: int, seq: list[int], guess: list[int]) -> tuple[int, int]:
    """(drafts, accepted) of k=1 verification along a finished greedy sequence.

    guess[t] is the draft's token for position t+2 (from h_t and token t+1). With the newest committed token
    at position m, a step verifies the draft for m+1: accepted, it commits two tokens (m += 2), rejected, one.
    Prefill commits position prompt_len; steps run until every new token is committed."""
    drafts = accepted = 0
    m = prompt_len
    while m + 1 < len(seq):
        drafts += 1
        hit = guess[m - 1] == seq[m + 1]
        accepted += hit
        m += 2 if hit else 1
    return drafts, accepted


def test_acceptance_is_exactly_what_the_draft_equations_predict(pair, run_oracle, tmp_path):
    from ling_tools.tiny import ensure_tiny

    name, _, spec = pair
    model = str(ensure_tiny(variant=name))
    seqs = [p + o["token_ids"] for p, o in zip(_prompts(), spec["outputs"])]
    run_oracle({"model": model, "prompts": [], "score": seqs, "hidden_path": str(tmp_path / "h.pt")}, f"replay-{name}")
    drafts = accepted = 0
    for p, seq, guess in zip(PROMPT_LENGTHS, seqs, mtp_draft_guesses(model, seqs, torch.load(tmp_path / "h.pt"))):
        d, a = _replay_k1(p, seq, guess)
        drafts, accepted = drafts + d, accepted + a
    counters = spec["spec_decode"]
    assert (counters.get("num_drafts"), counters.get("num_accepted_tokens")) == (drafts, accepted), \
        f"{name}: the engine verified {counters}; the draft equations predict {drafts} drafts, {accepted} accepted"
