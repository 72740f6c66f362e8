"""What `--quantization ling_fp8` changes on *your* weights: the same prompts through BF16 and FP8, compared.

    python3 -m ling_bench.fp8_check MODEL [--prompts 8] [--tokens 64] [--out fp8_check.json]

The GPU test shows our FP8 costs what FP8 costs (an independent FP8 reference loses as much); what FP8 costs on
the real Ling-3.0-flash is a property of its weights, which only a run on them shows. This runs the model twice,
one engine at a time (each in its own process: vLLM gives GPU memory back only when the process ends), over
fixed-seed code and prose prompts (ling_bench.prompts): teacher-forced top-K logprobs at every prompt position,
then a greedy continuation. It reports, against the BF16 run: top-1 agreement per band of BF16's own margin
(top-1 minus top-2 logprob), the mean |delta logprob| of the prompt's tokens, and where each greedy continuation
first parts. Near-ties flip under any rounding; the verdict looks only at positions BF16 is sure of (margin >=
SURE nats): FP8 should keep >= SURE_AGREEMENT of those. If it does not, serve with FP8=0.
Two loads of a 77 GB checkpoint: minutes on a Spark, each. `--a`/`--b` compare other settings (a control: both
`bf16`, which must agree exactly).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SETTINGS = {"bf16": {}, "fp8": {"quantization": "ling_fp8"}}
MARGIN_BANDS = (0.0, 0.5, 1.0, 2.0, 4.0, float("inf"))
SURE = 2.0  # nats
SURE_AGREEMENT = 0.99
TOPK = 5


def prompts(n: int) -> list[str]:
    from ling_bench.prompts import code_prompts, prose_prompts

    return [p for pair in zip(code_prompts(0, n), prose_prompts(0, n)) for p in pair][:n]


def worker(spec: dict) -> dict:
    """One engine: prompt logprobs (top-K plus the prompt's own token) and a greedy continuation per prompt."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], seed=0, enable_prefix_caching=False, **spec["engine"])
    scored = llm.generate(spec["prompts"], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=TOPK),
                          use_tqdm=False)
    greedy = llm.generate(spec["prompts"], SamplingParams(max_tokens=spec["tokens"], temperature=0.0,
                                                          ignore_eos=True), use_tqdm=False)
    out = []
    for s, g in zip(scored, greedy):
        positions = []
        for tok, lps in zip(s.prompt_token_ids[1:], s.prompt_logprobs[1:]):
            top = sorted(((lp.logprob, t) for t, lp in lps.items()), reverse=True)[:TOPK]
            positions.append({"token": tok, "logprob": lps[tok].logprob, "top": [t for _, t in top],
                              "margin": top[0][0] - top[1][0] if len(top) > 1 else float("inf")})
        out.append({"positions": positions, "greedy": list(g.outputs[0].token_ids)})
    return {"prompts": out}


def run_setting(model: str, name: str, texts: list[str], tokens: int, engine: dict, tmp: Path) -> dict:
    spec = {"model": model, "prompts": texts, "tokens": tokens, "engine": {**engine, **SETTINGS[name]}}
    (tmp / f"{name}.spec.json").write_text(json.dumps(spec))
    out = tmp / f"{name}.out.json"
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "ling_bench.fp8_check", "--worker", str(tmp / f"{name}.spec.json"),
                              str(out)], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise SystemExit(f"fp8_check: the {name} engine failed (exit {rc}); its log: {log}\n"
                         + log.read_text()[-3000:])
    return json.loads(out.read_text())


def compare(a: dict, b: dict) -> dict:
    """b against a: top-1 agreement per band of a's margin, mean |delta logprob|, greedy agreement."""
    pairs, deltas, parted = [], [], []
    for pa, pb in zip(a["prompts"], b["prompts"]):
        for x, y in zip(pa["positions"], pb["positions"]):
            pairs.append((x["top"][0] == y["top"][0], x["margin"]))
            deltas.append(abs(x["logprob"] - y["logprob"]))
        ga, gb = pa["greedy"], pb["greedy"]
        parted.append(next((i for i, (u, v) in enumerate(zip(ga, gb)) if u != v), None))
    bands = {}
    for lo, hi in zip(MARGIN_BANDS, MARGIN_BANDS[1:]):
        inside = [ok for ok, m in pairs if lo <= m < hi]
        bands[f"{lo}-{hi}"] = {"positions": len(inside), "top1_agreement": sum(inside) / len(inside) if inside else None}
    sure = [ok for ok, m in pairs if m >= SURE]
    sure_agreement = sum(sure) / len(sure) if sure else None
    return {"positions": len(pairs), "top1_agreement": sum(ok for ok, _ in pairs) / max(len(pairs), 1),
            "by_margin": bands, "sure_positions": len(sure), "sure_agreement": sure_agreement,
            "mean_abs_logprob_delta": sum(deltas) / max(len(deltas), 1),
            "greedy_first_difference": parted, "greedy_identical": sum(p is None for p in parted),
            "verdict": None if sure_agreement is None else
            ("OK" if sure_agreement >= SURE_AGREEMENT else "WORSE: serve with FP8=0")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling_bench.fp8_check", description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="the checkpoint (folder or hub id)")
    ap.add_argument("--prompts", type=int, default=8, help="fixed-seed code and prose prompts")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--a", default="bf16", choices=sorted(SETTINGS), help="the reference setting")
    ap.add_argument("--b", default="fp8", choices=sorted(SETTINGS), help="the setting compared with it")
    ap.add_argument("--util", type=float, default=0.72, help="--gpu-memory-utilization (the serve recipe's)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--engine-json", default="{}", help="more engine arguments as JSON, e.g. '{\"enforce_eager\": true}'")
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        Path(a.worker[1]).write_text(json.dumps(worker(json.loads(Path(a.worker[0]).read_text()))))
        return 0
    if not a.model:
        ap.error("MODEL is required")
    engine = {"gpu_memory_utilization": a.util, "max_model_len": a.max_model_len, "max_num_seqs": 2,
              **json.loads(a.engine_json)}
    texts = prompts(a.prompts)
    with tempfile.TemporaryDirectory(prefix="fp8-check-") as tmp:
        runs = {name: run_setting(a.model, name, texts, a.tokens, engine, Path(tmp)) for name in dict.fromkeys((a.a, a.b))}
    report = {"model": a.model, "a": a.a, "b": a.b, "engine": engine, "prompts": len(texts), "tokens": a.tokens,
              "sure_margin_nats": SURE, "sure_agreement_needed": SURE_AGREEMENT, **compare(runs[a.a], runs[a.b])}
    print(json.dumps({k: v for k, v in report.items() if k != "greedy_first_difference"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["verdict"] == "OK" else 1


if __name__ == "__main__":
    raise SystemExit(main())
