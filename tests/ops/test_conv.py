"""causal_conv1d_torch / causal_conv1d_update_torch against F.conv1d, a tap sum and vLLM's CPU conv."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from vllm_ling.ops.conv import causal_conv1d_torch, causal_conv1d_update_torch

D, W = 8, 4  # Ling: D = 3·4096 (q | k | v), W = 4


def make_conv_inputs(lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), D, generator=gen)
    weight = torch.randn(D, W, generator=gen)
    state = torch.randn(len(lens), D, W - 1, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, weight, state, cu


def tap_sum(x_seq: torch.Tensor, weight: torch.Tensor, init: torch.Tensor) -> torch.Tensor:
    """silu(Σ_j w_j ⊙ x_{t-W+1+j}) with x before the sequence taken from init [D, W-1]; x_seq [L, D]."""
    xp = torch.cat([init.T, x_seq])
    L = x_seq.shape[0]
    return F.silu(sum(weight[:, j] * xp[j : j + L] for j in range(W)))


def test_prefill_from_zero_state_matches_padded_conv1d():
    lens = [1, 2, 5, 64]
    x, weight, _, cu = make_conv_inputs(lens)
    y, new_state = causal_conv1d_torch(x, weight, None, cu)
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        ref = F.conv1d(x[bos:eos].T[None], weight[:, None], padding=W - 1, groups=D)[0, :, : eos - bos]
        torch.testing.assert_close(y[bos:eos], F.silu(ref).T)
        tail = torch.cat([torch.zeros(W - 1, D), x[bos:eos]])[-(W - 1) :]
        torch.testing.assert_close(new_state[n], tail.T, rtol=0, atol=0)


def test_prefill_uses_the_carried_state_only_where_flagged():
    lens = [1, 2, 5, 9]
    x, weight, state, cu = make_conv_inputs(lens, seed=1)
    has_init = torch.tensor([True, False, True, True])
    y, new_state = causal_conv1d_torch(x, weight, state, cu, has_init)
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        init = state[n] if has_init[n] else torch.zeros(D, W - 1)
        torch.testing.assert_close(y[bos:eos], tap_sum(x[bos:eos], weight, init))
        torch.testing.assert_close(new_state[n], torch.cat([init, x[bos:eos].T], 1)[:, -(W - 1) :], rtol=0, atol=0)


def test_prefill_leaves_conv_state_untouched_and_keeps_its_dtype():
    x, weight, state, cu = make_conv_inputs([3, 6], seed=2)
    before = state.clone()
    _, new_state = causal_conv1d_torch(x, weight, state.double(), cu, torch.tensor([True, True]))
    assert torch.equal(state, before) and new_state.dtype == torch.float64


def test_split_sequence_carrying_the_state_equals_one_shot():
    """Prefill pieces shorter than W-1 reach into the old state; decode steps continue from the prefill."""
    x, weight, _, _ = make_conv_inputs([20], seed=3)
    y_full, s_full = causal_conv1d_torch(x, weight, None, torch.tensor([0, 20]))
    ys, state = [], torch.zeros(1, D, W - 1)
    for bos, eos in [(0, 1), (1, 3), (3, 11), (11, 14)]:
        y, state = causal_conv1d_torch(x[bos:eos], weight, state, torch.tensor([0, eos - bos]), torch.tensor([True]))
        ys.append(y)
    ys.append(causal_conv1d_update_torch(x[14:17][None], state, weight)[0])  # a 3-token verify step
    ys += [causal_conv1d_update_torch(x[t : t + 1], state, weight) for t in range(17, 20)]  # decode steps
    torch.testing.assert_close(torch.cat(ys), y_full)
    torch.testing.assert_close(state, s_full, rtol=0, atol=0)


def test_update_writes_in_place_through_vllm_sd_layout_view():
    """vLLM's default "SD" cache is [slots, state_len, D]; the kernels get its transpose. Only the first W-1
    columns are conv history; the `num_spec` columns after them and other slots must stay untouched."""
    num_spec = 2
    gen = torch.Generator().manual_seed(4)
    storage = torch.randn(5, W - 1 + num_spec, D, generator=gen)
    before = storage.clone()
    weight, x = torch.randn(D, W, generator=gen), torch.randn(2, D, generator=gen)
    slots = torch.tensor([3, 1])
    y = causal_conv1d_update_torch(x, storage.transpose(-1, -2), weight, conv_state_indices=slots)
    for i, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(y[i], tap_sum(x[i : i + 1], weight, before[slot, : W - 1].T)[0])
        assert torch.equal(storage[slot, : W - 1], torch.cat([before[slot, 1 : W - 1], x[i : i + 1]]))
    untouched = torch.ones_like(storage, dtype=torch.bool)
    untouched[slots, : W - 1] = False
    assert torch.equal(storage[untouched], before[untouched])


def test_activation_none_is_the_linear_conv_and_bias_is_added():
    x, weight, _, cu = make_conv_inputs([6], seed=5)
    bias = torch.randn(D)
    y_lin, _ = causal_conv1d_torch(x, weight, None, cu, activation=None)
    y_silu, _ = causal_conv1d_torch(x, weight, None, cu, activation="silu")
    y_bias, _ = causal_conv1d_torch(x, weight, None, cu, activation=None, bias=bias)
    torch.testing.assert_close(F.silu(y_lin), y_silu)
    torch.testing.assert_close(y_lin + bias, y_bias)
    assert not torch.allclose(y_lin, y_silu)


def test_bf16_input_returns_bf16_and_stores_exact_inputs():
    x, weight, _, cu = make_conv_inputs([5], seed=6)
    y, state = causal_conv1d_torch(x.bfloat16(), weight, None, cu)
    assert y.dtype == state.dtype == torch.bfloat16
    assert torch.equal(state[0], x.bfloat16()[-(W - 1) :].T)


def test_matches_vllm_cpu_conv_ops():
    """vLLM 0.32's own CPU reference ops (x laid out [D, T]), when vLLM is installed."""
    cpu_conv = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d")
    lens = [1, 2, 5, 9]
    x, weight, state, cu = make_conv_inputs(lens, seed=7)
    has_init = torch.tensor([True, False, True, True])
    y, new_state = causal_conv1d_torch(x, weight, state, cu, has_init)
    vllm_state = state.clone()
    y_vllm = cpu_conv.causal_conv1d_fn_cpu(x.T.contiguous(), weight, None, vllm_state, cu, None, has_init, "silu")
    torch.testing.assert_close(y, y_vllm.T)
    torch.testing.assert_close(new_state, vllm_state)

    x_dec = torch.randn(4, D, 3, generator=torch.Generator().manual_seed(8))  # vLLM: [N, D, Tq]
    ours_state, vllm_state = new_state.clone(), new_state.clone()
    y_dec = causal_conv1d_update_torch(x_dec.transpose(1, 2), ours_state, weight)
    y_dec_vllm = cpu_conv.causal_conv1d_update_torch(x_dec, vllm_state, weight, activation="silu")
    torch.testing.assert_close(y_dec, y_dec_vllm.transpose(1, 2))
    torch.testing.assert_close(ours_state, vllm_state)


def test_bad_conv_inputs_raise_errors_that_name_the_value():
    x, weight, state, cu = make_conv_inputs([4], seed=9)
    with pytest.raises(ValueError, match="squeeze"):
        causal_conv1d_torch(x, weight[:, None], None, cu)
    with pytest.raises(ValueError, match="gelu"):
        causal_conv1d_update_torch(x[:1], state, weight, activation="gelu")
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_torch(x, weight, state[:, :, :1], cu, torch.tensor([True]))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update_torch(x[:1], state[:, :4], weight)
