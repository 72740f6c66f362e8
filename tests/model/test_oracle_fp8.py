"""The FP8 reference's rule (oracle.py `fp8_targets`): which linears it rounds, alone and as a served merged group,
and how (per output row, or per 128 x 128 block). A vLLM 0.33 run once scored the in-tree model, whose KDA q|k|v|β
is one 1,540-wide linear kept BF16, against a reference that rounded q, k and v: the rule takes each
implementation's merged layout (model_helpers)."""

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
    """A KDA-like layer (q, k, v, g of 512, β of `beta`, f nested as in transformers), an MLA-like one (q_proj
    without siblings k/v/b, a 4-wide head-wise gate, kv_b) and a head."""
    lin = torch.nn.Linear
    kda = torch.nn.Module()
    for name, width in (("q_proj", 512), ("k_proj", 512), ("v_proj", 512), ("b_proj", beta), ("o_proj", 256),
                        ("g_proj", 512)):
        setattr(kda, name, lin(256, width, bias=False))
    kda.forget_gate = torch.nn.Module()
    kda.forget_gate.f_proj = lin(256, 512, bias=False)
    mla = torch.nn.Module()
    for name, width in (("q_proj", 768), ("g_proj", 4), ("kv_b_proj", 1024)):
        setattr(mla, name, lin(256, width, bias=False))
    model = torch.nn.Module()
    model.kda, model.mla, model.lm_head = kda, mla, lin(256, 2048, bias=False)
    return model


ALWAYS = {"kda.o_proj", "kda.forget_gate.f_proj", "kda.g_proj", "mla.q_proj", "lm_head"}
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


def test_block_rounds_a_merged_group_as_one_weight_across_its_parts(oracle):
    """Ours serves q|k|v|β|f|g as one in_proj: with β 4 rows wide, the block holding β holds f's first 124 rows,
    so f's first rows share β's scale. The oracle's f must equal the block rounding of the concatenated weight,
    not of f alone (which, f's rows being 100x smaller than β's, it visibly is not)."""
    torch.manual_seed(0)
    model = _model()
    model.kda.b_proj.weight.data *= 100
    parts = [model.kda.q_proj, model.kda.k_proj, model.kda.v_proj, model.kda.b_proj, model.kda.forget_gate.f_proj,
             model.kda.g_proj]
    whole = torch.cat([m.weight.detach().clone() for m in parts])
    f_alone = oracle._e4m3_blocks(model.kda.forget_gate.f_proj.weight.detach().clone())
    oracle.apply_fp8(model, "w8a16", FP8_MERGED["vllm-ling"], scheme="block")
    want = oracle._e4m3_blocks(whole)[1540:2052]
    assert torch.equal(model.kda.forget_gate.f_proj.weight, want)
    assert (want[:124] - f_alone[:124]).abs().max() > 0.01 * f_alone[:124].abs().max()


def test_block_scales_are_per_128_by_128_block_and_differ_from_channel(oracle):
    """One block of 128 rows x 128 inputs, half its rows 1e5 times smaller: per block they share the big rows'
    scale and fall into e4m3's subnormals (a step as large as themselves); per channel each keeps 3 mantissa bits.
    The next 128 inputs are a block of their own."""
    torch.manual_seed(1)
    w = torch.randn(128, 256)
    w[64:] *= 1e-5
    block, channel = oracle._e4m3_blocks(w), oracle._e4m3_rows(w)
    small = slice(64, 128)
    assert (block[small] - w[small]).abs().mean() > 4 * (channel[small] - w[small]).abs().mean()
    w2 = w.clone()
    w2[:, 128:] *= 1000  # the second column block alone changes scale: the first block's rounding stays
    assert torch.equal(oracle._e4m3_blocks(w2)[:, :128], block[:, :128])


def test_block_rounds_inputs_per_token_per_group_of_128(oracle):
    x = torch.cat([torch.randn(3, 128), torch.randn(3, 128) / 1000], dim=1)
    grouped = oracle._e4m3_groups(x)
    assert torch.equal(grouped[:, :128], oracle._e4m3_rows(x[:, :128], oracle.ACT_FLOOR))
    assert torch.equal(grouped[:, 128:], oracle._e4m3_rows(x[:, 128:], oracle.ACT_FLOOR))
    assert not torch.equal(grouped, oracle._e4m3_rows(x, oracle.ACT_FLOOR))


def test_block_keeps_a_linear_whose_input_is_no_multiple_of_128(oracle):
    model = _model()
    model.kda.o_proj = torch.nn.Linear(192, 256, bias=False)
    assert "kda.o_proj" in oracle.fp8_targets(model, scheme="channel")
    assert "kda.o_proj" not in oracle.fp8_targets(model, scheme="block")
