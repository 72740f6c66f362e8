"""Every tensor of a Ling-3.0 checkpoint, from config.json: its name, shape and kind.

The one table behind the tiny-checkpoint writer (`ling_tools.tiny`) and the bytes a decode step reads
(`ling_bench.projection`). Names and shapes are the real checkpoint's (docs/architecture.md §Tensors):
`.attention.` prefixes (vLLM remaps them to `.self_attn.`), unfused per-expert gate/up/down, the MTP
layer as `model.layers.{num_hidden_layers}`. The kind says how a tensor is stored and served:

- `linear`: a BF16 projection (KDA, MLA, dense MLP, shared expert, MTP eh_proj);
- `router`: `mlp.gate.weight`, served in fp32 (docs/architecture.md §MoE; the tiny checkpoints store it BF16);
- `expert`: a routed expert's gate/up/down, the only INT4 tensors of the INT4 checkpoint (§INT4);
- `norm`: an RMSNorm weight (BF16);
- `fp32`: a small fp32 tensor (KDA conv, A_log, dt_bias; the router's expert_bias) (§KDA);
- `embedding`, `lm_head`: the untied vocab matrices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from vllm_ling.layout import Config, config_get, is_mla_layer, is_moe_layer, kda_head_dim, num_mtp_layers

Kind = Literal["linear", "router", "expert", "norm", "fp32", "embedding", "lm_head"]


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    kind: Kind

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(out_features: int, in_features: int, kind: Kind = "linear") -> TensorSpec:
    return TensorSpec((out_features, in_features), kind)


def _norm(width: int) -> TensorSpec:
    return TensorSpec((width,), "norm")


def _fp32(*shape: int) -> TensorSpec:
    return TensorSpec(shape, "fp32")


def kda_tensors(c: Config) -> dict[str, TensorSpec]:
    """A KDA layer's `attention.*` tensors (docs/architecture.md §KDA): P = heads * d."""
    h, heads, k = (config_get(c, key) for key in ("hidden_size", "num_attention_heads", "short_conv_kernel_size"))
    d = kda_head_dim(c)
    p = heads * d
    specs = {f"{x}_proj.weight": _linear(p, h) for x in "qkvfg"}
    specs |= {f"{x}_conv1d.weight": _fp32(p, 1, k) for x in "qkv"}
    specs |= {"b_proj.weight": _linear(heads, h), "A_log": _fp32(heads), "dt_bias": _fp32(p),
              "o_norm.weight": _norm(d), "o_proj.weight": _linear(h, p)}
    return specs


def mla_tensors(c: Config) -> dict[str, TensorSpec]:
    """A gated-MLA layer's `attention.*` tensors (docs/architecture.md §MLA): q_proj, or q_a/q_b when
    `q_lora_rank` is set; a head-wise gate has one output per head."""
    h, heads, r_kv, nope, rope, v = (config_get(c, key) for key in (
        "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_out = heads * (nope + rope)
    if r_q := config_get(c, "q_lora_rank"):
        specs = {"q_a_proj.weight": _linear(r_q, h), "q_a_layernorm.weight": _norm(r_q),
                 "q_b_proj.weight": _linear(q_out, r_q)}
    else:
        specs = {"q_proj.weight": _linear(q_out, h)}
    head_wise = config_get(c, "gated_attention_proj_granularity_type", "head_wise") == "head_wise"
    specs |= {
        "kv_a_proj_with_mqa.weight": _linear(r_kv + rope, h),
        "kv_a_layernorm.weight": _norm(r_kv),
        "kv_b_proj.weight": _linear(heads * (nope + v), r_kv),
        "g_proj.weight": _linear(heads if head_wise else heads * v, h),
        "dense.weight": _linear(h, heads * v),
    }
    return specs


def swiglu_tensors(hidden: int, inter: int, kind: Kind = "linear") -> dict[str, TensorSpec]:
    return {"gate_proj.weight": _linear(inter, hidden, kind), "up_proj.weight": _linear(inter, hidden, kind),
            "down_proj.weight": _linear(hidden, inter, kind)}


def moe_tensors(c: Config) -> dict[str, TensorSpec]:
    """An MoE block's `mlp.*` tensors (docs/architecture.md §MoE): router, shared experts, routed experts."""
    h, e = config_get(c, "hidden_size"), config_get(c, "num_experts")
    shared = config_get(c, "moe_shared_expert_intermediate_size") * config_get(c, "num_shared_experts")
    specs = {"gate.weight": _linear(e, h, "router"), "gate.expert_bias": _fp32(e)}
    specs |= {f"shared_experts.{k}": s for k, s in swiglu_tensors(h, shared).items()}
    expert = swiglu_tensors(h, config_get(c, "moe_intermediate_size"), "expert")
    for j in range(e):
        specs |= {f"experts.{j}.{k}": s for k, s in expert.items()}
    return specs


def layer_tensors(c: Config, layer_idx: int) -> dict[str, TensorSpec]:
    """Decoder layer i's tensors, named under `model.layers.{i}.`, in file order. The MTP layer
    (i >= num_hidden_layers) adds enorm/hnorm/eh_proj before its block and final_layernorm after it
    (docs/architecture.md §MTP)."""
    h = config_get(c, "hidden_size")
    mtp = layer_idx >= config_get(c, "num_hidden_layers")
    specs = {}
    if mtp:
        specs |= {"enorm.weight": _norm(h), "hnorm.weight": _norm(h), "eh_proj.weight": _linear(h, 2 * h)}
    specs["input_layernorm.weight"] = _norm(h)
    attn = mla_tensors(c) if is_mla_layer(c, layer_idx) else kda_tensors(c)
    specs |= {"attention." + k: s for k, s in attn.items()}
    specs["post_attention_layernorm.weight"] = _norm(h)
    mlp = moe_tensors(c) if is_moe_layer(c, layer_idx) else swiglu_tensors(h, config_get(c, "intermediate_size"))
    specs |= {"mlp." + k: s for k, s in mlp.items()}
    if mtp:
        specs["final_layernorm.weight"] = _norm(h)
    return specs


def tensor_specs(c: Config) -> dict[str, TensorSpec]:
    """Every checkpoint tensor, in file order: embedding, layers 0..L-1, the MTP layers, norm, lm_head."""
    h, vocab = config_get(c, "hidden_size"), config_get(c, "vocab_size")
    specs = {"model.word_embeddings.weight": TensorSpec((vocab, h), "embedding")}
    for i in range(config_get(c, "num_hidden_layers") + num_mtp_layers(c)):
        specs |= {f"model.layers.{i}.{k}": s for k, s in layer_tensors(c, i).items()}
    specs |= {"model.norm.weight": _norm(h), "lm_head.weight": TensorSpec((vocab, h), "lm_head")}
    return specs


def param_counts(c: Config) -> dict[str, int]:
    """Parameter counts (docs/architecture.md §Tensors): `main` (without MTP), `mtp`, `total`, and
    `active` per token = every non-routed main parameter except the input embedding + top-k/E of the
    routed ones (public figures: 124.41B, 127.49B, 5.10B for Flash)."""
    n, k, e = (config_get(c, key) for key in ("num_hidden_layers", "num_experts_per_tok", "num_experts"))
    main = mtp = routed = embedding = 0
    for name, spec in tensor_specs(c).items():
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= n:
            mtp += spec.numel
            continue
        main += spec.numel
        routed += spec.numel if spec.kind == "expert" else 0
        embedding += spec.numel if spec.kind == "embedding" else 0
    return {"main": main, "mtp": mtp, "total": main + mtp, "active": main - routed - embedding + routed * k // e}
