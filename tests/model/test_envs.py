"""A vllm-ling setting read while vLLM builds the model enters vLLM's compile-cache key, so two engines that differ
only in it never share a compiled graph (vllm_ling/envs.py says why: on the H200 one engine loaded the graph
traced for the other KDA gate and failed)."""

from __future__ import annotations

import pytest


def test_a_choice_read_under_a_vllm_config_changes_its_compile_hash(monkeypatch):
    pytest.importorskip("vllm")
    from vllm_layers import vllm_layer_context
    from vllm_ling import envs
    from vllm_ling.kda_core import GATE_ENV, GATES
    from ling_tools.tiny import ensure_tiny

    with vllm_layer_context(str(ensure_tiny(seed=0))) as config:
        hashes = {}
        for value in ("ours", "kernel", "ours"):
            monkeypatch.setenv(GATE_ENV, value)
            assert envs.choice(GATE_ENV, GATES, "ours") == value
            hashes.setdefault(value, set()).add(config.compute_hash())
        assert config.additional_config[envs.COMPILE_KEY] == {GATE_ENV: "ours"}
    assert all(len(h) == 1 for h in hashes.values()), "the same value must give the same key"
    assert hashes["ours"] != hashes["kernel"]


def test_a_choice_outside_any_vllm_config_records_nothing(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.config import get_current_vllm_config_or_none

    from vllm_ling import envs

    assert get_current_vllm_config_or_none() is None
    monkeypatch.setenv("VLLM_LING_KDA_GATE", "kernel")
    assert envs.choice("VLLM_LING_KDA_GATE", ("ours", "kernel"), "ours") == "kernel"


def test_the_fp8_keep_list_enters_the_compile_hash(monkeypatch):
    """VLLM_LING_FP8_KEEP picks which linears stay BF16, so it shapes the traced graph too."""
    pytest.importorskip("vllm")
    from vllm_layers import vllm_layer_context
    from vllm_ling import envs, fp8
    from ling_tools.tiny import ensure_tiny

    with vllm_layer_context(str(ensure_tiny(seed=0))) as config:
        seen = []
        for keep in ("", "lm_head", ""):
            monkeypatch.setenv(fp8.KEEP_ENV, keep)
            fp8.keeps_bf16("model.layers.0.self_attn.o_proj")
            seen.append(config.compute_hash())
        assert config.additional_config[envs.COMPILE_KEY][fp8.KEEP_ENV] == ""
    assert seen[0] == seen[2] != seen[1]
