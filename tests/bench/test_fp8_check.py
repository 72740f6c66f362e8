"""ling_bench.fp8_check on the CPU engine and the tiny checkpoint: two BF16 runs agree exactly, FP8 moves the
logprobs, and the report says where (no speed or quality threshold asserted: random weights)."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine
ENV = {"VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1"}


def _check(tmp_path, *args: str) -> dict:
    pytest.importorskip("vllm")
    from ling_tools.tiny import ensure_tiny

    out = tmp_path / f"{'-'.join(args) or 'default'}.json"
    proc = subprocess.run([sys.executable, "-m", "ling_bench.fp8_check", str(ensure_tiny()), "--prompts", "2",
                           "--tokens", "8", "--max-model-len", "512", "--out", str(out), *args],
                          env={**os.environ, **ENV}, capture_output=True, text=True, timeout=900)
    assert proc.returncode in (0, 1), proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert proc.returncode == (0 if report["verdict"] == "OK" else 1)
    return report


def test_two_bf16_engines_agree_exactly(tmp_path):
    r = _check(tmp_path, "--a", "bf16", "--b", "bf16")
    assert r["positions"] > 20 and r["top1_agreement"] == 1.0 and r["mean_abs_logprob_delta"] == 0.0
    assert r["greedy_identical"] == r["prompts"] and r["verdict"] == "OK"


def test_fp8_moves_the_logprobs_and_the_report_bands_them(tmp_path):
    r = _check(tmp_path)
    assert r["a"] == "bf16" and r["b"] == "fp8"
    assert r["mean_abs_logprob_delta"] > 1e-3, "FP8 changed nothing: was ling_fp8 applied?"
    assert sum(b["positions"] for b in r["by_margin"].values()) == r["positions"]
    assert r["verdict"] in ("OK", "WORSE: serve with FP8=0")
