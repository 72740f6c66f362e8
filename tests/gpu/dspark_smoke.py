"""Diagnostic (not a test): one DSpark engine in about a minute, before the 18 engines of test_dspark_gpu.py.

The `mtp_echo` tiny target with the agreeing tiny drafter, eager (no compile, no graph capture), greedy: does the
engine plan its cache, draft, verify and accept? Prints and writes the acceptance, the first tokens and the
engine's start-up and first-generate seconds. Greedy equality with plain decoding is test_dspark_gpu.py's.
`--graphs`: torch.compile and CUDA graphs, as served (vLLM's adaptive verification requires full CUDA graphs and
refuses `--adaptive` without them); `--dir`: where the drafter and the engine's log go (kept).

    python3 tests/gpu/dspark_smoke.py OUT.json [--k K] [--adaptive] [--graphs] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from gpu_helpers import GPU_ENV  # puts tests/model on sys.path; needs CUDA
from model_helpers import NO_CLAMPS, random_prompts, run_script, spec_acceptance


def main(out: str, k: int, adaptive: bool, graphs: bool, where: str | None) -> dict:
    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="dspark-smoke-", dir=where))
    target = ensure_tiny(variant="mtp_echo")
    draft = make_tiny_dspark(tmp / "draft", target, agree=True)
    spec = {"model": str(target), "prompts": random_prompts([3, 64], seed=13), "max_tokens": 32,
            "dtype": "bfloat16", "enforce_eager": not graphs, "max_model_len": 1024, "max_num_batched_tokens": 512,
            "prompt_logprobs": False, "hf_overrides": NO_CLAMPS, "gpu_memory_utilization": 0.3,
            "speculative_config": {"method": "dspark", "model": str(draft), "num_speculative_tokens": k,
                                   "attention_backend": "FLASH_ATTN", "enable_adaptive_verification": adaptive}}
    run = run_script("engine_runner.py", spec, tmp, "smoke", GPU_ENV)
    result = {"k": k, "adaptive": adaptive, "graphs": graphs, "acceptance": spec_acceptance(run),
              "counters": run["spec_decode"], "seconds": run.get("seconds"),
              "first_tokens": [o["token_ids"][:8] for o in run["outputs"]]}
    Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("out")
    cli.add_argument("--k", type=int, default=3)
    cli.add_argument("--adaptive", action="store_true")
    cli.add_argument("--graphs", action="store_true")
    cli.add_argument("--dir")
    a = cli.parse_args()
    print(json.dumps(main(a.out, a.k, a.adaptive, a.graphs, a.dir), indent=1))
