"""ling_bench.fp8_check on the CPU engine and the tiny checkpoint: two BF16 runs agree exactly, FP8 moves the
logprobs, and the report says where (no speed or quality threshold asserted: random weights).

The command runs in this process (`main`, as `python -m ling_bench.fp8_check` calls it), each of its engines in a
worker process of its own as always; the BF16 run both tests compare against is run once and handed to both (the
same model, prompts and engine settings give the same run)."""

import copy
import json

import pytest

pytestmark = pytest.mark.engine
# the CPU engine recipe of the engine tests (tests/model/model_helpers.py CPU_ENGINE_ENV): its engine core in the
# worker's own process, where vLLM would start two more and import itself in each
ENV = {"VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_CI_ENV": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def fp8_check():
    """ling_bench.fp8_check's `main` with ENV for its workers and each distinct engine run once for the module."""
    pytest.importorskip("vllm")
    from ling_bench import fp8_check as tool

    runs: dict[str, dict] = {}
    run_setting = tool.run_setting

    def once(model: str, name: str, texts: list[str], tokens: int, engine: dict, tmp) -> dict:
        key = json.dumps([model, name, texts, tokens, engine])
        if key not in runs:
            runs[key] = run_setting(model, name, texts, tokens, engine, tmp)
        return copy.deepcopy(runs[key])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tool, "run_setting", once)
        for name, value in ENV.items():
            patch.setenv(name, value)
        yield tool.main


@pytest.fixture
def check(fp8_check, tmp_path):
    def run(*args: str) -> dict:
        from ling_tools.tiny import ensure_tiny

        out = tmp_path / f"{'-'.join(args) or 'default'}.json"
        code = fp8_check([str(ensure_tiny()), "--prompts", "2", "--tokens", "8", "--max-model-len", "512",
                          "--out", str(out), *args])
        report = json.loads(out.read_text())
        assert code == (0 if report["verdict"] == "OK" else 1)
        return report

    return run


def test_two_bf16_engines_agree_exactly(check):
    r = check("--a", "bf16", "--b", "bf16")
    assert r["positions"] > 20 and r["top1_agreement"] == 1.0 and r["mean_abs_logprob_delta"] == 0.0
    assert r["greedy_identical"] == r["prompts"] and r["verdict"] == "OK"


def test_fp8_moves_the_logprobs_and_the_report_bands_them(check):
    r = check()
    assert r["a"] == "bf16" and r["b"] == "fp8"
    assert r["mean_abs_logprob_delta"] > 1e-3, "FP8 changed nothing: was ling_fp8 applied?"
    assert sum(b["positions"] for b in r["by_margin"].values()) == r["positions"]
    assert r["verdict"] in ("OK", "WORSE: serve with FP8=0")
