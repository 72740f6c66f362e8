"""Ling-3.0 MLPs (ling3-architecture.md §5): the dense SwiGLU of the first layers and the MoE block.

Router, fp32: s = σ(W_r x); experts are *selected* by s + b (b = expert_bias, noaux_tc) among the
top-4 of 8 groups scored by the sum of their top-2 biased scores, top-8 overall; the *weights* are the
unbiased s renormalised over the top-8, times 2.5. One shared expert is added unweighted.
Per-layer SwiGLU clamps L (trained in; 0 means none):
  shared expert  min(SiLU(g), L) ⊙ clamp(u, −L, L)
  routed experts SiLU(min(g, L)) ⊙ clamp(u, −L, L)   (vLLM's fused-MoE clamp, as the vendor's vLLM fork)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.linear import MergedColumnParallelLinear, ReplicatedLinear, RowParallelLinear

from vllm_ling import compat
from vllm_ling.config import swiglu_limit


def clamped_swiglu(gate_up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """[..., 2I] -> [..., I]: SiLU(g)·u, or min(SiLU(g), L)·clamp(u, ±L) when L is set."""
    g, u = gate_up.chunk(2, dim=-1)
    if limit is None:
        return F.silu(g) * u
    return F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)


class BailingMoeV3MLP(nn.Module):
    """SwiGLU MLP: the dense layers (< first_k_dense_replace) and the shared expert."""

    def __init__(self, config, intermediate_size: int, quant_config, prefix: str, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size] * 2, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, config.hidden_size, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_up_proj(x)[0], self.limit))[0]


class BailingMoeV3MoE(nn.Module):
    def __init__(self, config, quant_config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        num_experts = config.num_experts
        # Router stays fp32 and unquantized (it is in every checkpoint's ignore list).
        self.gate = ReplicatedLinear(
            config.hidden_size, num_experts, bias=False, params_dtype=torch.float32,
            quant_config=None, prefix=f"{prefix}.gate",
        )
        self.gate.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        self.shared_experts = BailingMoeV3MLP(
            config, config.moe_shared_expert_intermediate_size * config.num_shared_experts, quant_config,
            f"{prefix}.shared_experts", swiglu_limit(config.share_expert_swiglu_limit_list, layer_idx),
        )
        self.routed_limit = swiglu_limit(config.expert_swiglu_limit_list, layer_idx)
        self.experts = compat.fused_moe_factory()(
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            use_grouped_topk=True,
            num_expert_group=config.n_group,
            topk_group=config.topk_group,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            scoring_func="sigmoid",
            routed_scaling_factor=config.routed_scaling_factor,
            e_score_correction_bias=self.gate.expert_bias,
            swiglu_limit=self.routed_limit,
            router_logits_dtype=torch.float32,
            activation="silu",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits, _ = self.gate(x.float())  # fp32 router (fp32 weights, fp32 input)
        routed = self.experts(hidden_states=x, router_logits=router_logits)
        return routed + self.shared_experts(x)
