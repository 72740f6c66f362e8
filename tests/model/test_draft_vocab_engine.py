"""A draft vocabulary through a real vLLM engine on CPU (fp32, the `mtp_echo` checkpoint, MTP k=1): vLLM asks the
draft for its top token (`use_local_argmax_reduction`), and the draft proposes among the file's ids only.

- the whole vocabulary as the file: the same drafts as the plain MTP engine (acceptance counters equal);
- a vocabulary that leaves out every token the target ends up generating: output still identical to plain greedy
  (the target verifies every proposal), and no draft accepted but the rare one that reaches a listed id;
- without `use_local_argmax_reduction`, a set VLLM_LING_DRAFT_VOCAB refuses to start instead of being ignored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_helpers import (CPU_ENGINE_ENV, draft_vocab_file, first_difference, random_prompts, run_script,
                           run_scripts, spec_acceptance)
from shared_engines import ECHO, ECHO_MTP, MTP, declare

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

PROMPT_LENGTHS = [3, 17, 40]
MAX_TOKENS = 32
TOP_TOKENS = {**MTP, "use_local_argmax_reduction": True}
JOB = {"prompts": random_prompts(PROMPT_LENGTHS, seed=5), "max_tokens": MAX_TOKENS, "prompt_logprobs": False}
PLAIN, WHOLE_HEAD = declare(ECHO, "draft-vocab", **JOB), declare(ECHO_MTP, "draft-vocab", **JOB)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_engine):
    """The plain and the MTP engine (shared), and the MTP engine asking for top tokens with each vocabulary file,
    in the MTP engine's settings."""
    tmp = tmp_path_factory.mktemp("draft-vocab")
    out = {"plain": shared_engine(PLAIN), "mtp": shared_engine(WHOLE_HEAD)}
    base = {**ECHO_MTP.spec(), **JOB, "speculative_config": TOP_TOKENS, "log_lines": True}
    vocab_size = json.loads((Path(base["model"]) / "config.json").read_text())["vocab_size"]
    generated = {t for o in out["plain"]["outputs"] for t in o["token_ids"]}
    files = {"all": draft_vocab_file(tmp, "all", list(range(vocab_size))),
             "rest": draft_vocab_file(tmp, "rest", [i for i in range(vocab_size) if i not in generated])}
    runs = run_scripts([("engine_runner.py", base, name) for name in files], tmp, CPU_ENGINE_ENV,  # at once
                       envs=[{"VLLM_LING_DRAFT_VOCAB": path} for path in files.values()])
    return out | dict(zip(files, runs))


@pytest.mark.parametrize("name", ["all", "rest"])
def test_output_is_plain_greedy_whatever_the_vocabulary(runs, name):
    for n, a, b in zip(PROMPT_LENGTHS, runs["plain"]["outputs"], runs[name]["outputs"]):
        first = first_difference(a["token_ids"], b["token_ids"])
        assert first is None, f"vocabulary {name}: the {n}-token prompt's output differs from new token {first}"


def test_the_whole_vocabulary_drafts_what_the_whole_head_drafts(runs):
    from ling_tools.selfcheck import Requested, inspect_log

    vocab = {v.name: v for v in inspect_log("\n".join(runs["all"]["log_lines"]), Requested(draft_vocab=True))}
    assert vocab["Draft vocab"].on, vocab["Draft vocab"].line()  # the self-check reads the engine's own line
    assert runs["mtp"]["spec_decode"]["num_drafts"] > 0
    assert runs["all"]["spec_decode"] == runs["mtp"]["spec_decode"]  # draft for draft, accepted for accepted
    assert spec_acceptance(runs["mtp"]) >= 0.8


def test_a_vocabulary_without_the_generated_tokens_gets_no_draft_accepted(runs):
    assert runs["rest"]["spec_decode"]["num_drafts"] > 0
    assert spec_acceptance(runs["rest"]) == 0, runs["rest"]["spec_decode"]


def test_a_set_vocabulary_that_vllm_would_not_ask_for_refuses_to_start(tmp_path):
    from ling_tools.tiny import ensure_tiny

    spec = {"model": str(ensure_tiny(variant="mtp_echo")), "prompts": [[11, 12, 13]], "max_tokens": 4,
            "dtype": "float32", "max_model_len": 128, "prompt_logprobs": False, "speculative_config": MTP}
    env = {**CPU_ENGINE_ENV, "VLLM_LING_DRAFT_VOCAB": draft_vocab_file(tmp_path, "v", [1, 2, 3])}
    with pytest.raises(AssertionError, match="use_local_argmax_reduction"):
        run_script("engine_runner.py", spec, tmp_path, "refused", env)
