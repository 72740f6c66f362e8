"""The MoE block inside the real engine, with its SwiGLU clamps on, against a hand-written fp64 reference.

transformers has no clamps, so this is where they are pinned: the engine's MoE output for layers with
routed and shared clamps equals the equations of ling3-architecture.md §5 computed here from the
checkpoint's tensors; the same reference without clamps, or without group-limited routing, does not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from vllm_ling.moe import clamped_swiglu

pytestmark = pytest.mark.engine

LAYERS = [3, 4, 5]  # clamps in the tiny config: routed L=1.0 at 4, 5; shared L=1.25 at 3, 4 and 1.5 at 5
REL_TOL = 1e-4


def test_clamped_swiglu_hand_computed():
    """min(SiLU(g), L) · clamp(u, −L, L), by hand for L = 1: SiLU(3) = 2.8577 -> 1; u = −2 -> −1."""
    gate_up = torch.tensor([[3.0, 0.5, -2.0, 0.5]])  # g = [3, 0.5], u = [-2, 0.5]
    silu_half = 0.5 / (1 + torch.exp(torch.tensor(-0.5)))
    torch.testing.assert_close(clamped_swiglu(gate_up, 1.0), torch.tensor([[-1.0, silu_half * 0.5]]))
    torch.testing.assert_close(clamped_swiglu(gate_up, None), F.silu(gate_up[:, :2]) * gate_up[:, 2:])


def _tensors(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if name.startswith(prefix):
            with safe_open(str(Path(model_dir) / shard), "pt") as f:
                out[name.removeprefix(prefix)] = f.get_tensor(name).double()
    return out


def moe_reference(x: torch.Tensor, w: dict, cfg: dict, layer: int, clamps: bool = True, groups: bool = True):
    """Ling-3.0 MoE (§5) in fp64: grouped noaux_tc routing, renormalised ×2.5, clamped SwiGLUs, shared expert."""
    x = x.double()
    n_exp, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    n_group, top_groups = (cfg["n_group"], cfg["topk_group"]) if groups else (1, 1)
    scores = torch.sigmoid(x @ w["gate.weight"].T)
    biased = scores + w["gate.expert_bias"]
    group_score = biased.view(-1, n_group, n_exp // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(top_groups, -1).indices, True)
    biased = biased.masked_fill(~keep.repeat_interleave(n_exp // n_group, dim=1), float("-inf"))
    idx = biased.topk(k, dim=-1).indices
    weights = scores.gather(1, idx)
    weights = weights / weights.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    lim_r = cfg["expert_swiglu_limit_list"][layer] or None if clamps else None
    lim_s = cfg["share_expert_swiglu_limit_list"][layer] or None if clamps else None

    def expert(prefix: str, h: torch.Tensor, limit, routed: bool) -> torch.Tensor:
        g, u = h @ w[f"{prefix}.gate_proj.weight"].T, h @ w[f"{prefix}.up_proj.weight"].T
        if limit is None:
            a = F.silu(g) * u
        elif routed:  # vLLM's fused-MoE clamp: SiLU(min(g, L)) · clamp(u, ±L)
            a = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)
        else:  # shared expert: min(SiLU(g), L) · clamp(u, ±L)
            a = F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)
        return a @ w[f"{prefix}.down_proj.weight"].T

    out = expert("shared_experts", x, lim_s, routed=False)
    for t in range(x.shape[0]):
        for j in range(k):
            out[t] += weights[t, j] * expert(f"experts.{int(idx[t, j])}", x[t : t + 1], lim_r, routed=True)[0]
    return out


@pytest.fixture(scope="module")
def captured(run_engine, tiny_bf16, tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "mlp.pt"
    prompt = [(37 * i + 11) % 590 + 10 for i in range(96)]
    run_engine({"model": tiny_bf16, "prompts": [prompt], "max_tokens": 3, "capture_mlp_layers": LAYERS,
                "capture_path": str(path), "prompt_logprobs": False}, "moe-capture")
    return torch.load(path)


@pytest.mark.parametrize("layer", LAYERS)
def test_engine_moe_matches_reference_with_clamps(captured, tiny_bf16, layer):
    cfg = json.loads((Path(tiny_bf16) / "config.json").read_text())
    w = _tensors(tiny_bf16, f"model.layers.{layer}.mlp.")
    for x, y in captured[f"mlp{layer}"]:  # prefill, then each decode step
        want = moe_reference(x, w, cfg, layer)
        err = ((y.double() - want).norm() / want.norm()).item()
        assert err < REL_TOL, f"layer {layer}: relative error {err:.2e} against the clamped reference"


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
