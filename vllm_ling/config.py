"""Ling-3.0 (BailingMoeV3) configuration, parsed from the checkpoint's config.json.

The checkpoint says `model_type: bailing_hybrid`, the same string as Ling-2.5, so everything here keys
on `architectures`. transformers >= 5.20 ships its own `BailingHybridConfig`, which rewrites
`head_dim` to `qk_rope_head_dim` (64) and keeps the KDA head size as `linear_head_dim`; our class keeps
config.json's fields as written, and `kda_head_dim()` reads either spelling, so the model is built
right whichever class vLLM resolved.

The layer rule and the config check below read a config object (vLLM's `hf_config`) or the parsed
config.json dict alike (`config_get`), so the plugin, the tiny-checkpoint writer and the byte
projection share one copy of each.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transformers import PretrainedConfig

ARCH = "BailingMoeV3ForCausalLM"
MTP_ARCH = "BailingMoeV3MTPModel"
MODEL_TYPE = "bailing_hybrid"


class BailingMoeV3Config(PretrainedConfig):
    """config.json of Ling-3.0-flash; defaults are the Flash values (docs/architecture.md §Config)."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 157184,
        hidden_size: int = 2560,
        intermediate_size: int = 6144,
        num_hidden_layers: int = 42,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 32,
        head_dim: int = 128,
        layer_group_size: int = 6,
        short_conv_kernel_size: int = 4,
        no_kda_lora: bool = True,
        kda_safe_gate: bool = True,
        kda_lower_bound: float | None = -5.0,
        q_lora_rank: int | None = None,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        rope_interleave: bool = True,
        rope_theta: float = 6_000_000.0,
        rope_scaling: dict | None = None,
        max_position_embeddings: int = 262144,
        gated_attention_proj_granularity_type: str = "head_wise",
        num_experts: int = 512,
        num_experts_per_tok: int = 8,
        n_group: int = 8,
        topk_group: int = 4,
        num_shared_experts: int = 1,
        moe_intermediate_size: int = 768,
        moe_shared_expert_intermediate_size: int = 768,
        first_k_dense_replace: int = 2,
        routed_scaling_factor: float = 2.5,
        norm_topk_prob: bool = True,
        expert_swiglu_limit_list: list[float] | None = None,
        share_expert_swiglu_limit_list: list[float] | None = None,
        num_nextn_predict_layers: int = 1,
        rms_norm_eps: float = 1e-6,
        hidden_act: str = "silu",
        tie_word_embeddings: bool = False,
        pad_token_id: int | None = 156892,
        eos_token_id: int | list[int] | None = 156895,
        **kwargs: Any,
    ) -> None:
        # transformers' native config stores the KDA head size under this name.
        head_dim = kwargs.pop("linear_head_dim", head_dim)
        # partial_rotary_factor (0.5) is present in real configs but must be ignored: the rotary width
        # is qk_rope_head_dim (64), docs/architecture.md §MLA. Keep it out of the attributes vLLM's rope
        # code reads.
        kwargs.pop("partial_rotary_factor", None)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim
        self.layer_group_size = layer_group_size
        self.short_conv_kernel_size = short_conv_kernel_size
        self.no_kda_lora = no_kda_lora
        self.kda_safe_gate = kda_safe_gate
        self.kda_lower_bound = kda_lower_bound
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.rope_interleave = rope_interleave
        self.rope_theta = rope_theta
        self.rope_scaling = rope_scaling
        self.max_position_embeddings = max_position_embeddings
        self.gated_attention_proj_granularity_type = gated_attention_proj_granularity_type
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.n_group = n_group
        self.topk_group = topk_group
        self.num_shared_experts = num_shared_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_shared_expert_intermediate_size = moe_shared_expert_intermediate_size
        self.first_k_dense_replace = first_k_dense_replace
        self.routed_scaling_factor = routed_scaling_factor
        self.norm_topk_prob = norm_topk_prob
        self.expert_swiglu_limit_list = expert_swiglu_limit_list
        self.share_expert_swiglu_limit_list = share_expert_swiglu_limit_list
        self.num_nextn_predict_layers = num_nextn_predict_layers
        self.rms_norm_eps = rms_norm_eps
        self.hidden_act = hidden_act
        super().__init__(
            pad_token_id=pad_token_id,
            eos_token_id=eos_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )


Config = PretrainedConfig | Mapping[str, Any]


def config_get(config: Config, name: str, default: Any = None) -> Any:
    """A config field from a config object or a config.json dict; `default` when absent."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def kda_head_dim(config: Config) -> int:
    """KDA head size d (= d_k = d_v): `linear_head_dim` under transformers' class, else `head_dim`."""
    return int(config_get(config, "linear_head_dim") or config_get(config, "head_dim"))


def num_mtp_layers(config: Config) -> int:
    """MTP layers appended after the main stack (transformers' class calls them `num_mtp_layers`)."""
    value = config_get(config, "num_nextn_predict_layers")
    if value is None:
        value = config_get(config, "num_mtp_layers", 0)
    return int(value or 0)


def is_mla_layer(config: Config, layer_idx: int) -> bool:
    """Layer i is MLA iff (i+1) % G == 0 or i lies in an incomplete final group, else KDA; the MTP
    layers (i >= num_hidden_layers) fall under the second clause, so they are MLA (docs/architecture.md
    §Layers)."""
    group, total = config_get(config, "layer_group_size"), config_get(config, "num_hidden_layers")
    return (layer_idx + 1) % group == 0 or layer_idx >= total // group * group


def is_moe_layer(config: Config, layer_idx: int) -> bool:
    """Layers below `first_k_dense_replace` have a dense SwiGLU MLP, the rest (MTP too) an MoE block."""
    return layer_idx >= config_get(config, "first_k_dense_replace")


def swiglu_limit(limits: list[float] | None, layer_idx: int) -> float | None:
    """Per-layer SwiGLU clamp L; 0, a missing list or an index past its end (the MTP layer) mean none."""
    if not limits or layer_idx >= len(limits) or not limits[layer_idx]:
        return None
    return float(limits[layer_idx])


def mla_rope_parameters(config: PretrainedConfig) -> dict[str, Any]:
    """RoPE for MLA: interleaved pairs over qk_rope_head_dim dims, base rope_theta, no scaling
    (docs/architecture.md §MLA).

    transformers 5 mirrors rope_theta into `rope_parameters` / `rope_scaling` as {"rope_type": "default"}:
    that is no scaling and is accepted; any other rope_type is refused rather than silently ignored.
    """
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"rope scaling {params!r} is not supported by vllm-ling: Ling-3.0-flash has none. "
            "Remove it from config.json or serve the model with a vLLM that has Ling V3 in-tree (>= 0.28)."
        )
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta", 6_000_000.0)
    return {"rope_type": "default", "rope_theta": float(theta)}


def check_supported(config: Config) -> None:
    """Refuse configs this implementation (or the tiny writer) would silently get wrong, naming the
    value and the fix. Absent fields are not judged: transformers' class spells some differently."""
    if not config_get(config, "no_kda_lora", True):
        raise ValueError("no_kda_lora=false (low-rank KDA f/g projections) is not a Ling-3.0 layout and is "
                         "not supported; Ling-3.0 uses full rank (keep it true)")
    granularity = config_get(config, "gated_attention_proj_granularity_type", "head_wise")
    if granularity not in ("head_wise", "element_wise"):
        raise ValueError(f"gated_attention_proj_granularity_type={granularity!r}; "
                         "use 'head_wise' (Flash) or 'element_wise'")
    n = config_get(config, "num_hidden_layers")
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        limits = config_get(config, key)
        if limits is not None and len(limits) != n:  # a short list would leave layers unclamped
            raise ValueError(f"{key} has {len(limits)} entries but num_hidden_layers={n}; "
                             "give one limit per main layer (0 = no clamp)")
    e, groups, topk_group, k = (config_get(config, key) for key in
                                ("num_experts", "n_group", "topk_group", "num_experts_per_tok"))
    if None not in (e, groups, topk_group, k) and (
            e % groups or topk_group > groups or k > topk_group * (e // groups)):
        raise ValueError(
            f"num_experts={e}, n_group={groups}, topk_group={topk_group}, num_experts_per_tok={k}: "
            "need num_experts % n_group == 0, topk_group <= n_group and "
            "num_experts_per_tok <= topk_group * num_experts / n_group")
