"""Diagnostic (not a test): vLLM's own scheduler, with no model, replaying DSpark prompts on a hybrid KDA target, to
see where prefix-cache hits land and how each prompt is cut into prefill passes.

vLLM's `AsyncScheduler` (or `Scheduler`, --sync) and its KV-cache manager run as the engine runs them: schedule,
a fake model output (prefill chunks short of the prompt sample nothing; verify steps of 1 + K accept a cycle of
ACCEPTED), update, draft tokens back. The KV groups are the target's MLA and KDA groups and the DSpark drafter's
128-token attention group; `cache_config.block_size` is what vLLM sets after the KV cache is planned, the smallest
prefix-cacheable group's block (v1/engine/core.py): the drafter's 128 with DSpark, --cache-block to change it.
Two workloads: the GPU prefix-cache step's agent chains (test_prefix_cache_gpu.py, `_chains` with its 128-token
lead; a 256-token KDA block, 512-token chunks), or with --agent a full-size session (a 1,920-token KDA block,
8,192-token chunks, ten turns from 18,012 tokens, each adding 2,300). Prints JSON: per prompt its length, the hit
and the prefill passes' token counts.

vLLM 0.34's or 0.33's Python source runs it on a CPU (no compiled ops); the engine's platform check is skipped.
With vllm-0.34.0/ the release's sdist from PyPI, unpacked (docs/vllm-seams.md §New releases says what to look for):
    VLLM_TARGET_DEVICE=cpu PYTHONPATH=vllm-0.34.0 python3 tests/gpu/replay_mamba_hits.py [--checkpoints 0|1]
        [--k 4] [--cache-block 128|256] [--sync] [--agent]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections import deque
from pathlib import Path
from types import SimpleNamespace

HASH, DRAFT_BLOCK = 128, 128
ACCEPTED = (4, 1, 3, 0, 2)  # draft tokens accepted per verify step, cycled (capped at K)
CHAINS = {"kda_block": 256, "chunk": 512, "max_model_len": 2048}
AGENT = {"kda_block": 1920, "chunk": 8192, "max_model_len": 65536, "first": 18012, "add": 2300, "turns": 10}


class DSparkSpec(SimpleNamespace):
    """What vLLM's config and scheduler read of an anchor-sampling DSpark `SpeculativeConfig` (vllm/config/
    speculative.py; 0.34 asks its `speculator_config`, 0.33 the methods): a drafter on the target's hidden states that
    needs no trailing-block drop, reserves K lookahead slots and reads one prefill lookahead token."""

    def use_eagle_block_drop(self) -> bool:
        return False

    def needs_eagle_block_drop(self) -> bool:
        return False

    def use_dspark(self) -> bool:
        return True

    def use_eagle(self) -> bool:
        return True

    def use_dflash(self) -> bool:
        return False

    def uses_draft_model(self) -> bool:
        return False

    def use_multi_module_mtp(self) -> bool:
        return False


def _tiny_model() -> str:
    """A hybrid model's config for vLLM's ModelConfig (only its config is read: no weights are loaded)."""
    from ling_tools.tiny import ensure_tiny

    return str(ensure_tiny(variant="stable_router"))


def scheduler(geometry: dict, checkpoints: bool, k: int, cache_block: int, asynchronous: bool):
    import torch
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.layers.mamba.kda_checkpoint import kda_prefill_checkpoint_alignment
    from vllm.platforms import current_platform
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.structured_output import StructuredOutputManager

    current_platform.__class__.check_and_update_config = classmethod(lambda cls, config: None)  # no engine here
    length = geometry["max_model_len"]
    model = ModelConfig(model=_tiny_model(), dtype="bfloat16", seed=0, max_model_len=length)
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=geometry["chunk"], max_model_len=length,
                            enable_chunked_prefill=True, async_scheduling=asynchronous, is_encoder_decoder=False)
    cache = CacheConfig(block_size=cache_block, enable_prefix_caching=True, mamba_cache_mode="align")
    config = VllmConfig(scheduler_config=sched, model_config=model, cache_config=cache,
                        parallel_config=ParallelConfig())
    spec = DSparkSpec(method="dspark", num_speculative_tokens=k, num_speculative_tokens_per_batch_size=None,
                      uses_target_hidden_states=True, disable_eagle_block_drop=False,
                      disable_lookahead_block_hashes=False, max_num_new_slots_for_drafting=0,
                      draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(sample_from_anchor=True)),
                      speculator_config=SimpleNamespace(num_prefill_lookahead_tokens=1, num_lookahead_tokens=k))
    object.__setattr__(config, "speculative_config", spec)
    attention = dict(num_kv_heads=1, head_size=1, dtype=torch.float32)
    block = geometry["kda_block"]
    kda = MambaSpec(block_size=block, shapes=(1, 1), dtypes=(torch.float32,), mamba_cache_mode="align",
                    num_speculative_blocks=k, num_prefill_checkpoint_blocks=int(checkpoints),
                    prefill_checkpoint_alignment=kda_prefill_checkpoint_alignment("flashkda") if checkpoints
                    else None)  # FlashKDA's grid, as our KDA layers declare it (vllm_ling/compat.py)
    groups = [KVCacheGroupSpec(["mla"], FullAttentionSpec(block_size=block, **attention)),
              KVCacheGroupSpec(["kda"], kda),
              KVCacheGroupSpec(["draft"], FullAttentionSpec(block_size=DRAFT_BLOCK, **attention))]
    blocks = 4 * length // DRAFT_BLOCK
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                       prefix_cache_retention_interval=0)  # vLLM's default: sparse retention
    cache.num_gpu_blocks = blocks
    init_none_hash(sha256)
    cls = AsyncScheduler if asynchronous else Scheduler
    return cls(vllm_config=config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(config),
               block_size=block, hash_block_size=HASH, log_stats=True)


def serve(sched, name: str, tokens: list[int], k: int, max_tokens: int) -> dict:
    """One request to its end, steps kept in flight as the engine keeps them (two with async scheduling)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    params.update_from_generation_config({}, eos_token_id=None)
    request = Request(request_id=name, prompt_token_ids=tokens, sampling_params=params, pooling_params=None,
                      block_hasher=get_request_block_hasher(HASH, sha256, 0))
    sched.add_request(request)
    rng, steps, hit, passes = random.Random(name), deque(), None, []
    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {"req_id_to_index": {name: 0}} if "req_id_to_index" in fields else {}  # vLLM 0.33 asks for it
    depth = 2 if sched.scheduler_config.async_scheduling else 1
    step = 0
    while True:
        while len(steps) < depth and (out := sched.schedule()).num_scheduled_tokens:
            steps.append(out)
        if not steps:
            break
        out = steps.popleft()
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        starts.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
        hit = starts[name] if hit is None else hit
        drafts = out.scheduled_spec_decode_tokens.get(name, [])
        count = out.num_scheduled_tokens[name]
        if starts[name] < len(tokens):
            passes.append(count)
        if starts[name] + count - len(drafts) < len(tokens):
            sampled = []  # a prefill chunk short of the prompt's end samples nothing
        else:
            sampled = [rng.randrange(1000, 2000) for _ in range(1 + min(ACCEPTED[step % len(ACCEPTED)], len(drafts)))]
        step += 1
        sched.update_from_output(out, ModelRunnerOutput(req_ids=[name], sampled_token_ids=[sampled], logprobs=None,
                                                        prompt_logprobs_dict={}, pooler_output=[], **index))
        if name in sched.requests:
            sched.update_draft_token_ids(DraftTokenIds([name], [[rng.randrange(1000, 2000) for _ in range(k)]]))
    return {"tokens": len(tokens), "hit": hit, "passes": passes}


def replay(checkpoints: bool, k: int, cache_block: int, asynchronous: bool, agent: bool) -> dict:
    sched = scheduler(AGENT if agent else CHAINS, checkpoints, k, cache_block, asynchronous)
    if agent:
        rng = random.Random(3)
        prompt = [rng.randrange(3, 30000) for _ in range(AGENT["first"])]
        turns = {}
        for turn in range(1, AGENT["turns"] + 1):
            turns[f"t{turn}"] = serve(sched, f"t{turn}", prompt, k, 200)
            prompt = prompt + [rng.randrange(3, 30000) for _ in range(AGENT["add"])]
        return turns
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from test_prefix_cache_engine import _chains  # the GPU step's prompts, by the same function

    turns = {}
    for chain, (t1, t2, t3) in _chains(CHAINS["kda_block"], lead=CHAINS["kda_block"] // 2).items():
        for turn, tokens in (("t1", t1), ("t2", t2), ("t3", t3)):
            turns[f"{chain}:{turn}"] = serve(sched, f"{chain}:{turn}", tokens, k, 16)
        sched.reset_prefix_cache()
        for turn, tokens in (("f2", t2), ("f3", t3)):
            turns[f"{chain}:{turn}"] = serve(sched, f"{chain}:{turn}", tokens, k, 16)
        sched.reset_prefix_cache()
    return turns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoints", type=int, choices=(0, 1), default=1, help="in-prefill KDA checkpoints")
    ap.add_argument("--k", type=int, default=4, help="draft tokens (the KDA group's speculative blocks)")
    ap.add_argument("--cache-block", type=int, default=DRAFT_BLOCK,
                    help="cache_config.block_size (vLLM sets the drafter's 128 with DSpark)")
    ap.add_argument("--sync", action="store_true", help="the synchronous Scheduler instead of AsyncScheduler")
    ap.add_argument("--agent", action="store_true", help="the full-size agent session instead of the GPU chains")
    a = ap.parse_args()
    import vllm

    turns = replay(bool(a.checkpoints), a.k, a.cache_block, not a.sync, a.agent)
    print(json.dumps({"vllm": vllm.__version__, "checkpoints": a.checkpoints, "k": a.k, "cache_block": a.cache_block,
                      "async": not a.sync, "workload": "agent" if a.agent else "chains", "turns": turns}))


if __name__ == "__main__":
    main()
