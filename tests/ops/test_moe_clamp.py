"""Ling-3.0's routed-expert SwiGLU clamp: min(SiLU(g), L) · clamp(u, ±L) (docs/architecture.md §MoE).

The CPU path (`routed_experts`) against an fp64 hand computation, the other form (SiLU(min(g, L))) shown to
differ, and the release seam in compat that picks vLLM's fused-MoE activation and mends Humming's fixed L = 7.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version

from vllm_ling import compat
from vllm_ling.ops.moe import clamped_swiglu, routed_experts

E, H, I, T, K = 8, 64, 32, 12, 3


def test_clamped_swiglu_by_hand():
    """L = 1: g = 3 -> min(SiLU(3) = 2.858, 1) = 1 (the other form gives SiLU(1) = 0.731); u = -2 -> -1."""
    g, u = torch.tensor([3.0, 0.5, 1.2]), torch.tensor([-2.0, 0.5, 0.8])
    silu = lambda v: v / (1 + math.exp(-v))  # noqa: E731
    want = torch.tensor([1.0 * -1.0, silu(0.5) * 0.5, min(silu(1.2), 1.0) * 0.8])
    torch.testing.assert_close(clamped_swiglu(g, u, 1.0), want)
    torch.testing.assert_close(clamped_swiglu(g, u, None), F.silu(g) * u)


def _experts() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) * 2 / H**0.5  # gate/up pre-activations of std ~2
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    return x, w13, w2, weights, ids


def _reference(x, w13, w2, weights, ids, act) -> torch.Tensor:
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(T):
        for j in range(K):
            g, u = (w13[ids[t, j]] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[ids[t, j]] @ act(g, u))
    return out


@pytest.mark.parametrize("limit", [1.0, 4.0])
def test_routed_experts_compute_the_trained_form(limit):
    x, w13, w2, weights, ids = _experts()
    got = routed_experts(x, w13, w2, weights, ids, limit).double()
    trained = _reference(x, w13, w2, weights, ids, lambda g, u: F.silu(g).clamp(max=limit) * u.clamp(-limit, limit))
    other = _reference(x, w13, w2, weights, ids, lambda g, u: F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit))
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got, trained) < 1e-5
    # the gap the other form opens is measurable at both limits, and larger where 1 - σ(L) is (L = 1)
    assert rel(got, other) > (3e-2 if limit == 1.0 else 1e-4), rel(got, other)


def test_clamp_form_gap_is_one_minus_sigmoid():
    """Where g > L, SiLU(min(g, L)) = σ(L)·L while the trained form reaches L: low by 1 − σ(L) at most."""
    for limit in (1.0, 4.0):
        g = torch.tensor([limit + 50.0])
        served = F.silu(g.clamp(max=limit))
        trained = F.silu(g).clamp(max=limit)
        assert math.isclose(1 - (served / trained).item(), compat.clamp_form_gap(limit), rel_tol=1e-5)
    assert round(100 * compat.clamp_form_gap(4.0), 1) == 1.8


@pytest.mark.parametrize("release, activation, form", [
    ("0.33.0", "silu", compat.CLAMP_SILU_OF_MIN), ("0.34.0", "swiglustep", compat.CLAMP_TRAINED),
    ("0.35.1", "swiglustep", compat.CLAMP_TRAINED),
])
def test_routed_clamp_activation_per_release(monkeypatch, release, activation, form):
    monkeypatch.setattr(compat, "vllm_version", lambda: Version(release))
    assert compat.routed_clamp_activation() == (activation, form)


def test_routed_activation_warns_once_where_the_trained_form_is_missing(monkeypatch, caplog):
    from vllm_ling import moe

    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.33.0"))
    monkeypatch.setattr(moe, "_clamp_notes", set())
    with caplog.at_level(logging.WARNING, logger="vllm_ling"):
        assert [moe.routed_activation(4.0) for _ in range(3)] == ["silu"] * 3
        assert moe.routed_activation(None) == "silu"
    notes = [r.getMessage() for r in caplog.records if "swiglu_limit" in r.getMessage()]
    assert len(notes) == 1 and "1.8%" in notes[0], notes


# Humming's expression for swiglustep in vLLM 0.33 and 0.34 (quantization/utils/humming/activation.py)
HUMMING_SWIGLUSTEP = """[](float a, float b) {
            const float activated_gate = a / (1.f + expf(-a));
            const float gate = fminf(activated_gate, 7.f);
            const float up = fmaxf(fminf(b, 7.f), -7.f);
            return gate * up;
        }(a, b)"""


class _Act:
    def __init__(self, value: str) -> None:
        self.value = value


class _Cfg:
    def __init__(self, clamp_limit) -> None:
        self.clamp_limit = clamp_limit


def test_humming_swiglustep_takes_the_layer_limit():
    def original(activation, config=None):
        return {"activation_type": "binary_split", "activation_impl": HUMMING_SWIGLUSTEP if
                activation.value == "swiglustep" else "(a) * b"}

    patched = compat._humming_with_limit(original)
    impl = patched(_Act("swiglustep"), _Cfg(4.0))["activation_impl"]
    assert "7.f" not in impl and impl.count("(4.0f)") == 3
    assert patched(_Act("swiglustep"), _Cfg(None))["activation_impl"] == HUMMING_SWIGLUSTEP
    assert patched(_Act("silu"), _Cfg(4.0))["activation_impl"] == "(a) * b"


def test_humming_swiglustep_refuses_an_unknown_expression():
    patched = compat._humming_with_limit(lambda a, c=None: {"activation_impl": "fminf(g, 9.f)"})
    with pytest.raises(RuntimeError, match="--moe-backend marlin or triton"):
        patched(_Act("swiglustep"), _Cfg(4.0))
