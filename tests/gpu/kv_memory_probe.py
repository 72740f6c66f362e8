"""When does a vLLM engine take its KV cache's memory? The watchdog's memory guard reads free memory at start-up
and then watches for it falling, so memory committed *after* the engine reports ready would look like a leak.

vLLM 0.34 reserves the KV cache as virtual address space and commits its pages after warm-up (the extensible KV
cache, on by default on CUDA unless --kv-cache-memory-bytes is given). This probe samples the device's used memory
(nvidia-smi) before the engine, once it is ready, after one short request and after requests that fill many KV
blocks, with the extensible cache on and off, one fresh process each, so the two can be compared in one run.

    python3 tests/gpu/kv_memory_probe.py MODEL_DIR OUT.json [--util 0.5]

MODEL_DIR is a tiny checkpoint (python3 -m ling_tools.tiny DIR). Prints one line per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def probe(model: str, util: float, extensible: bool | None) -> dict:
    """One engine: used MiB at each stage. `extensible` None leaves vLLM's default."""
    from vllm import LLM, SamplingParams

    stages = {"before": used_mib()}
    kwargs = {} if extensible is None else {"enable_extensible_kv_cache": extensible}
    llm = LLM(model=model, gpu_memory_utilization=util, max_model_len=4096, enforce_eager=False,
              max_num_seqs=8, **kwargs)
    stages["ready"] = used_mib()
    llm.generate([[11, 12, 13]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    stages["one_request"] = used_mib()
    prompts = [[10 + (i * 7 + j) % 500 for j in range(3000)] for i in range(8)]
    llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    stages["eight_3k_prompts"] = used_mib()
    cache = llm.llm_engine.vllm_config.cache_config
    return {"stages_mib": stages, "extensible": getattr(cache, "enable_extensible_kv_cache", None),
            "util": util, "num_gpu_blocks": getattr(cache, "num_gpu_blocks", None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--util", type=float, default=0.5)
    ap.add_argument("--one", choices=["default", "on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a child: one engine in a fresh process
        ext = {"default": None, "on": True, "off": False}[args.one]
        print("RESULT " + json.dumps(probe(args.model, args.util, ext)), flush=True)
        return 0
    results = {}
    for mode in ("default", "off"):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        proc = subprocess.run([sys.executable, __file__, args.model, args.out, "--util", str(args.util),
                               "--one", mode], capture_output=True, text=True, env=env, timeout=400)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        results[mode] = json.loads(line[7:]) if line else {"error": proc.stderr[-2000:]}
        print(mode, json.dumps(results[mode]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"util": args.util, "runs": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
