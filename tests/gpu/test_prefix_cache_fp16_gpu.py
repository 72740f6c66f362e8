"""Prefix-cache resumes from inside a KV block on a GPU, in fp16, where a wrong one stands out from the rounding.

A DSpark drafter's 128-token KV block, or `--prefix-match-unit`, makes vLLM resume a cached prompt from inside a KV
block (a partial hit). vLLM 0.32's own copy of that block got every such resume wrong on the CPU engine (vllm-ling
carries 0.34's copy, FINDINGS.md §10), by amounts bf16 hides: in bf16, test_prefix_cache_gpu.py holds a resume to its
uncached run only within 0.5 nats. fp16 keeps three more mantissa bits. On the CPU engine in fp16, on these agent
turns (`python3 tests/model/partial_hit_size.py stable_router default --dtype float16 [--copy ours]`), right resumes
stay within 0.004-0.012 nats of their uncached runs and never part from them; with vLLM 0.32's copy, 3 of the 6
resumed turns (stable_router) and 4 (default) move by 0.034-0.070 nats or part from theirs away from a tie: FP16_DRIFT
(0.03) lies between, and one such turn fails the test. So three engines serve the agent turns in fp16 on
`stable_router`, side by side, eager: at `--prefix-match-unit 16`, the same with the MLA layers silenced (the KDA
state's side), and with DSpark (K=4, a random drafter) at its own 128-token grain. FlashKDA takes bf16 only, so their
KDA prefills run on Triton chunk_kda and write no in-prefill checkpoints. Each resumed turn is held to its uncached
run in the same engine (`criteria.fp16_parting`), and the fp32 oracle checks the instrument: every uncached run within
FP16_MARGIN of it on its own tokens (the cached runs' distances are recorded too).
Run on the device: bash tests/gpu/run_on_device.sh prefix_cache_fp16
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import FP16_MARGIN, fp16_parting, parting  # noqa: E402
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
# on sys.path via gpu_helpers
from model_helpers import run_script, run_scripts  # noqa: E402
from test_prefix_cache_engine import (  # noqa: E402
    PARTIAL_GRAIN, _chain_pairs, _chain_rounds, _resumed, _round, _without_attention,
)
from test_prefix_cache_gpu import (  # noqa: E402
    CHAIN_VARIANT, KV_BYTES, _base, _dspark, _dspark_lead,
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
    for name in engines:  # recorded beside the verdicts: each resume against its reference inside the same engine
        result[name]["parting"] = {round_name: dict(zip(("first", "drift"), parting(got, want)))
                                   for round_name, got, want in _resumed(result[name])}
    record("prefix_cache_fp16", result)
    return result


def _judge_by_the_oracle(specs: dict[str, dict], result: dict, tmp) -> None:
    """Each engine's chain rounds (`specs`: name -> spec) scored by the fp32 oracle on the GPU, as `oracle_error`
    (`_oracle_errors`) in its `result`."""
    chained = {name: _chain_outputs(spec, result[name]) for name, spec in specs.items()}
    scored = run_scripts([("oracle.py", {"model": specs[name]["model"], "prompts": [], "device": "cuda",
                                         "score": [prompt + out["token_ids"] for prompt, out in outputs]},
                           f"{name}-oracle") for name, outputs in chained.items()], tmp)
    for (name, outputs), oracle in zip(chained.items(), scored):
        result[name]["oracle_error"] = _oracle_errors(outputs, oracle["scored"])


def _chain_outputs(spec: dict, result: dict) -> list[tuple[list[int], dict]]:
    """(prompt, output) of each resumed chain round and of its reference, in `_chain_pairs` order."""
    prompts = {r["name"]: r["prompts"][0] for r in spec["rounds"]}
    return [(prompts[name], _round(result, name)["outputs"][0]) for pair in _chain_pairs() for name in pair]


def _oracle_errors(outputs: list[tuple[list[int], dict]], scored: list[dict]) -> dict[str, dict[str, float]]:
    """Per resumed round, the largest |engine logprob - fp32 oracle logprob| over its continuation's tokens, the
    oracle teacher-forced on the engine's own tokens (`scored`, one per `_chain_outputs` entry), for the resumed run
    and its uncached reference."""
    worst = [max(abs(a - ref["logprobs"][len(prompt) + i]) for i, a in enumerate(out["logprobs"]))
             for (prompt, out), ref in zip(outputs, scored, strict=True)]
    return {name: {"cached": worst[2 * k], "reference": worst[2 * k + 1]}
            for k, (name, _) in enumerate(_chain_pairs())}


@pytest.mark.parametrize("engine", JUDGED)
def test_the_turns_resume_from_inside_a_block(runs, engine):
    """Else the judging below says nothing about partial hits: at least one resume lands inside a KV block."""
    hits = {name: _round(runs[engine], name)["hits"] for name, _, _ in _resumed(runs[engine])}
    assert any(h % runs["block"] for h in hits.values()), f"{engine}: every hit on a whole block: {hits}"


@pytest.mark.parametrize("engine", JUDGED)
def test_the_uncached_runs_stand_with_the_fp32_oracle(runs, engine):
    """The instrument: fp16 serving of this checkpoint is sound where no cache is involved. Each uncached reference
    within FP16_MARGIN of the fp32 oracle on its own tokens."""
    errors = runs[engine]["oracle_error"]
    off = {name: e["reference"] for name, e in errors.items() if e["reference"] > FP16_MARGIN}
    assert not off, f"{engine}: uncached fp16 runs off the fp32 oracle beyond {FP16_MARGIN} nats: {off} ({errors})"


@pytest.mark.parametrize("engine", JUDGED)
def test_resumes_inside_a_block_equal_the_uncached_run(runs, engine):
    """Each resumed turn's greedy tokens those of its uncached run, its logprobs within FP16_DRIFT (a parting only at a
    tie that close). Failing means this GPU serves a resume from inside a block from a wrong context: at
    `--prefix-match-unit 16` (`partial`) the whole model's, with the MLA layers silenced (`kda_only`) the KDA
    state's, with DSpark (`dspark`) the recipe's own, which serves DSpark with the prefix cache on this test's pass on
    vLLM 0.33 and 0.34 (docs/dspark.md §Prefix cache), as the preflight passes partial hits (rule
    partial_prefix_hits)."""
    parted = {name: why for name, got, want in _resumed(runs[engine]) if (why := fp16_parting(got, want))}
    assert not parted, f"{engine}: resumes off their uncached runs: {parted} (partings {runs[engine]['parting']})"
