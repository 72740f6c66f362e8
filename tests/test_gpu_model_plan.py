"""The GPU model test's bookkeeping, checked on the CPU with made-up outputs (device time lost to a plumbing bug costs
30 minutes): every configuration gets the slices of the oracle runs that score it, FP8 ones the FP8 reference of
their own implementation, and the FP8 premise check fails where engine and reference disagree."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).parent


@pytest.fixture
def t(monkeypatch):
    """tests/gpu/test_model_gpu.py imported as on a GPU (it skips at import without CUDA); nothing runs on one."""
    pytest.importorskip("vllm")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.syspath_prepend(str(HERE / "model"))
    monkeypatch.syspath_prepend(str(HERE / "gpu"))
    for name in ("test_model_gpu", "gpu_helpers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import test_model_gpu

    yield test_model_gpu
    for name in ("test_model_gpu", "gpu_helpers"):
        sys.modules.pop(name, None)


def _fake_oracle(job: str, spec: dict, n_sequences: int, fp8_names: list[str]) -> dict:
    """Each scored sequence tagged with the job that scored it, so the assembly can be traced."""
    names = fp8_names if spec.get("fp8") else []
    return {"scored": [{"job": job, "i": i} for i in range(n_sequences)], "fp8_linears": len(names),
            "fp8_names": names}


def test_every_configuration_gets_its_references_and_fp8_ones_their_implementations(t):
    k = len(t._prompts())
    plan = {job: (spec, names) for job, _, _, spec, names in t.oracle_plan()}
    oracles = {job: _fake_oracle(job, spec, k * len(names), [job]) for job, (spec, names) in plan.items()}
    runs = t.assemble({name: {"outputs": []} for name in t.CONFIGS}, oracles)
    assert set(runs) == set(t.CONFIGS)
    for name, run in runs.items():
        ckpt, impl = t.CONFIGS[name][0], t._implementation(name)
        jobs = lambda part: {s["job"] for s in part}  # noqa: E731
        if t._fp8(name):
            fp8, fp8_bf16 = f"oracle-{ckpt}-fp8-{impl}", f"oracle-{ckpt}-fp8_bf16-{impl}"
            assert (jobs(run.fp32), jobs(run.bf16)) == ({fp8}, {fp8_bf16}) and run.fp8_names == [fp8]
            assert (jobs(run.plain[0]), jobs(run.plain[1])) == ({f"oracle-{ckpt}-fp32"}, {f"oracle-{ckpt}-bf16"})
            assert plan[fp8][0]["fp8_merged"] == plan[fp8_bf16][0]["fp8_merged"] == t.FP8_MERGED[impl]
        else:
            assert (jobs(run.fp32), jobs(run.bf16)) == ({f"oracle-{ckpt}-fp32"}, {f"oracle-{ckpt}-bf16"})
            assert run.plain is None
        assert len(run.fp32) == len(run.bf16) == k


def test_each_slice_is_the_configurations_own(t):
    """The i-th configuration an oracle run scores gets that run's i-th block of k sequences."""
    k = len(t._prompts())
    oracles = {job: _fake_oracle(job, spec, k * len(names), ["lm_head"]) for job, _, _, spec, names in t.oracle_plan()}
    runs = t.assemble({name: {} for name in t.CONFIGS}, oracles)
    for job, _, _, _, names in t.oracle_plan():
        for i, name in enumerate(names):
            run = runs[name]
            parts = [run.fp32, run.bf16, *(run.plain or ())]
            got = [s["i"] for part in parts for s in part if s["job"] == job]
            assert got == list(range(i * k, (i + 1) * k)), (job, name)


@pytest.mark.parametrize("engine_fp8, reference_rounds, holds", [
    (True, True, True), (False, False, True), (False, True, False), (True, False, False)])
def test_the_fp8_premise_check_fails_where_engine_and_reference_disagree(t, engine_fp8, reference_rounds, holds):
    name = next(n for n in t.CONFIGS if t._fp8(n))
    merged = t.FP8_MERGED[t._implementation(name)][0]["served_as"]
    engine = {"quant_methods": {f"model.layers.0.self_attn.{merged}": "Fp8W8A8LinearMethod" if engine_fp8
                                else "UnquantizedLinearMethod", "lm_head": "Fp8W8A8LinearMethod"}}
    rounded = ["model.layers.0.self_attn.q_proj"] if reference_rounds else ["lm_head"]
    runs = {name: t.Run(engine, [], [], ([], []), rounded)}
    if holds:
        t.test_the_fp8_reference_rounds_kdas_projections_as_the_engine_serves_them(runs, name)
    else:
        with pytest.raises(AssertionError):
            t.test_the_fp8_reference_rounds_kdas_projections_as_the_engine_serves_them(runs, name)
