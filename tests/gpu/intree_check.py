"""vLLM's in-tree Ling V3 on the tiny checkpoint, as installed and with our config class, against ours.

    python3 tests/gpu/intree_check.py OUT.json

transformers >= 5.20 resolves `model_type: bailing_hybrid` to its own BailingHybridConfig, which rewrites
`head_dim` to `qk_rope_head_dim` (64) and keeps the KDA head size as `linear_head_dim` (128). vLLM's in-tree
model reads `config.head_dim` for KDA, so as installed it builds KDA layers half the checkpoint's width: a real
checkpoint fails to load, and `load_format=dummy` runs a smaller model. With vllm-ling installed, our config
class keeps config.json's fields for whichever model serves. Three engines on the same prompts, greedy:
  bare:   VLLM_PLUGINS=none (vLLM as installed), expected to fail loading;
  intree: VLLM_LING_MODEL=vllm (vLLM's model, our config class);
  ours:   VLLM_LING_MODEL=vllm-ling.
Reports each engine's outcome, the KDA width it built, and where intree and ours part.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from criteria import model_prompts  # noqa: E402
from model_helpers import NO_CLAMPS, first_difference, run_script  # noqa: E402

ENGINES = {"bare": {"VLLM_PLUGINS": "none"}, "intree": {"VLLM_LING_MODEL": "vllm"},
           "ours": {"VLLM_LING_MODEL": "vllm-ling"}}


def main() -> int:
    from ling_tools.tiny import ensure_tiny

    out, tmp = Path(sys.argv[1]), Path("/tmp/intree_check")
    tmp.mkdir(exist_ok=True)
    model = str(ensure_tiny(seed=0, variant="stable_router"))
    spec = {"model": model, "prompts": model_prompts()[:6], "max_tokens": 32, "dtype": "bfloat16",
            "hf_overrides": NO_CLAMPS, "enforce_eager": True, "gpu_memory_utilization": 0.25,
            "max_model_len": 2048, "max_num_batched_tokens": 256, "max_num_seqs": 8, "prompt_logprobs": False}
    report: dict = {}
    for name, env in ENGINES.items():
        try:
            run = run_script("engine_runner.py", spec, tmp, name, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})
            report[name] = {"ok": True, "implementation": run["implementation"],
                            "tokens": [o["token_ids"] for o in run["outputs"]]}
        except AssertionError as e:
            lines = [x for x in str(e).splitlines() if "Error" in x or "size" in x.lower()]
            report[name] = {"ok": False, "error": lines[-6:]}
        print(name, {k: v for k, v in report[name].items() if k != "tokens"}, flush=True)
    if report["intree"].get("ok") and report["ours"].get("ok"):
        pairs = list(zip(report["intree"]["tokens"], report["ours"]["tokens"]))
        report["intree_vs_ours"] = {"first_difference": [first_difference(a, b) for a, b in pairs],
                                    "agreement": sum(x == y for a, b in pairs for x, y in zip(a, b))
                                    / sum(len(a) for a, _ in pairs)}
        print(report["intree_vs_ours"])
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
