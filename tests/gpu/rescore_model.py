"""Re-score a recorded `model` run (test_model_gpu.py) from its raw outputs, on any machine.

    python3 tests/gpu/rescore_model.py RAW_DIR OUT_DIR

RAW_DIR holds the engine and oracle `*.out.json` of one run (the device keeps them in
/tmp/pytest-of-root/pytest-current/gpu-model0; `tar -czf $OUT/raw.tgz *.out.json` brings them back). Writes the
test's records (`model_<name>_vs_oracle.json`, `model_<name>_fp8_cost.json`) into OUT_DIR and prints every
criterion of test_teacher_forced_top1_and_logprob_error and test_fp8_costs_no_more_than_the_reference_fp8 with
its verdict, through the test's own functions: a criterion added after a device run is checked on that run's data
(the later runs: the earliest had one FP8 reference per checkpoint, under other job names).
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
    runs = t.assemble({name: load(name) for name in t.CONFIGS}, {job: load(job) for job, *_ in t.oracle_plan()})
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, run in runs.items():
        s = t._prompt_scores(run.engine, run.fp32, run.bf16)
        (out / f"model_{name}_vs_oracle.json").write_text(json.dumps(s | {"oracle": "fp8" if run.plain else "fp32"}, indent=2))
        checks = t.served_checks(s)
        if run.plain:
            cost = t.fp8_cost(run)
            (out / f"model_{name}_fp8_cost.json").write_text(json.dumps(cost, indent=2))
            checks += t.cost_checks(cost)
        for holds, what in checks:
            failed += not holds
            print(f"{name:16s} {'ok  ' if holds else 'FAIL'} {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
