"""Diagnostic (not a test): one DSpark engine in about a minute, before the 18 engines of test_dspark_gpu.py.

The `mtp_echo` tiny target with the agreeing tiny drafter, eager (no compile, no graph capture), greedy: does the
engine plan its cache, draft, verify and accept? Prints and writes the acceptance, the first tokens and the
engine's start-up and first-generate seconds. Greedy equality with plain decoding is test_dspark_gpu.py's.

    python3 tests/gpu/dspark_smoke.py OUT.json [K] [--adaptive]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from gpu_helpers import GPU_ENV  # puts tests/model on sys.path; needs CUDA
from model_helpers import NO_CLAMPS, random_prompts, run_script, spec_acceptance


def main(out: str, k: int, adaptive: bool) -> dict:
    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    tmp = Path(tempfile.mkdtemp(prefix="dspark-smoke-"))
    target = ensure_tiny(variant="mtp_echo")
    draft = make_tiny_dspark(tmp / "draft", target, agree=True)
    spec = {"model": str(target), "prompts": random_prompts([3, 64], seed=13), "max_tokens": 32,
            "dtype": "bfloat16", "enforce_eager": True, "max_model_len": 1024, "max_num_batched_tokens": 512,
            "prompt_logprobs": False, "hf_overrides": NO_CLAMPS, "gpu_memory_utilization": 0.3,
            "speculative_config": {"method": "dspark", "model": str(draft), "num_speculative_tokens": k,
                                   "attention_backend": "FLASH_ATTN", "enable_adaptive_verification": adaptive}}
    run = run_script("engine_runner.py", spec, tmp, "smoke", GPU_ENV)
    result = {"k": k, "adaptive": adaptive, "acceptance": spec_acceptance(run), "counters": run["spec_decode"],
              "seconds": run.get("seconds"), "first_tokens": [o["token_ids"][:8] for o in run["outputs"]]}
    Path(out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--adaptive"]
    print(json.dumps(main(args[0], int(args[1]) if len(args) > 1 else 3, "--adaptive" in sys.argv), indent=1))
