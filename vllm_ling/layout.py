"""Ling-3.0's layer layout, read from a config object (vLLM's `hf_config`) or the parsed config.json dict alike:
which layers are MLA or KDA, dense or MoE, how many MTP layers follow, the KDA head size, each layer's SwiGLU
clamp. It imports neither torch nor transformers, so the byte projection and the tensor table, tools beside the
plugin, read a config in a fraction of a second (the serve recipe asks the projection at every launch); the model,
its drafts and vllm_ling.config use the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Config = Any  # a transformers PretrainedConfig (vLLM's hf_config) or a parsed config.json dict


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
