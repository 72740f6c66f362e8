"""Concurrent requests under MTP (k=1) through a real vLLM engine on CPU, fp32: each output equals its solo run.

vLLM #55894: a drafter's batch reorder corrupted the recurrent state of a hybrid model's requests (0.2-1.6% of
responses). The risk is in the batch's bookkeeping, not in one sequence's maths: when a request finishes, vLLM
condenses its persistent batch and moves another request into the freed row, and a KDA state read or written by
row instead of by the request's own slot then belongs to someone else. So six prompts of different lengths run
together, each to its own length (they finish at six different steps, the 90-token one prefilled in chunks of 32
while the others already draft), and each request's greedy tokens must equal what the same engine gives it alone.
In fp32 near-ties do not flip (as test_mtp_engine.py relies on), so equality is token for token; with the `mtp_echo`
draft (accepted: the state resumes after accepted drafts) and the random `stable_router` draft (rejected: every
step rolls back). The GPU twin, with DSpark beside MTP and bf16's tolerance: tests/gpu/test_spec_concurrency_gpu.py.
"""

from __future__ import annotations

import pytest
from model_helpers import first_difference, random_prompts
from shared_engines import declare, mtp_engines

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [3, 90, 17, 64, 5, 40]
MAX_TOKENS = [40, 12, 33, 24, 48, 7]  # six different finishing steps


def _prompts() -> list[list[int]]:
    return random_prompts(PROMPT_LENGTHS, seed=23)


def _requests(variant: str) -> tuple:
    engine = mtp_engines(variant)[1]
    together = declare(engine, "concurrent", prompts=_prompts(), max_tokens=MAX_TOKENS, prompt_logprobs=False)
    alone = [declare(engine, f"concurrent-solo-{i}", prompts=[p], max_tokens=n, prompt_logprobs=False)
             for i, (p, n) in enumerate(zip(_prompts(), MAX_TOKENS))]
    return together, alone


RUNS = {variant: _requests(variant) for variant in ("mtp_echo", "stable_router")}


@pytest.mark.parametrize("variant", list(RUNS))
def test_each_concurrent_request_equals_its_solo_run(variant, shared_engine):
    together, alone = RUNS[variant]
    batch = shared_engine(together)
    assert batch["spec_decode"].get("num_drafts", 0) > 0, f"{variant}: MTP never drafted"
    for i, (req, n) in enumerate(zip(alone, MAX_TOKENS)):
        solo, mixed = shared_engine(req)["outputs"][0]["token_ids"], batch["outputs"][i]["token_ids"]
        assert len(mixed) == n and len(solo) == n
        first = first_difference(solo, mixed)
        assert first is None, (f"{variant}: the {PROMPT_LENGTHS[i]}-token prompt run beside five others parts from "
                               f"its solo run at new token {first} of {n}")

