"""The engine race of MoE backends: the short model it builds, how it reads each engine's run, and the verdict.
The engines themselves need CUDA and vLLM >= 0.28 (run on the device: tests/gpu/run_on_device.sh engine_moe)."""

import json
import sys

import pytest
from ling_tuning.choice import decide_engine, recommended_backend, write_choice
from ling_tuning.engine_compare import EngineResult, compare_engines, per_layer_delta_us, short_config
from ling_tuning.shapes import bundled_config_path, shape_from_config

FLASH = json.loads(bundled_config_path().read_text())
LOG = {"marlin": "INFO Using 'MARLIN' WNA16 MoE backend.", "humming": "INFO Using 'HUMMING' WNA16 MoE backend.",
       "triton": "INFO Using 'TRITON' WNA16 MoE backend."}


def test_short_model_keeps_the_moe_shape_with_every_layer_mla_and_moe():
    from vllm_ling.layout import is_mla_layer, is_moe_layer, num_mtp_layers

    cfg = short_config(FLASH, layers=8)
    assert shape_from_config(cfg) == shape_from_config(FLASH)  # what is measured is untouched
    assert cfg["num_hidden_layers"] == 8 and num_mtp_layers(cfg) == 0 and cfg["vocab_size"] == 4096
    assert all(is_mla_layer(cfg, i) and is_moe_layer(cfg, i) for i in range(8))  # no KDA, no dense MLP
    assert cfg["expert_swiglu_limit_list"] == FLASH["expert_swiglu_limit_list"][-8:]
    assert max(cfg["eos_token_id"], cfg["pad_token_id"]) < cfg["vocab_size"]
    with pytest.raises(ValueError, match="layers=0"):
        short_config(FLASH, layers=0)


class FakeEngines:
    """Stands in for one engine process per backend: writes the worker's JSON, prints vLLM's backend line."""

    def __init__(self, steps: dict[str, dict[int, float]], serves: dict[str, str] | None = None, rc: int = 0):
        self.steps, self.serves, self.rc, self.calls = steps, serves or {}, rc, []

    def __call__(self, cmd, env, timeout):
        self.calls.append((cmd, env))
        backend, out = cmd[cmd.index("--backends") + 1], cmd[cmd.index("--out") + 1]
        assert cmd[:3] == [sys.executable, "-m", "ling_tuning.engine_compare"] and "--worker" in cmd
        if self.rc == 0:
            with open(out, "w") as f:
                json.dump({"step_us": {str(m): us for m, us in self.steps[backend].items()},
                           "kernels_per_step": {str(m): 400 for m in self.steps[backend]}}, f)
        return self.rc, "loading...\n" + LOG[self.serves.get(backend, backend)] + "\nCUDA error: boom\n"


def test_each_backend_gets_its_own_engine_and_triton_reads_the_tuned_tiles(tmp_path, bundled=bundled_config_path()):
    fake = FakeEngines({"marlin": {1: 100.0, 2: 110.0}, "humming": {1: 90.0, 2: 95.0}, "triton": {1: 120.0, 2: 99.0}})
    results = compare_engines(bundled, ["marlin", "humming", "triton"], [1, 2], tmp_path, tuned_folder=tmp_path / "t",
                              spawn=fake)
    assert [(r.backend, r.step_us, r.error) for r in results] == [
        ("marlin", {1: 100.0, 2: 110.0}, None), ("humming", {1: 90.0, 2: 95.0}, None),
        ("triton", {1: 120.0, 2: 99.0}, None)]
    assert results[0].kernels == {1: 400.0, 2: 400.0}
    envs = {cmd[cmd.index("--backends") + 1]: env for cmd, env in fake.calls}
    assert envs["triton"]["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path / "t")
    model = json.loads((tmp_path / "short-model" / "config.json").read_text())
    assert model["num_hidden_layers"] == 8
    assert per_layer_delta_us(results, 8) == {"humming": {1: -1.25, 2: -1.875}, "triton": {1: 2.5, 2: -1.375}}


def test_a_backend_vllm_did_not_serve_or_a_crashed_engine_has_no_timings(tmp_path):
    bundled = bundled_config_path()
    swapped = compare_engines(bundled, ["humming"], [1], tmp_path, spawn=FakeEngines({"humming": {1: 1.0}},
                                                                                      serves={"humming": "marlin"}))
    assert swapped[0].step_us == {} and "asked for humming, vLLM's log names marlin" in swapped[0].error
    crashed = compare_engines(bundled, ["marlin"], [1], tmp_path, spawn=FakeEngines({}, rc=1))[0]
    assert crashed.step_us == {} and "engine exited 1" in crashed.error and "CUDA error: boom" in crashed.error
    untuned = compare_engines(bundled, ["triton"], [1], tmp_path, spawn=FakeEngines({}))[0]
    assert untuned.step_us == {} and "tuned tile file" in untuned.error
    with pytest.raises(ValueError, match="cutlass"):
        compare_engines(bundled, ["cutlass"], [1], tmp_path, spawn=FakeEngines({}))


def r(backend, steps, error=None):
    return EngineResult(backend, step_us=steps, served=backend if steps else None, error=error)


def test_humming_takes_the_job_only_beyond_the_margin_over_decode_sizes():
    fast = [r("marlin", {1: 100.0, 8: 100.0, 1024: 500.0}), r("humming", {1: 90.0, 8: 90.0, 1024: 900.0})]
    backend, why = decide_engine(fast, decode_max_m=64)
    assert backend == "humming" and "humming 1.111x" in why and "1024" not in why  # prefill-size loss ignored
    close = [r("marlin", {1: 100.0}), r("humming", {1: 97.0}), r("triton", {1: 98.0})]
    assert decide_engine(close, margin=0.05)[0] == "marlin"
    assert decide_engine([r("marlin", {1: 100.0}), r("humming", {1: 97.0}), r("triton", {1: 80.0})])[0] == "triton"


def test_a_backend_missing_a_decode_size_is_out_and_marlin_need_not_be_there():
    gap = [r("marlin", {1: 100.0, 4: 100.0}), r("humming", {1: 10.0})]  # humming has no M=4
    backend, why = decide_engine(gap)
    assert backend == "marlin" and "humming" in why
    assert decide_engine([r("marlin", {}, "engine exited 1"), r("humming", {1: 50.0})])[0] == "humming"
    assert decide_engine([r("marlin", {}, "x")])[0] is None


def test_the_engine_verdict_rules_the_written_choice_and_the_recipe_reads_humming(tmp_path):
    from ling_tuning.compare import Row, Timing

    kernel_rows = [Row(m=1, kernel="cuda_wna16", experts=8.0, tuned=Timing(us=50.0), default=Timing(error="x"),
                       marlin=Timing(us=100.0))]  # kernel for kernel, tuned Triton wins
    engine = [r("marlin", {1: 100.0}), r("humming", {1: 80.0}), r("triton", {1: 95.0})]
    doc = write_choice(tmp_path, "NVIDIA H200", kernel_rows, engine=engine)
    assert doc["moe_backend"] == "humming" and "engine decode step" in doc["criterion"]["metric"]
    assert doc["evidence"][0]["triton_us"] == 50.0 and doc["engine_evidence"][1]["backend"] == "humming"
    assert recommended_backend(tmp_path, "NVIDIA H200") == "humming"
    undecided = write_choice(tmp_path, "NVIDIA H200", kernel_rows, engine=[r("marlin", {}, "boom")])
    assert undecided["moe_backend"] == "triton" and "engine comparison undecided" in undecided["reason"]


def test_the_cli_writes_its_report_after_every_engine(tmp_path):
    """A device call cut short by its time limit must keep the backends that finished (one such device run lost Marlin's)."""
    from ling_tuning import engine_compare

    out, seen = tmp_path / "r.json", []
    fake = FakeEngines({"marlin": {1: 100.0}, "humming": {1: 90.0}})

    def spawn(cmd, env, timeout):
        seen.append(json.loads(out.read_text())["results"] if out.exists() else [])
        return fake(cmd, env, timeout)

    assert engine_compare.main(["--backends", "marlin,humming", "--ms", "1", "--out", str(out),
                                "--workdir", str(tmp_path / "w")], spawn=spawn) == 0
    assert [len(s) for s in seen] == [0, 1] and seen[1][0]["backend"] == "marlin"  # written before humming started
    doc = json.loads(out.read_text())
    assert doc["per_layer_delta_us_vs_marlin"] == {"humming": {"1": -1.25}}
    assert (tmp_path / "w" / "engine-humming.log").read_text().count("HUMMING") == 1
