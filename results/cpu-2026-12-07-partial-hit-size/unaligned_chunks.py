# Diagnostic kept with its output (run from the repository root): python3 results/cpu-2026-12-07-partial-hit-size/unaligned_chunks.py
import json, sys
sys.path[:0] = ["tests/model"]
from pathlib import Path
from model_helpers import CPU_ENGINE_ENV, run_scripts, first_difference, max_abs_diff
from ling_tools.tiny import ensure_tiny
from test_prefix_cache_engine import _spec, _chains
model = str(ensure_tiny(variant="stable_router"))
prompts = [t for turns in _chains().values() for t in turns]
rounds = [{"name": "all", "prompts": prompts}]
specs = []
for chunk in (256, 200, 72):
    s = _spec(model, rounds); s.update(prefix_caching=False, max_num_batched_tokens=chunk, max_num_seqs=1)
    specs.append(("engine_runner.py", s, f"chunk{chunk}"))
tmp = Path("/tmp/cow/chunk"); tmp.mkdir(parents=True, exist_ok=True)
outs = run_scripts(specs, tmp, CPU_ENGINE_ENV)
ref = outs[0]["rounds"][0]["outputs"]
for (_, _, name), out in zip(specs[1:], outs[1:]):
    got = out["rounds"][0]["outputs"]
    print(name, [(len(p), first_difference(g["token_ids"], r["token_ids"]), round(max_abs_diff(g["logprobs"], r["logprobs"]), 6)) for p, g, r in zip(prompts, got, ref)])
