"""Diagnostic (not a test): vLLM's own scheduler split and KV-cache manager replaying the prefix-cache step's DSpark
agent chains, with no model, to tell a hit the manager never registered from one the engine lost.

The GPU step (test_prefix_cache_gpu.py, `dspark` / `dspark_turns`) saw some turns hit the KDA block boundary below
their prompt's last hashed position. This replays the same prompts (tests/model/test_prefix_cache_engine.py
`_chains`, the 128-token lead) through `Scheduler._mamba_block_aligned_split` and `KVCacheManager` as vLLM's own
`tests/v1/core/prefix_cache` harness drives them: a 256-token KDA block, 128-token hashes (the drafter's block), a
512-token chunk, K speculative state blocks, a drafter attention group, sparse retention (vLLM's default 0), and
decode steps that verify 1 + K tokens. It prints each prompt's hit and prefill chunk ends as JSON.

vLLM's test harness ships in its sdist, not its wheel: put an unpacked sdist first on the path.
    pip download --no-deps --no-binary :all: vllm==0.34.0 && tar xzf vllm-0.34.0.tar.gz
    PYTHONPATH=vllm-0.34.0 python3 tests/gpu/replay_mamba_hits.py [--checkpoints 0|1] [--k 4] [--decode 16]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

BLOCK, HASH, CHUNK, DRAFT_BLOCK = 256, 128, 512, 128
ACCEPTED = (4, 1, 3, 0, 2)  # draft tokens accepted per verify step, cycled (capped at K)


def _chains() -> dict[str, list[list[int]]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from test_prefix_cache_engine import _chains as chains  # the GPU step's prompts, by the same function

    return chains(BLOCK, lead=BLOCK // 2)


def _manager(checkpoints: bool, k: int):
    import torch
    from tests.v1.core.test_prefix_caching import make_kv_cache_manager
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    init_none_hash(sha256)
    attention = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)
    kda = MambaSpec(block_size=BLOCK, shapes=(1, 1), dtypes=(torch.float32,), mamba_cache_mode="align",
                    num_speculative_blocks=k, num_prefill_checkpoint_blocks=int(checkpoints),
                    prefill_checkpoint_alignment=16 if checkpoints else None)  # FlashKDA's 16 (vllm_ling/kda.py)
    groups = [KVCacheGroupSpec(["mla"], FullAttentionSpec(block_size=BLOCK, **attention)),
              KVCacheGroupSpec(["kda"], kda),
              KVCacheGroupSpec(["draft"], FullAttentionSpec(block_size=DRAFT_BLOCK, **attention))]
    config = KVCacheConfig(num_blocks=400, kv_cache_tensors=[], kv_cache_groups=groups)
    return make_kv_cache_manager(kv_cache_config=config, max_model_len=8192, enable_caching=True,
                                 hash_block_size=HASH, use_eagle=False, retention_interval=0,
                                 num_prefill_lookahead=1)  # a hidden-state drafter reads the next token


def _scheduler(manager, checkpoints: bool) -> SimpleNamespace:
    """`self` for the real split, its gates derived as `Scheduler.__init__` derives them for DSpark (a hidden-state
    drafter: `use_eagle`, no trailing-block drop)."""
    partial = HASH < BLOCK and manager.coordinator.enable_partial_hash_hits
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK),
        scheduler_config=SimpleNamespace(long_prefill_token_threshold=0),
        max_num_scheduled_tokens=CHUNK, use_eagle=True, use_eagle_block_drop=False, num_hash_lookahead_tokens=0,
        hash_block_size=HASH, mamba_has_prefill_checkpoint_blocks=checkpoints,
        mamba_prefill_checkpoint_alignment=16 if checkpoints else None, mamba_partial_cache_hit=partial,
        mamba_shared_prefix_checkpoint=partial and manager.mamba_shared_prefix_checkpoint)


def _step(manager) -> None:
    _, retained = manager.take_kv_cache_block_copies()
    if retained:
        manager.block_pool.free_blocks(retained)
    manager.new_step_starts()


def _serve(manager, scheduler, name: str, tokens: list[int], k: int, decode: int) -> dict:
    """One request: its cache lookup, chunked prefill by the real split, `decode` verify steps, then its end."""
    from tests.v1.core.test_prefix_caching import make_request
    from vllm.utils.hashing import sha256
    from vllm.v1.core.sched.scheduler import Scheduler

    request = make_request(name, tokens, HASH, sha256)
    blocks, hit, _ = manager.get_computed_blocks(request)
    request.shared_prefix_boundary = 0
    ends, first = [], True
    while request.num_computed_tokens < request.num_tokens:
        local = hit if first else 0
        start = request.num_computed_tokens + local
        if start >= request.num_tokens:
            break
        count = Scheduler._mamba_block_aligned_split(scheduler, request, min(CHUNK, request.num_tokens - start),
                                                     local, 0)
        last = start + count >= request.num_tokens
        assert manager.allocate_slots(request, count, num_new_computed_tokens=local,
                                      new_computed_blocks=blocks if first else None,
                                      num_lookahead_tokens=k if last else 0, has_scheduled_reqs=False) is not None
        request.num_computed_tokens = start + count
        ends.append(request.num_computed_tokens)
        _step(manager)
        first = False
    rng = random.Random(name)
    request.append_output_token_ids([rng.randrange(1000, 2000)])  # the prefill step's sampled token
    for i in range(decode):  # verify the sampled token and k drafts, accept some, roll the rest back
        accepted = min(ACCEPTED[i % len(ACCEPTED)], k)
        count = request.num_tokens + k - request.num_computed_tokens
        assert manager.allocate_slots(request, count, num_lookahead_tokens=k) is not None
        request.num_computed_tokens += count - (k - accepted)
        request.append_output_token_ids([rng.randrange(1000, 2000) for _ in range(1 + accepted)])
        _step(manager)
    manager.free(request)
    _step(manager)
    return {"tokens": len(tokens), "hit": hit, "tail": (len(tokens) - 1) // HASH * HASH, "chunk_ends": ends}


def replay(checkpoints: bool, k: int, decode: int) -> dict:
    """The GPU step's rounds per chain: turns 1-3 as a session, then turn 2 fresh (cache reset) and turn 3."""
    out = {}
    for chain, (t1, t2, t3) in _chains().items():
        manager = _manager(checkpoints, k)
        scheduler = _scheduler(manager, checkpoints)
        for turn, tokens in (("t1", t1), ("t2", t2), ("t3", t3)):
            out[f"{chain}:{turn}"] = _serve(manager, scheduler, f"{chain}:{turn}", tokens, k, decode)
        manager.reset_prefix_cache()
        for turn, tokens in (("f2", t2), ("f3", t3)):
            out[f"{chain}:{turn}"] = _serve(manager, scheduler, f"{chain}:{turn}", tokens, k, decode)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, choices=(0, 1), default=1, help="in-prefill KDA checkpoints")
    ap.add_argument("--k", type=int, default=4, help="draft tokens (the Mamba group's speculative blocks)")
    ap.add_argument("--decode", type=int, default=16, help="verify steps after each prefill")
    a = ap.parse_args()
    import vllm

    print(json.dumps({"vllm": vllm.__version__, "checkpoints": a.checkpoints, "k": a.k,
                      "turns": replay(bool(a.checkpoints), a.k, a.decode)}, indent=1))


if __name__ == "__main__":
    main()
