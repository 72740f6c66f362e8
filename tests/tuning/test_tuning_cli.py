"""The whole ling-tune flow on a fake device and a fake clock."""

import json

import pytest
from ling_tuning.choice import recommended_backend
from ling_tuning.cli import main
from ling_tuning.configfile import config_file_name, read_table, unsafe_lookups
from ling_tuning.smem import GB10_SMEM_PER_BLOCK, triton_wna16_smem
from ling_tuning.space import candidates, config_key, explicit_default_config
from ling_tuning.tuner import measure
from tuning_fakes import LING, FakeClock, FakeRunner

MS = "1,4,16,1024"


def run_cli(tmp_path, *extra, runner=None, prover=None):
    clock = runner.clock if runner else FakeClock()
    runner = runner or FakeRunner(clock=clock)
    rc = main(["--model", "ling-3.0-flash", "--batch-sizes", MS, "--out", str(tmp_path), "--no-progress", *extra],
              runner_factory=lambda shape, args: runner, prover=prover, clock=clock)
    return rc, runner


def test_cli_writes_the_tuned_file_choice_and_report(tmp_path, capsys):
    rc, runner = run_cli(tmp_path)
    assert rc == 0
    table = read_table(tmp_path / config_file_name(LING, "NVIDIA GB10"))
    for m in (1, 4, 16, 1024):
        valid = [c for c in candidates(m, LING, GB10_SMEM_PER_BLOCK).kept
                 if measure(runner, m, c, GB10_SMEM_PER_BLOCK).status == "ok"]
        assert runner.cost(m, table[m]) == min(runner.cost(m, c) for c in valid)
    assert {384, 385} <= set(table) and unsafe_lookups(table, LING, GB10_SMEM_PER_BLOCK, 8192) == []
    assert recommended_backend(tmp_path, "NVIDIA GB10") == "triton"  # the fake Marlin is 5x slower
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert [t["M"] for t in report["tuning"]] == [1, 4, 16, 1024]
    assert report["comparison"][0]["default"]["error"]  # vLLM's default fails at M = 1
    assert report["tuning"][0]["default"]["status"] == "error" and report["tuning"][1]["default"]["status"] == "ok"
    out = capsys.readouterr().out
    assert "| M | kernel | tuned tiles |" in out and f"VLLM_TUNED_CONFIG_FOLDER={tmp_path}" in out


def test_when_vllms_default_beats_every_sampled_config_its_tiles_are_written(tmp_path, capsys):
    """The H200 run at M = 1024: 4 of 16 sampled configs timed, all slower than vLLM's default."""
    class DefaultIsFastest(FakeRunner):
        def cost(self, m, cfg):
            default = self.resolved(m, explicit_default_config(m, self.shape))
            return 1.0 if config_key(cfg) == config_key(default) else super().cost(m, cfg)

    rc, _ = run_cli(tmp_path, "--budget", "0.1", "--max-candidates", "16", runner=DefaultIsFastest())
    assert rc == 0
    table = read_table(tmp_path / config_file_name(LING, "NVIDIA GB10"))
    assert table[1024] == explicit_default_config(1024, LING)  # BM64 BN64 BK32 w4 s3
    for m in (4, 16):  # the CUDA default with its heuristic N/K made explicit
        assert table[m] == {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "SPLIT_K": 1}
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert report["tuning"][-1]["skipped"] > 0
    rows = {r["m"]: r for r in report["comparison"]}
    for m in (4, 16, 1024):  # tuned == default, never slower
        assert rows[m]["tuned"]["us"] == rows[m]["default"]["us"] == 1.0
    assert "| default µs | best µs |" in capsys.readouterr().out


def test_interrupted_run_resumes_and_finishes(tmp_path):
    clock = FakeClock()
    first = FakeRunner(clock=clock)
    rc, _ = run_cli(tmp_path, "--budget", "1", runner=first)  # 60 fake seconds: a partial run
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert rc == 0 and sum(t["skipped"] for t in report["tuning"]) > 0
    second = FakeRunner(clock=FakeClock())
    rc, _ = run_cli(tmp_path, "--budget", "1000", runner=second)
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert rc == 0 and sum(t["skipped"] for t in report["tuning"]) == 0
    assert sum(t["reused"] for t in report["tuning"]) >= 60 - 4  # what the first run measured


def test_smem_limit_emulation_prunes_before_launch(tmp_path):
    runner = FakeRunner(smem=232_448)
    rc, _ = run_cli(tmp_path, "--smem-limit", "101376", "--space", "full", "--batch-sizes", "4096", runner=runner)
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert rc == 0 and report["emulated"] and report["smem_limit"] == 101376
    assert report["tuning"][0]["pruned"]["smem"] > 0
    launched = [c for m, c in runner.calls if c is not None and m == 4096]
    assert launched and max(triton_wna16_smem(c) for c in launched) <= 101376


def test_emulating_more_smem_than_the_device_has_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="101376"):
        run_cli(tmp_path, "--smem-limit", "200000")


def test_a_failed_vllm_proof_fails_the_run(tmp_path):
    rc, _ = run_cli(tmp_path, prover=lambda folder, shape, table: {"loaded": False, "default_warning": True})
    assert rc == 1


def test_bad_inputs_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--model", "ling-3.0-flash", "--batch-sizes", "0,4"])
    assert "batch sizes must be integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", "ling-3.0-flash", "--budget", "-1"])
    assert "--budget -1.0: must be positive" in capsys.readouterr().err
    rc = main(["--model", str(tmp_path / "missing"), "--out", str(tmp_path)],
              runner_factory=lambda s, a: FakeRunner(), prover=None)
    assert rc == 2 and "no such config.json" in capsys.readouterr().err


def test_without_a_gpu_the_real_runner_refuses_cleanly(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc = main(["--model", "ling-3.0-flash", "--batch-sizes", "1", "--out", str(tmp_path)])
    assert rc == 2 and "none is visible" in capsys.readouterr().err
    assert not (tmp_path / ".ling-tune").exists()


def test_engine_race_decides_the_backend_when_asked(tmp_path, capsys):
    """--engine-backends: one engine per backend after the tuned file exists (Triton's engine reads it); the
    engine verdict (Humming here) replaces the kernel one (tuned Triton, the fake Marlin being 5x slower)."""
    from ling_tuning.engine_compare import EngineResult

    seen = {}

    def engine(config, backends, ms, workdir, tuned_folder=None, layers=8):
        seen.update(config=config, backends=backends, ms=ms, tuned=tuned_folder, layers=layers)
        steps = {"marlin": 100.0, "humming": 80.0, "triton": 90.0}
        return [EngineResult(b, step_us={m: steps[b] for m in ms}, served=b) for b in backends]

    clock = FakeClock()
    rc = main(["--model", "ling-3.0-flash", "--batch-sizes", MS, "--out", str(tmp_path), "--no-progress",
               "--engine-backends", "marlin,humming,triton", "--engine-layers", "4"],
              runner_factory=lambda shape, args: FakeRunner(clock=clock), prover=None, clock=clock, engine=engine)
    assert rc == 0
    assert seen["ms"] == [1, 4, 16, 1024] and seen["tuned"] == tmp_path.resolve() and seen["layers"] == 4
    assert recommended_backend(tmp_path, "NVIDIA GB10") == "humming"
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert report["engine_comparison"]["per_layer_delta_us_vs_marlin"]["humming"]["1"] == -5.0
    assert "MoE backend for this device: humming" in capsys.readouterr().out


def test_engine_race_is_skipped_without_cuda_under_auto_and_bad_backends_are_refused_up_front(tmp_path, capsys):
    rc, _ = run_cli(tmp_path)  # auto on this CPU machine: no engines, the kernel verdict stands
    report = json.loads((tmp_path / "tune-report.json").read_text())
    assert rc == 0 and "skipped" in report["engine_comparison"] and report["choice"]["moe_backend"] == "triton"
    with pytest.raises(SystemExit) as e:
        main(["--model", "ling-3.0-flash", "--out", str(tmp_path), "--engine-backends", "marlin,cutlass"],
             runner_factory=lambda shape, args: pytest.fail("tuned before refusing the bad flag"))
    assert e.value.code == 2 and "cutlass" in capsys.readouterr().err
