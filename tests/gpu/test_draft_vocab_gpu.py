"""A draft vocabulary on the GPU (vllm_ling/draft/vocab.py): CUDA graphs, the FP8 LM head, our small-M kernel
scoring the gathered FP8 rows, on vLLM >= 0.32 (speculative_config `use_local_argmax_reduction`).

Side by side on the `mtp_echo` checkpoint with `--quantization ling_fp8`, MTP k=1:
  head    the draft scores the whole FP8 head (CUTLASS W8A8, activations quantized per token)
  all     the draft vocabulary holds every id: its rows gathered from that head before capture, scored in fp32
          on bf16 activations. Not bit-equal to `head` (the activations are not quantized), so held to the
          acceptance bound the FP8 MTP test uses (3 points, or 3 standard errors where drafts are few)
  half    the vocabulary without the ids the `head` run generated most (the half of the vocabulary left): its drafts
          of those tokens cannot be accepted, so acceptance must fall well below `head`'s (the check can fail)
That the output stays the target's whatever the vocabulary is the CPU engine test's to show exactly (fp32,
tests/model/test_draft_vocab_engine.py): under FP8 on the GPU, MTP and plain already part at near-ties (the MTP
test judges them against the oracle), so here which requests match `head` is recorded, not asserted.
Run: pytest tests/gpu/test_draft_vocab_gpu.py -q
"""

from __future__ import annotations

import collections
import json

import pytest

pytest.importorskip("vllm")
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
from criteria import acceptance_slack  # noqa: E402
from model_helpers import (NO_CLAMPS, draft_vocab_file, first_difference, random_prompts, run_scripts,  # noqa: E402
                           spec_acceptance)

from vllm_ling import compat  # noqa: E402
from vllm_ling.draft.vocab import ENV  # noqa: E402

PROMPT_LENGTHS = [3, 17, 64, 130, 400]
MAX_TOKENS = 128
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.12, "engine_kwargs": {"kv_cache_memory_bytes": 2 << 30,
                                                                   "quantization": "ling_fp8"}}

if compat.draft_top_tokens_key() is None:
    pytest.skip("this vLLM cannot ask the draft for its top token", allow_module_level=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ling_tools.tiny import ensure_tiny

    tmp = tmp_path_factory.mktemp("draft-vocab-gpu")
    model = ensure_tiny(variant="mtp_echo")
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    base = {"model": str(model), "prompts": random_prompts(PROMPT_LENGTHS, seed=11),
            "max_tokens": MAX_TOKENS, "dtype": "bfloat16", "enforce_eager": False, "max_model_len": 1024,
            "max_num_batched_tokens": 512, "prompt_logprobs": False, "hf_overrides": NO_CLAMPS, "log_lines": True,
            **SIDE_BY_SIDE}
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    top = {**mtp, compat.draft_top_tokens_key(): True}
    head, = run_scripts([("engine_runner.py", {**base, "speculative_config": mtp}, "head")], tmp, GPU_ENV)
    counts = collections.Counter(t for o in head["outputs"] for t in o["token_ids"])
    frequent = {t for t, _ in counts.most_common(len(counts) // 2 + 1)}
    half = [i for i in range(vocab_size) if i not in frequent]
    jobs = [("engine_runner.py", {**base, "speculative_config": top}, "all"),
            ("engine_runner.py", {**base, "speculative_config": top}, "half")]
    envs = [{ENV: draft_vocab_file(tmp, "all", list(range(vocab_size)))}, {ENV: draft_vocab_file(tmp, "half", half)}]
    out = dict(zip(("all", "half"), run_scripts(jobs, tmp, GPU_ENV, envs)))
    out["head"] = head
    record("draft_vocab_gpu", {name: {"acceptance": spec_acceptance(r), "counters": r["spec_decode"],
                                      "identical_to_head": [first_difference(a["token_ids"], b["token_ids"]) is None
                                                            for a, b in zip(head["outputs"], r["outputs"])]}
                               for name, r in out.items()})
    return out


def test_the_vocabulary_is_bound_before_capture_and_serves(runs):
    for name in ("all", "half"):
        assert any("proposes among" in line for line in runs[name]["log_lines"]), runs[name]["log_lines"]
        assert runs[name]["spec_decode"].get("num_drafts", 0) > 0


def test_the_whole_vocabulary_is_accepted_as_often_as_the_whole_head(runs):
    head, whole = spec_acceptance(runs["head"]), spec_acceptance(runs["all"])
    assert head >= 0.8, f"the echo draft on the whole FP8 head was accepted only {head:.1%}"
    slack = acceptance_slack(head, runs["head"]["spec_decode"]["num_draft_tokens"],
                             whole, runs["all"]["spec_decode"]["num_draft_tokens"])
    assert abs(whole - head) <= slack, (whole, head, slack)


def test_a_vocabulary_without_the_frequent_tokens_loses_acceptance(runs):
    assert spec_acceptance(runs["half"]) < spec_acceptance(runs["head"]) - 0.2
