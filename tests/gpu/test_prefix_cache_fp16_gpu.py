"""Prefix-cache resumes from inside a KV block on a GPU, in fp16, where the fp32 oracle can judge them.

A DSpark drafter's 128-token KV block, or `--prefix-match-unit`, makes vLLM resume a cached prompt from inside a KV
block (a partial hit). vLLM 0.32's own copy of that block got every such resume wrong on the CPU engine, by 0.02-0.12
nats on the `stable_router` checkpoint (tests/model/partial_hit_size.py; vllm-ling carries 0.34's copy), and in bf16
test_prefix_cache_gpu.py cannot see errors that small: bf16 moves these agent turns' logprobs from fp32's by p99 0.18
nats there. fp16 keeps three more mantissa bits: p99 0.019, at most 0.020 (`python3 tests/gpu/bf16_floor.py --chains
--low float16`, transformers on the CPU). So three engines serve the agent turns in fp16 on `stable_router`, side by
side: at `--prefix-match-unit 16`, the same with the MLA layers silenced (the KDA state's side), and with DSpark (K=4,
a random drafter) at its own 128-token grain, eager. FlashKDA takes bf16 only, so their KDA prefills run on Triton
chunk_kda and write no in-prefill checkpoints. Each resumed turn and its uncached reference are then scored by the
fp32 oracle on their own tokens: a right resume stays within FP16_MARGIN of it, as its reference does; where a
reference does not, the engine's own fp16 error is too large to judge by and its test skips with the numbers.
Run on the device: bash tests/gpu/run_on_device.sh prefix_cache_fp16
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import FP16_MARGIN  # noqa: E402
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
# on sys.path via gpu_helpers
from model_helpers import run_script, run_scripts  # noqa: E402
from test_prefix_cache_engine import PARTIAL_GRAIN, _chain_rounds, _resumed, _round, _without_attention  # noqa: E402
from test_prefix_cache_gpu import (  # noqa: E402
    CHAIN_VARIANT, KV_BYTES, _assert_resumes_with_the_oracle, _base, _dspark, _dspark_lead, _judge_by_the_oracle,
)

DTYPE = "float16"
FP16_EAGER = {"dtype": DTYPE, "enforce_eager": True}
JUDGED = ("partial", "kda_only", "dspark")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    tmp = tmp_path_factory.mktemp("prefix-cache-fp16")
    stable = ensure_tiny(variant=CHAIN_VARIANT)
    probe = run_script("engine_runner.py", {**_base(str(stable), [{"name": "probe", "prompts": [[11, 12, 13]]}], 16),
                                            **FP16_EAGER}, tmp, "probe", GPU_ENV)
    block = probe["block_size"]
    # eager: the question is the state a resume starts from, which CUDA graphs do not change (test_prefix_cache_gpu.py
    # serves these turns with them); with graphs, three fresh fp16 engines outran 400 s on an H100 before a token
    partial = {**_base(str(stable), _chain_rounds(block), block), **FP16_EAGER,
               "engine_kwargs": {**KV_BYTES, "prefix_match_unit": PARTIAL_GRAIN}}
    engines = {
        "partial": partial,
        "kda_only": {**partial, "model": str(_without_attention(stable, tmp / "kda-only"))},
        "dspark": {**_base(str(stable), _chain_rounds(block, _dspark_lead(block)), block), **FP16_EAGER,
                   "speculative_config": _dspark(make_tiny_dspark(tmp / "drafter", stable))},
    }
    outs = run_scripts([("engine_runner.py", spec, name) for name, spec in engines.items()], tmp, GPU_ENV)
    result = {"block": block, "dtype": DTYPE, **dict(zip(engines, outs))}
    _judge_by_the_oracle(engines, result, tmp)
    record("prefix_cache_fp16", result)
    return result


@pytest.mark.parametrize("engine", JUDGED)
def test_the_turns_resume_from_inside_a_block(runs, engine):
    """Else the judging below says nothing about partial hits: at least one resume lands inside a KV block."""
    hits = {name: _round(runs[engine], name)["hits"] for name, _, _ in _resumed(runs[engine])}
    assert any(h % runs["block"] for h in hits.values()), f"{engine}: every hit on a whole block: {hits}"


@pytest.mark.parametrize("engine", JUDGED)
def test_resumes_inside_a_block_stay_with_the_fp32_oracle(runs, engine):
    """Each resumed turn within FP16_MARGIN of the fp32 oracle on its own tokens, where its uncached reference is.
    Failing means this GPU serves a resume from inside a block from a wrong context: at `--prefix-match-unit 16`
    (`partial`) the preflight's refusal stands; with the MLA layers silenced (`kda_only`) the KDA state is wrong; with
    DSpark the recipe's choice to serve it without the prefix cache stands (docs/dspark.md §Prefix cache). Passing for
    `dspark` is what it would take to serve DSpark with the cache."""
    _assert_resumes_with_the_oracle(engine, runs[engine]["oracle_error"], FP16_MARGIN)
