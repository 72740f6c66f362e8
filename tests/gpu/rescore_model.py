"""Re-score a recorded `model` run (test_model_gpu.py) from its raw outputs, on any machine.

    python3 tests/gpu/rescore_model.py RAW_DIR OUT_DIR

RAW_DIR holds the engine and oracle `*.out.json` of one run (the device keeps them in
/tmp/pytest-of-root/pytest-current/gpu-model0; `tar -czf $OUT/raw.tgz *.out.json` brings them back). Writes the
test's records (`model_<name>_vs_oracle.json`, `model_<name>_fp8_cost.json`) into OUT_DIR and prints every
criterion of test_teacher_forced_top1_and_logprob_error and test_fp8_costs_no_more_than_the_reference_fp8 with
its verdict, using the test's own functions: a criterion added after a device run is checked on that run's data.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

torch.cuda.is_available = lambda: True  # the test module skips without CUDA; scoring needs none
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "model")]
import test_model_gpu as t  # noqa: E402


def main(raw: Path, out: Path) -> int:
    load = lambda name: json.loads((raw / f"{name}.out.json").read_text())  # noqa: E731
    out.mkdir(parents=True, exist_ok=True)
    k, failed = len(t._prompts()), 0
    for ckpt in ("bf16", "int4"):
        names = [n for n, (c, _, _) in t.CONFIGS.items() if c == ckpt]
        ref = {tag: load(f"oracle-{ckpt}-{tag}")["scored"] for tag in t.ORACLES}
        for i, name in enumerate(names):
            part = {tag: r[i * k:(i + 1) * k] for tag, r in ref.items()}
            fp8 = "quantization" in t.CONFIGS[name][2]
            run = (t.Run(load(name), part["fp8"], part["fp8_bf16"], (part["fp32"], part["bf16"])) if fp8
                   else t.Run(load(name), part["fp32"], part["bf16"]))
            s = t._prompt_scores(run.engine, run.fp32, run.bf16)
            f = s["oracle_bf16_floor"]
            checks = {"decided": (s["top1_agreement_decided"], t._decided_bar(f["top1_agreement_decided"])),
                      "overall": (s["top1_agreement"], min(0.99, f["top1_agreement"] - t.FLOOR_SLACK)),
                      "rel_err<=": (t.REL_ERR_FACTOR * f["relative_logprob_error"], s["relative_logprob_error"])}
            (out / f"model_{name}_vs_oracle.json").write_text(json.dumps(s | {"oracle": "fp8" if fp8 else "fp32"}, indent=2))
            if fp8:
                cost = t._prompt_scores(run.engine, run.plain[0], run.bf16)
                (out / f"model_{name}_fp8_cost.json").write_text(json.dumps(cost, indent=2))
                c = cost["oracle_bf16_floor"]
                for key in ("top1_agreement", "top1_agreement_decided"):
                    checks[f"fp8 cost {key}"] = (cost[key], c[key] - t.FP8_COST_SLACK)
            for what, (got, bar) in checks.items():
                ok = got >= bar
                failed += not ok
                print(f"{name:16s} {what:30s} {got:.4f} >= {bar:.4f}  {'ok' if ok else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
