"""The MoE block inside the real engine, with its SwiGLU clamps on, against a hand-written fp64 reference.

transformers has no clamps, so this is where they are pinned: the engine's MoE output for layers with
routed and shared clamps equals the equations of docs/architecture.md §MoE computed here from the
checkpoint's tensors; the same reference without clamps, without group-limited routing, or with the routed
clamp in the other form (SiLU(min(g, L)), vLLM 0.33's fused-MoE clamp), does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from references import checkpoint_tensors as _tensors, moe_reference, swiglu_silu_of_min
from shared_engines import BF16_CLAMPED, declare

from vllm.config import VllmConfig, set_current_vllm_config

from vllm_ling.moe import ClampedSiluAndMul, swiglu

LAYERS = [3, 4, 5]  # clamps in the tiny config: routed L=1.0 at 4, 5; shared L=1.25 at 3, 4 and 1.5 at 5
REL_TOL = 1e-4


def test_shared_expert_swiglu_hand_computed():
    """min(SiLU(g), L) · clamp(u, −L, L), by hand for L = 1: SiLU(3) = 2.8577 -> 1; u = −2 -> −1.

    The clamped form is vLLM's SwigluStepAndMul asked to compile its native form (one kernel inside the
    FusedMoE op); without a limit it is vLLM's SiluAndMul.
    """
    gate_up = torch.tensor([[3.0, 0.5, -2.0, 0.5]])  # g = [3, 0.5], u = [-2, 0.5]
    silu_half = 0.5 / (1 + torch.exp(torch.tensor(-0.5)))
    with set_current_vllm_config(VllmConfig()):
        clamped, plain = swiglu(1.0), swiglu(None)
    assert isinstance(clamped, ClampedSiluAndMul) and clamped.limit == 1.0
    torch.testing.assert_close(clamped(gate_up), torch.tensor([[-1.0, silu_half * 0.5]]))
    torch.testing.assert_close(plain(gate_up), F.silu(gate_up[:, :2]) * gate_up[:, 2:])


# one 96-token prompt, prefilled in two chunks (shared_engines.CHUNKED), then two decode steps
CAPTURE = declare(BF16_CLAMPED, "moe-capture", prompts=[[(37 * i + 11) % 590 + 10 for i in range(96)]], max_tokens=3,
                  capture_mlp_layers=LAYERS, capture_path="mlp.pt", prompt_logprobs=False)


@pytest.fixture(scope="module")
def captured(shared_engine):
    return torch.load(shared_engine(CAPTURE)["capture_path"])


@pytest.mark.engine
@pytest.mark.parametrize("layer", LAYERS)
def test_engine_moe_matches_reference_with_clamps(captured, tiny_bf16, layer):
    cfg = json.loads((Path(tiny_bf16) / "config.json").read_text())
    w = _tensors(tiny_bf16, f"model.layers.{layer}.mlp.")
    for x, y in captured[f"mlp{layer}"]:  # prefill, then each decode step
        want = moe_reference(x, w, cfg, layer)
        err = ((y.double() - want).norm() / want.norm()).item()
        assert err < REL_TOL, f"layer {layer}: relative error {err:.2e} against the clamped reference"


@pytest.mark.engine
@pytest.mark.parametrize("layer", LAYERS)
def test_reference_without_clamps_or_groups_is_caught(captured, tiny_bf16, layer):
    """The comparison above can fail: dropping the clamps or the group limit moves the output far."""
    cfg = json.loads((Path(tiny_bf16) / "config.json").read_text())
    w = _tensors(tiny_bf16, f"model.layers.{layer}.mlp.")
    x, y = captured[f"mlp{layer}"][0]
    for broken in (dict(clamps=False), dict(groups=False)):
        want = moe_reference(x, w, cfg, layer, **broken)
        err = ((y.double() - want).norm() / want.norm()).item()
        assert err > 100 * REL_TOL, f"layer {layer}: {broken} still matched (error {err:.2e})"


@pytest.mark.engine
@pytest.mark.parametrize("layer", [4, 5])
def test_routed_clamp_form_is_the_trained_one(captured, tiny_bf16, layer):
    """The CPU engine's routed experts clamp as min(SiLU(g), L) · clamp(u, ±L): the other form,
    SiLU(min(g, L)) · clamp(u, ±L), differs on the same weights wherever a gate exceeds L = 1 (SiLU(1) = 0.73)."""
    cfg = json.loads((Path(tiny_bf16) / "config.json").read_text())
    assert cfg["expert_swiglu_limit_list"][layer] == 1.0, "the tiny config's routed clamp moved; pick its layers"
    w = _tensors(tiny_bf16, f"model.layers.{layer}.mlp.")
    for x, y in captured[f"mlp{layer}"]:
        other = moe_reference(x, w, cfg, layer, routed_swiglu=swiglu_silu_of_min)
        err = ((y.double() - other).norm() / other.norm()).item()
        assert err > 100 * REL_TOL, f"layer {layer}: the SiLU(min(g, L)) form matched too (error {err:.2e})"
