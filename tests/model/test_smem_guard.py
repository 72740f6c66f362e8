"""The KDA smem guard on real Triton Autotuner objects (built on the CPU; nothing is launched).
The compile probe is replaced by a formula: bytes = BLOCK * 1000 * num_stages."""

import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from vllm_ling import smem_guard  # noqa: E402

LIMIT = 200_000


@triton.jit
def _kernel(x, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


def _configs():
    return [triton.Config({"BLOCK": b}, num_warps=4, num_stages=s) for b in (32, 64, 128) for s in (2, 3, 4)]


def fake_probe(tuner, cfg, nargs, kwargs):
    return cfg.kwargs["BLOCK"] * 1000 * cfg.num_stages


def fla_like_module(user_prune=None):
    """A module shaped like vLLM's FLA ops: one bare autotuner, one under @triton.heuristics."""
    m = types.ModuleType("fake_fla_ops")
    m.plain = triton.autotune(configs=_configs(), key=[])(_kernel)
    prune = {"early_config_prune": user_prune} if user_prune else None
    m.wrapped = triton.heuristics({"FLAG": lambda args: 1})(
        triton.autotune(configs=_configs(), key=[], prune_configs_by=prune)(_kernel))
    m.helper, m.NUM_WARPS = (lambda: None), [2, 4]
    return m


def prune(tuner):
    tuner.nargs = {}
    return tuner.prune_configs({"grid": (1,), "warmup": False})


def test_autotuners_are_found_through_heuristics_wrappers():
    m = fla_like_module()
    found = dict(smem_guard.autotuners(m))
    assert set(found) == {"fake_fla_ops.plain", "fake_fla_ops.wrapped"}
    assert found["fake_fla_ops.wrapped"] is m.wrapped.fn


def test_configs_over_the_limit_are_dropped_before_benchmarking():
    m = fla_like_module()
    log = smem_guard.install(LIMIT, modules=[m], probe=fake_probe)
    kept = prune(m.plain)
    assert kept and all(fake_probe(None, c, {}, {}) <= LIMIT for c in kept)
    assert len(kept) == 9 - 4  # 64x4 and all three BLOCK 128 are over 200 kB
    dropped = log.kernels["fake_fla_ops.plain"]["dropped"]
    assert len(dropped) == 4 and all(v["smem"] > LIMIT for v in dropped.values())


def test_the_kernels_own_prune_runs_first():
    seen = []

    def user(configs, nargs, **kw):
        seen.append(len(configs))
        return [c for c in configs if c.kwargs["BLOCK"] != 32]

    m = fla_like_module(user_prune=user)
    smem_guard.install(LIMIT, modules=[m], probe=fake_probe)
    kept = prune(m.wrapped.fn)
    assert seen == [9] and [(c.kwargs["BLOCK"], c.num_stages) for c in kept] == [(64, 2), (64, 3)]


def test_reinstalling_starts_from_the_original_configs():
    m = fla_like_module()
    smem_guard.install(100_000, modules=[m], probe=fake_probe, max_stages=2)
    assert len(m.plain.configs) == 3
    smem_guard.install(LIMIT, modules=[m], probe=fake_probe)
    assert len(m.plain.configs) == 9 and len(prune(m.plain)) == 5


def test_stage_cap_removes_deep_pipelines_up_front():
    m = fla_like_module()
    log = smem_guard.install(10**9, modules=[m], probe=fake_probe, max_stages=2)
    assert {c.num_stages for c in m.plain.configs} == {2}
    assert all("num_stages" in v["why"] for v in log.kernels["fake_fla_ops.plain"]["dropped"].values())


def test_when_the_probe_breaks_only_shallow_pipelines_survive():
    def broken(*a):
        raise AttributeError("metadata")

    m = fla_like_module()
    smem_guard.install(LIMIT, modules=[m], probe=broken)
    assert {c.num_stages for c in prune(m.plain)} == {smem_guard.FALLBACK_MAX_STAGES}


def test_when_nothing_fits_the_smallest_config_is_kept():
    m = fla_like_module()
    smem_guard.install(1_000, modules=[m], probe=fake_probe)
    kept = prune(m.plain)
    assert len(kept) == 1 and kept[0].kwargs["BLOCK"] == 32 and kept[0].num_stages == 2


def test_install_forgets_autotune_results_chosen_without_the_guard():
    m = fla_like_module()
    m.plain.cache[("key",)] = m.plain.configs[-1]
    smem_guard.install(LIMIT, modules=[m], probe=fake_probe)
    assert m.plain.cache == {}


def test_a_nonsense_limit_is_refused():
    with pytest.raises(ValueError, match="101376"):
        smem_guard.install(0, modules=[])
