"""vLLM's prefix cache on the hybrid model on a GPU (CUDA kernels, bf16, CUDA graphs), with MTP too.

The GPU twin of tests/model/test_prefix_cache_engine.py, with its cases (shared prefixes ending on a block boundary, one
token past it, mid-block, inside a longer prompt, evicted; two concurrent sequences resuming from one checkpoint), sized
in the block this engine picks: a short probe engine reads the block size first. Three engines then run side by side,
all with prefix caching on: the tiny checkpoint (a pool of POOL_BLOCKS blocks, so the flood evicts); `mtp_echo` with MTP
k=1, where vLLM #54360 reports hits silently disabled for hybrid models: here every boundary case must hit, with
speculation on; and `mtp_echo` with DSpark K=4 and the agreeing tiny drafter, whose own KV lives in a block of its own
(docs/dspark.md §KV block) and whose hits vLLM keeps whole (a DSpark drafter's KV at a position comes from the target's
hidden state alone, so no trailing block is dropped) and, the drafter's block being smaller, at the finer grain vLLM
0.34 then hashes at (`_hit_grain`). That grain gives hits inside a KDA block (partial hits): three agent turns, each
resuming from inside a block, run on it and on a fourth engine, DSpark again with a target whose every layer counts
(below) and a drafter that mostly misses, so that a wrong state shows and verification rejects. A fifth engine asks for
partial hits with `--prefix-match-unit` at a 16-token grain, which vLLM 0.32/0.33's own copy of the block served wrong
on the CPU engine (FINDINGS.md §10); a sixth runs those turns with the MLA layers silenced (the KDA state's side). A
seventh serves the plain engine's rounds with in-prefill KDA checkpoints written by FlashKDA
(VLLM_LING_KDA_PREFILL_CHECKPOINT=1, the default); the MTP and both DSpark engines ask for them too, and the plugin
declares none with DSpark (vllm_ling/kda.py: with them vLLM lost the prompt's last hashed position), which the DSpark
engines' hits check; the plain, partial-hit and KDA-only engines set it to 0. Cached vs uncached (the same target after
`reset_prefix_cache()` in the same engine), in bf16: greedy tokens equal up to the first place they part, and that place
must be a near-tie (the two chosen tokens' logprobs within DECIDED nats) while the logprobs before it agree within
BF16_FLIP_MAX_MARGIN; a sequence resuming from a wrong checkpoint fails both at once; the agent turns' partings may
stand BF16_FLIP_MAX_MARGIN apart (`criteria.bf16_chain_parting`: a right DSpark resume parted 0.30 nats off on an H100).
The agent turns run on the `stable_router` checkpoint (or on `mtp_echo`): the default one's routing flips under bf16
rounding: on these ~800-token chains bf16 moves a logprob from fp32's by p99 2.7 nats there, 0.18 on `stable_router`
(`python3 tests/gpu/bf16_floor.py --chains --variant V`); right resumes of the agent turns on `stable_router` served in
bf16 by the CPU engine move by 0.002-0.11 nats from their uncached runs and part only at ties (`python3
tests/model/partial_hit_size.py stable_router --dtype bfloat16 --copy ours`, with `--silence mla` 0.05-0.10). What these
bounds cannot see: the CPU engine's wrong resumes (vLLM's own copy) part from the uncached run by only 0.02-0.12 nats on
`stable_router` and 0.002 on `mtp_echo` in fp32, under bf16's noise here, so a pass says a GPU makes no gross error, not
that it is right; tests/gpu/test_prefix_cache_fp16_gpu.py judges those resumes.
Run on the device: LING_GPU_RESULTS=$OUT python -m pytest tests/gpu/test_prefix_cache_gpu.py -q
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import bf16_chain_parting, bf16_parting  # noqa: E402
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
# on sys.path via gpu_helpers
from model_helpers import NO_CLAMPS, run_script, run_scripts  # noqa: E402
from test_prefix_cache_engine import (  # noqa: E402
    CHECKPOINT_ENV, MAX_TOKENS, MTP, PARTIAL_GRAIN, _cases, _chain_rounds, _concurrent,
    _distinct_references, _resumed, _round, _rounds, _tail_hits, _without_attention,
)

POOL_BLOCKS = 48
BOUNDARY_CASES = ("boundary", "boundary_plus_one", "mid_block")
# side by side on one GPU: each engine sizes its own KV cache (vLLM's profiling would count the others' memory, and
# asserts when another engine frees memory while it profiles; a fixed cache size skips that check)
KV_BYTES = {"kv_cache_memory_bytes": 1 << 30}
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.15, "engine_kwargs": KV_BYTES}


# the checkpoint of the agent turns' engines: its routing stays put under bf16 rounding (bf16_floor.py --chains)
CHAIN_VARIANT = "stable_router"


def _dspark(drafter: Path) -> dict:
    return {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 4, "attention_backend": "FLASH_ATTN"}


def _dspark_lead(block: int) -> int:
    """Half a block more in the DSpark chains' first turn: its hits come at the drafter's 128-token grain, which at
    the probe's 256-token block lands every chain prompt's hit on a whole block without it (seen on an H200)."""
    return block // 2


def _base(model: str, rounds: list[dict], block: int) -> dict:
    return {"model": model, "prefix_caching": True, "dtype": "bfloat16", "enforce_eager": False,
            "max_model_len": max(2048, 8 * block), "max_num_batched_tokens": max(512, 2 * block), "max_num_seqs": 4,
            "max_tokens": MAX_TOKENS, "hf_overrides": NO_CLAMPS, "rounds": rounds, **SIDE_BY_SIDE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    tmp = tmp_path_factory.mktemp("prefix-cache-gpu")
    tiny, echo = str(ensure_tiny(seed=0)), str(ensure_tiny(variant="mtp_echo"))
    stable = str(ensure_tiny(variant=CHAIN_VARIANT))
    probe = run_script("engine_runner.py", {**_base(tiny, [{"name": "probe", "prompts": [[11, 12, 13]]}], 16),
                                            "enforce_eager": True}, tmp, "probe", GPU_ENV)
    block = probe["block_size"]
    flood = (POOL_BLOCKS // 3 + 2, 3 * block)  # more blocks than the pool holds, three blocks a prompt
    plain = {**_base(tiny, _rounds(block, flood), block),
             "engine_kwargs": {**KV_BYTES, "num_gpu_blocks_override": POOL_BLOCKS}}
    mtp = {**_base(echo, _rounds(block, (0, 0)), block), "speculative_config": MTP}
    dspark = {**_base(echo, _rounds(block, (0, 0)) + _chain_rounds(block, _dspark_lead(block)), block),
              "speculative_config": _dspark(make_tiny_dspark(tmp / "drafter", echo, agree=True))}
    dspark_turns = {**_base(stable, _chain_rounds(block, _dspark_lead(block)), block),
                    "speculative_config": _dspark(make_tiny_dspark(tmp / "drafter-random", stable))}
    partial = {**_base(stable, _chain_rounds(block), block),
               "engine_kwargs": {**KV_BYTES, "prefix_match_unit": PARTIAL_GRAIN}}
    kda_only = {**partial, "model": str(_without_attention(Path(stable), tmp / "kda-only"))}
    # the DSpark engines ask for in-prefill checkpoints and the plugin declares none for them: with them vLLM lost
    # these turns' hits at the prompt's last hashed position (FINDINGS.md §Prefix cache on the GPU)
    engines = {"plain": (plain, "0"), "mtp": (mtp, "1"), "dspark": (dspark, "1"), "dspark_turns": (dspark_turns, "1"),
               "partial": (partial, "0"), "kda_only": (kda_only, "0"), "checkpoints": (plain, "1")}
    outs = run_scripts([("engine_runner.py", spec, name) for name, (spec, _) in engines.items()], tmp, GPU_ENV,
                       envs=[{CHECKPOINT_ENV: on} for _, on in engines.values()])
    result = {"block": block, "flood": flood, **dict(zip(engines, outs))}
    record("prefix_cache", result)
    return result


DSPARK_TURNS = ("dspark", "dspark_turns")


def _assert_bf16_same(name: str, got: dict, want: dict) -> None:
    why = bf16_parting(got, want)
    assert why is None, f"{name}: {why}"


def _chain_partings(result: dict, block: int) -> tuple[dict[str, int], dict[str, str | None]]:
    """Per chain round resumed from a cached state: its hits, and how it parts from its uncached reference."""
    resumed = _resumed(result)
    hits = {name: _round(result, name)["hits"] for name, _, _ in resumed}
    assert any(h % block for h in hits.values()), f"every hit on a whole block, no partial hit ran: {hits}"
    return hits, {name: bf16_chain_parting(got, want) for name, got, want in resumed}


ENGINES = ["plain", "mtp", "dspark"]


def _hit_grain(result: dict) -> int:
    """Tokens prefix-cache hits are whole multiples of: the engine's `cache_config.block_size` after start-up.
    vLLM 0.34 sets it to the smallest prefix-cacheable group's block and, with several groups, hashes prompts at the
    greatest common divisor of their blocks; an aligned KDA state then serves a hit inside its own block (0.34
    `partial_hash_hits_enabled`, v1/core/kv_cache_utils.py). With DSpark that is the drafter's 128 (docs/dspark.md
    §KV block); without a drafter, or with MTP, every group has the attention block."""
    return result["block_size"]


@pytest.mark.parametrize("engine", ENGINES)
def test_align_mode_serves(runs, engine):
    """Align mode, at the probe's block or, with DSpark's smaller drafter block, a grain dividing it."""
    grain = _hit_grain(runs[engine])
    assert runs[engine]["mamba_cache_mode"].endswith("align") and runs["block"] % grain == 0, (engine, grain)
    assert engine == "dspark" or grain == runs["block"], (engine, grain)


@pytest.mark.parametrize("engine", ENGINES)
def test_references_ran_on_an_empty_cache(runs, engine):
    for r in runs[engine]["rounds"]:
        if r["name"].startswith(("ref:", "warm:")):
            assert r["queries"] > 0 and r["hits"] == 0, f"{engine} {r['name']}: {r['hits']} hits"


@pytest.mark.parametrize("engine", ENGINES)
def test_cached_continuation_equals_uncached(runs, engine):
    result = runs[engine]
    for name in _cases(runs["block"]):
        _assert_bf16_same(f"{engine} {name}", _round(result, name)["outputs"][0],
                          _round(result, f"ref:{name}")["outputs"][0])
    for i, got in enumerate(_round(result, "concurrent")["outputs"]):
        _assert_bf16_same(f"{engine} concurrent{i}", got, _round(result, f"ref:concurrent{i}")["outputs"][0])


def _expected_hits(engine: str, shared: int, block: int) -> int:
    """Tokens a target sharing `shared` tokens with a warm prompt hits, in an engine whose hits come in whole
    `block`s (`_hit_grain`): the KDA state checkpointed at the last such boundary inside the shared part. With MTP, a
    prefix that ends exactly on that boundary hits nothing: the MTP layer's KV at a block's last position was computed
    from the warm prompt's next token, so vLLM drops the last matched block for a drafter (`drop_eagle_block`,
    v1/core/single_type_kv_cache_manager.py), and in align mode no state is kept at the boundary before. One more shared
    token and the hit is whole again."""
    return 0 if engine == "mtp" and shared % block == 0 else shared // block * block


@pytest.mark.parametrize("engine", ENGINES)
def test_prefixes_hit_at_block_boundaries_with_mtp_too(runs, engine):
    """#54360: with the MTP drafter on, hits still happen: as many as without it, but where the shared prefix ends
    exactly on a block boundary (`_expected_hits`); with DSpark's, as many as without it everywhere."""
    block, cases, grain = runs["block"], _cases(runs["block"]), _hit_grain(runs[engine])
    for name in BOUNDARY_CASES:
        hits, want = _round(runs[engine], name)["hits"], _expected_hits(engine, cases[name][2], grain)
        assert hits == want, f"{engine} {name}: {hits} prefix-cache hits, not {want}"
    concurrent = [o["cached_tokens"] for o in _round(runs[engine], "concurrent")["outputs"]]
    assert len(_concurrent(block)) == 3  # a warm prompt and two targets sharing its first two blocks exactly
    if engine != "mtp":
        assert concurrent == [2 * block] * 2
    else:  # exactly on the boundary: one block less at most (what the first target's own prefill checkpointed)
        assert all(c in (0, block) for c in concurrent), concurrent


@pytest.mark.parametrize("engine", ["mtp", *DSPARK_TURNS])
def test_the_drafter_drafts(runs, engine):
    assert runs[engine]["spec_decode"].get("num_drafts", 0) > 0, f"{engine} never drafted"


def test_an_evicted_prefix_is_recomputed(runs):
    plain, block = runs["plain"], runs["block"]
    count, tokens = runs["flood"]
    assert plain["num_blocks"] == POOL_BLOCKS and count * tokens > POOL_BLOCKS * block
    before, after = _round(plain, "cached:evicted")["hits"], _round(plain, "evicted")["hits"]
    assert before == 2 * block and after < before, (before, after)


@pytest.mark.parametrize("engine", DSPARK_TURNS)
def test_dsparks_agent_turns_resumed_inside_a_block_equal_the_uncached_run(runs, engine):
    """Three agent turns whose hits land inside a KV block at the DSpark drafter's 128-token grain (`_dspark_lead`):
    each turn resumes from the state the previous prompt left at its last hashed position, and its prefill then
    stays in that block (`same`) or crosses into the next (`next`). `dspark` drafts what its damped `mtp_echo` target
    says (the accept path); `dspark_turns` serves a target whose every layer counts with a random drafter (the
    reject path), with CUDA graphs. Passing rules out a gross error only (the module's note); the fp16 module
    judges DSpark's resumes (docs/dspark.md §Prefix cache)."""
    hits, parted = _chain_partings(runs[engine], runs["block"])
    assert not any(parted.values()), f"{engine} hits {hits}: {parted}"


@pytest.mark.parametrize("engine", DSPARK_TURNS)
def test_dsparks_agent_turns_hit_each_prompts_last_hashed_position(runs, engine):
    """Each resumed DSpark turn hits its predecessor's last 128-token position, not the KDA block boundary below it:
    the DSpark engines ask for in-prefill checkpoints (the default) and get none from the plugin, with which vLLM
    0.33/0.34 plans KDA checkpoints on the drafter's block that its KV manager refuses (on an H100, 0.34: 512 for
    640, 768 for 896; tests/gpu/replay_mamba_hits.py replays both)."""
    grain = _hit_grain(runs[engine])
    want = _tail_hits(grain, runs["block"], _dspark_lead(runs["block"]))
    got = {name: _round(runs[engine], name)["hits"] for name in want}
    assert got == want, f"{engine}: hits {got}, each prompt's last {grain}-token position {want}"


def test_partial_hits_at_a_fine_grain_continue_as_uncached(runs):
    """`--prefix-match-unit 16`, the same three agent turns: every resume differed from its uncached run on the CPU
    engine under vLLM 0.32's own copy of the partly filled block, which leaves its attention rows behind (FINDINGS.md
    §10); with vllm-ling's copy of every view none may part beyond bf16's rounding here. A gross-error check (the
    module's note); tests/gpu/test_prefix_cache_fp16_gpu.py judges these resumes, and on its pass the preflight lets
    the flag through on GPUs (rule partial_prefix_hits)."""
    hits, parted = _chain_partings(runs["partial"], runs["block"])
    assert not any(parted.values()), f"hits {hits}: {parted}"


def test_the_kda_state_resumes_inside_a_block(runs):
    """The same `--prefix-match-unit 16` turns on a copy of the checkpoint whose MLA layers add nothing (their
    output projection zeroed, as on the CPU engine): the sequence reaches the logits through the KDA state alone, so
    these resumes must equal the uncached run, as they do on the CPU engine. Failing puts an error on the KDA state
    (ours or vLLM's copy of it): vLLM ends a prefill pass at the hashed position inside the block to save the state
    there (`mamba_partial_cache_hit`, v1/core/sched/scheduler.py); in-prefill checkpoints leave that pass as it is
    (bit-identical resumes with and without them, FINDINGS.md §Prefix cache on the GPU)."""
    hits, parted = _chain_partings(runs["kda_only"], runs["block"])
    assert not any(parted.values()), f"hits {hits}: {parted}"
    assert _distinct_references(runs["kda_only"]) == 4, \
        "KDA alone continued different prompts identically: the check could not tell them apart"


def test_in_prefill_checkpoints_from_flashkda_keep_every_case(runs):
    """VLLM_LING_KDA_PREFILL_CHECKPOINT=1: FlashKDA writes the state at the last block boundary inside a prompt's
    final pass (the CPU engine's torch path does in tests/model/test_prefix_cache_engine.py, with a pass counted
    fewer). Every case and the concurrent pair continue as uncached, and every round hits what the plain engine's
    does; the recipe turns the setting on once this passes."""
    result, plain = runs["checkpoints"], runs["plain"]
    for name in _cases(runs["block"]):
        _assert_bf16_same(f"checkpoints {name}", _round(result, name)["outputs"][0],
                          _round(result, f"ref:{name}")["outputs"][0])
    for i, got in enumerate(_round(result, "concurrent")["outputs"]):
        _assert_bf16_same(f"checkpoints concurrent{i}", got, _round(result, f"ref:concurrent{i}")["outputs"][0])
    assert [r["hits"] for r in result["rounds"]] == [r["hits"] for r in plain["rounds"]]
