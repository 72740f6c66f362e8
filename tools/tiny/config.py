"""The tiny config: the bundled full-size Flash config.json with toy widths (docs/tiny-checkpoints.md).

Starting from the real config keeps the real field set, so loaders meet every field they will meet
on the real checkpoint; only the values below change.
"""

from __future__ import annotations

import copy
from typing import Any

from vllm_ling.configs import flash_config

VARIANTS = ("default", "qlora", "mtp_echo", "stable_router")

# The clamp limits are tuned to the weight scales of `weights.py`: gate/up pre-activations have std ~1,
# so these limits bind on a good share of the channels.
TINY_VALUES: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,  # Marlin wants hidden_size % 128 == 0
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "layer_group_size": 3,  # MLA at layers 2 and 5, KDA at 0, 1, 3, 4
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 128,  # KDA head dim: P = 512, like the real kernels' d
    "max_position_embeddings": 4096,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
    # Routed clamps only in the last two layers, shared clamps from one layer earlier and a different
    # value in the last one, like Flash (layers 35-41 / 34-39 / 40-41). MTP (layer 6) is past the lists.
    "expert_swiglu_limit_list": [0, 0, 0, 0, 1.0, 1.0],
    "share_expert_swiglu_limit_list": [0, 0, 0, 1.25, 1.25, 1.5],
}
QLORA_VALUES: dict[str, Any] = {"q_lora_rank": 64}  # Ling-3.0-tiny style q_a/q_b projections


def tiny_config(variant: str = "default", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Flash config with the tiny values; token ids are filled in from the tokenizer later."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is unknown; use one of {VARIANTS}")
    config = flash_config()
    config.pop("quantization_config", None)
    config.update(copy.deepcopy(TINY_VALUES))
    if variant == "qlora":
        config.update(QLORA_VALUES)
    config.update(copy.deepcopy(overrides or {}))
    return config
