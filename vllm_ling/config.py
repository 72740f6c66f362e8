"""Ling-3.0 (BailingMoeV3) configuration, parsed from the checkpoint's config.json.

The checkpoint says `model_type: bailing_hybrid`, the same string as Ling-2.5/2.6, and vLLM's config
registry (where the plugin puts our class) keys on that string, so our class parses every
`bailing_hybrid` checkpoint. It therefore keeps config.json's fields exactly as written, and fills in the
Flash values for absent fields only when `architectures` names Ling-3.0: a Ling-2.5 config comes out as
its own class reads it (docs/architecture.md §Config has the table). transformers >= 5.20 ships its own
`BailingHybridConfig`, which rewrites `head_dim` to `qk_rope_head_dim` (64) and keeps the KDA head size as
`linear_head_dim`; `kda_head_dim()` reads either spelling, so the model is built right whichever class
vLLM resolved.

The config check below reads a config object (vLLM's `hf_config`) or the parsed config.json dict alike
(`vllm_ling.layout.config_get`, where the layer layout lives, free of torch and transformers), so the plugin and
the tiny-checkpoint writer share one copy of it.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from transformers import PretrainedConfig

from vllm_ling.configs import flash_config
from vllm_ling.layout import Config, config_get

ARCH = "BailingMoeV3ForCausalLM"
MTP_ARCH = "BailingMoeV3MTPModel"
MODEL_TYPE = "bailing_hybrid"

# config.json keys that say where a file came from or how its weights are stored, not what the model is:
# never filled in as defaults.
_PROVENANCE_KEYS = ("architectures", "auto_map", "model_type", "quantization_config", "torch_dtype",
                    "transformers_version")


@functools.cache
def _flash_fields() -> dict[str, Any]:
    """The model fields of the bundled Flash config.json (vllm_ling/configs): the defaults of a Ling-3.0 config."""
    return {k: v for k, v in flash_config().items() if k not in _PROVENANCE_KEYS}


def is_ling3(architectures: list[str] | None) -> bool:
    """True for a Ling-3.0 config (or one that names no architecture, e.g. `BailingMoeV3Config()`)."""
    return not architectures or bool({ARCH, MTP_ARCH} & set(architectures))


class BailingMoeV3Config(PretrainedConfig):
    """config.json of Ling-3.0-flash, every field kept as written (docs/architecture.md §Config).

    A Ling-3.0 config gets the Flash values (the bundled config.json) for fields it lacks; any other
    `bailing_hybrid` architecture (Ling-2.5/2.6) gets none, so what its vLLM model reads with `getattr(config,
    name, default)` falls back to that model's own default, as under the checkpoint's own class.
    """

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, **kwargs: Any) -> None:
        if "linear_head_dim" in kwargs:  # transformers' native class stores the KDA head size under this name
            kwargs["head_dim"] = kwargs.pop("linear_head_dim")
        if is_ling3(kwargs.get("architectures")):
            kwargs = {**copy.deepcopy(_flash_fields()), **kwargs}
        # PretrainedConfig folds rope_theta / partial_rotary_factor / rope_scaling into `rope_parameters` (and
        # pops them) when that attribute exists, as transformers' own class does: set it first, and keep
        # rope_theta and partial_rotary_factor as attributes too, as the checkpoints' own classes do.
        # partial_rotary_factor (0.5) is not Ling-3.0's MLA rotary width: mla_rope_parameters() ignores it.
        # transformers 5 also pops generation keys (use_cache), which the checkpoints' classes keep.
        self.rope_parameters = kwargs.pop("rope_parameters", None)
        for name in ("rope_theta", "partial_rotary_factor", "use_cache"):
            if name in kwargs:
                setattr(self, name, kwargs[name])
        super().__init__(**kwargs)


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


# Keys a Ling-3.0 config.json carries (most from the Ling-2.5 lineage) that the checkpoint's own modeling code
# reads as fixed or not at all, with what their Flash value means for the model we implement. Only the Flash
# value (the bundled config.json) is accepted: a config that changes one asks for a different model.
FLASH_ONLY_FIELDS: dict[str, str] = {
    "use_bias": "no bias on any projection",
    "use_qkv_bias": "no bias on the attention projections",
    "use_qk_norm": "KDA L2-normalises q and k per head, with no norm weights",
    "linear_silu": "KDA applies SiLU after its short convolution",
    "group_norm_size": "KDA's output RMSNorm runs per head",
    "num_kv_heads_for_linear_attn": "KDA has as many key/value heads as query heads",
    "use_kda_lora": "KDA's f/g projections are full rank",
    "use_mla_nope": "MLA rotates qk_rope_head_dim dims of q and k",
    "value_norm": "no norm on KDA's values",
    "up_proj_norm": "no norm on the MLP's up projection",
    "use_nGPT": "a plain pre-norm residual stream",
    "scale_router_input": "the router reads the normed hidden state unscaled",
}


def _check_flash_only_fields(config: Config) -> None:
    flash = _flash_fields()
    for key, meaning in FLASH_ONLY_FIELDS.items():
        value = config_get(config, key)
        if value is not None and value != flash[key]:
            raise ValueError(
                f"{key}={value!r} is not Ling-3.0-flash's model: vllm-ling implements {key}={flash[key]!r} "
                f"({meaning}). Serve this checkpoint with its own modeling code, or set {key}={flash[key]!r} "
                "if the checkpoint was written with that value by mistake")
    rope, nope = config_get(config, "qk_rope_head_dim"), config_get(config, "qk_nope_head_dim")
    derived = {"rotary_dim": rope, "qk_head_dim": None if None in (rope, nope) else rope + nope}
    for key, want in derived.items():
        value = config_get(config, key)
        if None not in (value, want) and value != want:
            raise ValueError(f"{key}={value} contradicts qk_nope_head_dim={nope}, qk_rope_head_dim={rope}: MLA "
                             f"needs {key}={want}; fix config.json")


def check_supported(config: Config) -> None:
    """Refuse configs this implementation (or the tiny writer) would silently get wrong, naming the
    value and the fix. Absent fields are not judged: transformers' class spells some differently."""
    _check_flash_only_fields(config)
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
