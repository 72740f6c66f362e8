"""kda_safe_gate / kda_softplus_gate against flash-linear-attention 0.6.0's naive gates."""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.kda import kda_safe_gate, kda_softplus_gate

H, K, T = 4, 16, 37


def make_gate_inputs(seed: int = 0, dtype: torch.dtype = torch.float32, spread: float = 3.0):
    """f [T, H*K], A_log [H], dt_bias [H*K] in `dtype` (the checkpoint keeps A_log, dt_bias in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    f = (torch.randn(T, H * K, generator=gen) * spread).to(dtype)
    return f, torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)


def test_safe_gate_matches_fla_lowerbound_gate(fla_gate):
    f, A_log, dt_bias = make_gate_inputs()
    ref = fla_gate.naive_kda_lowerbound_gate(f.view(T, H, K), A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(kda_safe_gate(f, A_log, dt_bias), ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kda_safe_gate(f.view(T, H, K), A_log, dt_bias), ref, rtol=1e-6, atol=1e-6)


def test_softplus_gate_matches_fla_kimi_gate(fla_gate):
    f, A_log, dt_bias = make_gate_inputs(seed=1, spread=15.0)  # crosses the softplus threshold of 20
    ref = fla_gate.naive_kda_gate(f.view(T, H, K), A_log, dt_bias)
    torch.testing.assert_close(kda_softplus_gate(f, A_log, dt_bias), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safe_gate_is_fp32_and_inside_lower_bound_and_zero(dtype):
    """g ∈ (-5, 0); fp32 sigmoid rounds to exactly 0 or 1 once |exp(A_log)·(f + dt_bias)| ≳ 17, so the
    bounds themselves are reachable, never crossed."""
    f, A_log, dt_bias = make_gate_inputs(seed=2, dtype=dtype)
    g = kda_safe_gate(f, A_log, dt_bias)
    assert g.dtype == torch.float32 and g.shape == (T, H, K)
    assert bool(((g >= -5.0) & (g <= 0.0)).all()), f"g spans [{g.min():.4g}, {g.max():.4g}], outside [-5, 0]"
    unsaturated = (A_log.exp()[:, None] * (f.float().view(T, H, K) + dt_bias.view(H, K))).abs() < 15
    assert unsaturated.float().mean() > 0.5
    assert bool(((g > -5.0) & (g < 0.0))[unsaturated].all())
    extreme = kda_safe_gate(torch.tensor([[1e4], [-1e4]]).expand(2, H * K).to(dtype), A_log, dt_bias)
    assert bool(((extreme >= -5.0) & (extreme <= 0.0)).all())


def test_safe_gate_from_bf16_is_not_rounded_to_bf16():
    """The gate keeps fp32 resolution even for a bf16 projection: decays compound over the whole sequence."""
    f, A_log, dt_bias = make_gate_inputs(seed=3, dtype=torch.bfloat16)
    g = kda_safe_gate(f, A_log, dt_bias)
    assert torch.equal(g, kda_safe_gate(f.float(), A_log, dt_bias))
    assert not torch.equal(g, g.bfloat16().float())


def test_lower_bound_scales_the_range():
    f, A_log, dt_bias = make_gate_inputs(seed=4)
    torch.testing.assert_close(kda_safe_gate(f, A_log, dt_bias, lower_bound=-2.0),
                               kda_safe_gate(f, A_log, dt_bias) * 0.4)


def test_safe_and_softplus_gates_differ():
    """Negative control: running Kimi's law instead of Ling's must be visible."""
    f, A_log, dt_bias = make_gate_inputs(seed=5)
    diff = (kda_safe_gate(f, A_log, dt_bias) - kda_softplus_gate(f, A_log, dt_bias)).abs()
    assert diff.max() > 1.0 and diff.mean() > 0.1


def test_legacy_4d_A_log_is_accepted():
    f, A_log, dt_bias = make_gate_inputs(seed=6)
    assert torch.equal(kda_safe_gate(f, A_log.view(1, 1, H, 1), dt_bias), kda_safe_gate(f, A_log, dt_bias))


def test_bad_gate_inputs_raise_errors_that_name_the_value():
    f, A_log, dt_bias = make_gate_inputs(seed=7)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_safe_gate(f, A_log, dt_bias, lower_bound=5.0)
    with pytest.raises(ValueError, match="H=3"):
        kda_safe_gate(f, A_log[:3], dt_bias)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_softplus_gate(f, A_log, dt_bias[:-1])
    with pytest.raises(ValueError, match=r"\[\.\.\., H, K\]"):
        kda_safe_gate(f.view(T, 2, -1), A_log, dt_bias)
