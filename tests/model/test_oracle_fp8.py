"""The FP8 reference's rule (oracle.py `fp8_targets`): which linears it rounds, alone and as a served merged group.
Session 15's vLLM 0.33 run scored the in-tree model, whose KDA q|k|v|β is one 1,540-wide linear kept BF16, against
a reference that rounded q, k and v: the rule now takes each implementation's merged layout (model_helpers)."""

from __future__ import annotations

import sys

import pytest
import torch

from model_helpers import FP8_MERGED


@pytest.fixture
def oracle():
    """oracle.py hides `fla` from transformers at import; this process keeps it for the op tests."""
    saved = {name: sys.modules.get(name) for name in ("fla", "causal_conv1d", "oracle")}
    import oracle as module

    yield module
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod


def _model(beta: int = 4) -> torch.nn.Module:
    """A KDA-like layer (q, k, v of 512, β of `beta`, f nested as in transformers), an MLA-like one (q_proj without
    siblings k/v/b, a 4-wide head-wise gate, kv_b) and a head."""
    lin = torch.nn.Linear
    kda = torch.nn.Module()
    for name, width in (("q_proj", 512), ("k_proj", 512), ("v_proj", 512), ("b_proj", beta), ("o_proj", 256)):
        setattr(kda, name, lin(256, width, bias=False))
    kda.forget_gate = torch.nn.Module()
    kda.forget_gate.f_proj = lin(256, 512, bias=False)
    mla = torch.nn.Module()
    for name, width in (("q_proj", 768), ("g_proj", 4), ("kv_b_proj", 1024)):
        setattr(mla, name, lin(256, width, bias=False))
    model = torch.nn.Module()
    model.kda, model.mla, model.lm_head = kda, mla, lin(256, 2048, bias=False)
    return model


ALWAYS = {"kda.o_proj", "kda.forget_gate.f_proj", "mla.q_proj", "lm_head"}
QKV = {"kda.q_proj", "kda.k_proj", "kda.v_proj"}


def test_alone_every_linear_16_aligned_is_rounded_but_kv_b(oracle):
    assert set(oracle.fp8_targets(_model())) == ALWAYS | QKV


def test_ours_padded_in_proj_rounds_beta_with_q_k_v(oracle):
    assert set(oracle.fp8_targets(_model(), FP8_MERGED["vllm-ling"])) == ALWAYS | QKV | {"kda.b_proj"}


def test_the_in_tree_unaligned_qkvb_keeps_all_four(oracle):
    assert set(oracle.fp8_targets(_model(), FP8_MERGED["vllm"])) == ALWAYS


def test_the_in_tree_aligned_qkvb_rounds_all_four(oracle):
    """Ling-3.0-flash's case in small: q|k|v|β summing to a multiple of 16 (here β 16 wide)."""
    assert set(oracle.fp8_targets(_model(beta=16), FP8_MERGED["vllm"])) == ALWAYS | QKV | {"kda.b_proj"}


def test_apply_rounds_exactly_the_targets(oracle):
    model = _model()
    before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    names = oracle.apply_fp8(model, "w8a8", FP8_MERGED["vllm"])
    changed = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and not torch.equal(m.weight, before[n])}
    assert changed == set(names) == ALWAYS
