import json

import pytest
from ling_tuning.smem import GB10_SMEM_PER_BLOCK
from ling_tuning.space import candidates, config_key, explicit_default_config
from ling_tuning.store import Result, ResultStore
from ling_tuning.tuner import DeviceBroken, measure, pick_best, tune
from tuning_fakes import LING, FakeClock, FakeRunner

META = {"shape": LING.to_dict(), "device": "NVIDIA GB10"}
CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "SPLIT_K": 1}


def test_store_reloads_what_it_wrote_and_skips_a_torn_last_line(tmp_path):
    s = ResultStore(tmp_path, META)
    s.add(Result(4, CFG, "ok", us=12.5, rel_err=0.01))
    s.add(Result(4, CFG | {"BLOCK_SIZE_M": 8}, "wrong", rel_err=0.9))
    with s.path.open("a") as f:
        f.write('{"m": 4, "config": {"BLOCK_')  # killed mid-write
    again = ResultStore(tmp_path, META)
    assert again.get(4, CFG).us == 12.5
    assert again.get(4, CFG | {"BLOCK_SIZE_M": 8}).status == "wrong"
    assert len(again.results(4)) == 2


def test_store_keeps_runs_on_other_devices_apart(tmp_path):
    ResultStore(tmp_path, META).add(Result(4, CFG, "ok", us=1.0))
    other = ResultStore(tmp_path, META | {"device": "NVIDIA H200"})
    assert other.get(4, CFG) is None and other.path != ResultStore(tmp_path, META).path


def test_store_refuses_a_log_whose_header_was_changed(tmp_path):
    s = ResultStore(tmp_path, META)
    lines = s.path.read_text().splitlines()
    s.path.write_text(json.dumps({"header": {"device": "edited"}}) + "\n" + "\n".join(lines[1:]))
    with pytest.raises(ValueError, match="does not match"):
        ResultStore(tmp_path, META)


def test_measure_classifies_wrong_and_raising_configs(fake_runner):
    wrong = measure(fake_runner, 1, CFG | {"BLOCK_SIZE_N": 512}, GB10_SMEM_PER_BLOCK)
    assert wrong.status == "wrong" and wrong.us is None and wrong.rel_err == 0.9
    broken = measure(fake_runner, 1024, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64,
                                         "GROUP_SIZE_M": 1, "num_warps": 8, "num_stages": 4, "SPLIT_K": 1},
                     GB10_SMEM_PER_BLOCK)
    assert broken.status == "error" and "PassManager" in broken.detail
    good = measure(fake_runner, 1, CFG, GB10_SMEM_PER_BLOCK)
    assert good.status == "ok" and good.us == pytest.approx(fake_runner.cost(1, CFG))


def test_tune_finds_the_cost_models_optimum_among_valid_candidates(tmp_path, fake_runner, fake_clock):
    store = ResultStore(tmp_path, META)
    out = tune(LING, [1, 64, 1024], fake_runner, store, GB10_SMEM_PER_BLOCK, "quick", 1e9, fake_clock, False)
    for m, o in out.items():
        valid = [c for c in candidates(m, LING, GB10_SMEM_PER_BLOCK).kept
                 if c.get("BLOCK_SIZE_N") != 512 and not (c.get("num_warps") == 8 and c.get("num_stages") == 4)]
        assert o.best.us == pytest.approx(min(fake_runner.cost(m, c) for c in valid))
        in_plan = config_key(o.default.config) in {config_key(c) for c in candidates(m, LING, GB10_SMEM_PER_BLOCK).kept}
        launched = not o.default.detail.startswith("vLLM default rejected")
        assert o.measured == o.candidates + (launched and not in_plan) and o.skipped == 0
        assert o.default.status != "ok" or o.best.us <= o.default.us


def test_budget_is_shared_across_batch_sizes_and_every_m_gets_some(tmp_path):
    clock = FakeClock()
    runner = FakeRunner(clock=clock, cost_s=1.0)
    store = ResultStore(tmp_path, META)
    out = tune(LING, [1, 16, 1024], runner, store, GB10_SMEM_PER_BLOCK, "quick", 90.0, clock, False)
    assert all(o.measured >= 25 and o.skipped > 0 and o.best for o in out.values())
    assert clock.t <= 90.0 + 1.0  # one measurement may start just before the deadline


def test_rerun_resumes_from_the_log_without_remeasuring(tmp_path):
    clock = FakeClock()
    first = FakeRunner(clock=clock)
    tune(LING, [1, 16], first, ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, "quick", 60.0, clock, False)
    done = len(first.calls)
    second = FakeRunner(clock=FakeClock())
    out = tune(LING, [1, 16], second, ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, "quick", 1e9,
               second.clock, False)
    assert sum(o.reused for o in out.values()) == done
    assert {(m, json.dumps(c, sort_keys=True)) for m, c in first.calls}.isdisjoint(
        {(m, json.dumps(c, sort_keys=True)) for m, c in second.calls})
    assert all(o.skipped == 0 for o in out.values())


def test_best_ignores_results_that_do_not_fit_this_runs_limit(tmp_path):
    store = ResultStore(tmp_path, META)
    big = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "GROUP_SIZE_M": 1, "num_warps": 4,
           "num_stages": 2, "SPLIT_K": 1}  # 147,456 B by estimate
    small = big | {"BLOCK_SIZE_K": 64}
    compiled_big = small | {"BLOCK_SIZE_N": 64}  # fits by estimate, but compiled larger than the limit
    store.add(Result(1024, big, "ok", us=5.0, smem=139_264))
    store.add(Result(1024, compiled_big, "ok", us=6.0, smem=120_000))
    store.add(Result(1024, small, "ok", us=9.0, smem=40_960))
    assert pick_best(store, 1024, LING, 232_448).config == big
    assert pick_best(store, 1024, LING, GB10_SMEM_PER_BLOCK).config == small


def test_a_config_that_breaks_the_cuda_context_stops_the_run_and_is_not_retried(tmp_path):
    class Poisoned(FakeRunner):
        def triton(self, m, config, folder=None):
            if config and config["BLOCK_SIZE_N"] == 256:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return super().triton(m, config, folder)

    store = ResultStore(tmp_path, META)
    with pytest.raises(DeviceBroken, match="resume"):
        tune(LING, [16], Poisoned(), store, GB10_SMEM_PER_BLOCK, progress=False)
    culprit = [r for r in store.results(16) if r.status == "error"]
    assert len(culprit) == 1 and culprit[0].config["BLOCK_SIZE_N"] == 256
    again = tune(LING, [16], FakeRunner(), ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, progress=False)
    assert again[16].reused == len(store.results(16)) and again[16].best


class DefaultIsFastest(FakeRunner):
    """vLLM's default beats every searched config (the H200 at M = 1024: 3,158 µs vs 6,581 µs tuned)."""

    def cost(self, m, cfg):
        fastest = config_key(cfg) == config_key(self.resolved(m, explicit_default_config(m, self.shape)))
        return 1.0 if fastest else super().cost(m, cfg)


def test_vllms_default_is_measured_first_whatever_the_budget_and_kept_when_it_wins(tmp_path):
    clock = FakeClock()
    runner = DefaultIsFastest(clock=clock)
    out = tune(LING, [4, 1024], runner, ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, "quick", 6.0, clock, False)
    for m, o in out.items():
        first = next(c for mm, c in runner.calls if mm == m)
        assert first == explicit_default_config(m, LING) == o.best.config
        assert o.default.status == "ok" and o.best.us == o.default.us == 1.0 and o.skipped > 0
    starved = tune(LING, [2048], runner, ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, "quick", 0.0, clock,
                   False)[2048]
    assert starved.measured == 1 and starved.skipped == starved.candidates
    assert starved.best.config == explicit_default_config(2048, LING)


def test_a_default_the_kernel_rejects_is_recorded_and_tuning_goes_on(tmp_path, fake_runner, fake_clock):
    """vLLM's CUDA default at M <= 2 picks BLOCK_SIZE_K // group = 16: rejected, never launched."""
    out = tune(LING, [1, 2], fake_runner, ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, "quick", 1e9, fake_clock,
               False)
    for m, o in out.items():
        assert o.default.status == "error" and "cuda_k_groups" in o.default.detail
        assert (m, o.default.config) not in fake_runner.calls
        valid = [c for c in candidates(m, LING, GB10_SMEM_PER_BLOCK).kept if c["BLOCK_SIZE_N"] != 512]
        assert o.best.us == pytest.approx(min(fake_runner.cost(m, c) for c in valid))


def test_a_default_that_raises_at_launch_is_logged_and_the_best_candidate_is_written(tmp_path, fake_clock):
    class DefaultRaises(FakeRunner):
        def triton(self, m, config, folder=None):
            if config == explicit_default_config(m, self.shape):
                self.calls.append((m, config))
                raise RuntimeError("moe_wna16_gemm, moe_wna16.cu:317, BLOCK_SIZE_K // group_size must be one of "
                                   "[1, 2, 4, 8]")
            return super().triton(m, config, folder)

    runner = DefaultRaises(clock=fake_clock)
    store = ResultStore(tmp_path, META)
    out = tune(LING, [4, 1024], runner, store, GB10_SMEM_PER_BLOCK, "quick", 1e9, fake_clock, False)
    for m, o in out.items():
        assert o.default.status == "error" and "BLOCK_SIZE_K // group_size" in o.default.detail
        assert store.get(m, explicit_default_config(m, LING)).status == "error"
        valid = [c for c in candidates(m, LING, GB10_SMEM_PER_BLOCK).kept
                 if config_key(c) != config_key(explicit_default_config(m, LING))]
        assert o.best.us == pytest.approx(min(runner.cost(m, c) for c in valid))
    again = tune(LING, [4], DefaultRaises(), ResultStore(tmp_path, META), GB10_SMEM_PER_BLOCK, progress=False)[4]
    assert again.measured == 0 and again.default.status == "error"  # logged, not retried
