"""A checkpoint's weight bytes from its config.json alone: what `--load-format dummy` fills with random values.

The preflight measures a local checkpoint's safetensors (preflight._weights). A dummy-weight server has none to
measure (a folder of config.json and a tokenizer: `ling-make-tiny DIR --full-config --tokenizer`), and the engine
still allocates every tensor the config describes, so they are counted from the config: the tensor table of
docs/architecture.md §Tensors (ling_tools.tensors, which the watchdog may not import: it reads the plugin's layer
layout, and the watchdog never imports the plugin; tests/watchdog/test_weights.py holds the two to each other). Every tensor at BF16 except the routed experts of a
quantized config (`quantization_config` with `num_bits` and `group_size`: the INT4 checkpoint's compressed-tensors
scheme, whose ignore list leaves every other linear BF16), stored at num_bits / 8 bytes plus a BF16 scale per group.
The MTP layer counts, as in the files. The small fp32 tensors (KDA conv, A_log, dt_bias, expert bias) are counted at
BF16 too: a few MB on the full model. FP8 (`--quantization ling_fp8`) is not counted, as for measured files.
"""
from __future__ import annotations

from typing import Any

BF16 = 2


def _expert_bytes_per_weight(config: dict[str, Any]) -> float:
    """BF16, or a quantized config's bits per weight plus one BF16 scale per group."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    for group in groups.values():
        w = group.get("weights") or {}
        if w.get("num_bits") and w.get("group_size"):
            return w["num_bits"] / 8 + BF16 / w["group_size"]
    return BF16


def _attention(c: dict[str, Any], mla: bool) -> int:
    """One layer's attention parameters: gated MLA or KDA (docs/architecture.md §MLA, §KDA)."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    if mla:
        r, nope, rope, v = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
        q_out = heads * (nope + rope)
        q = (c["q_lora_rank"] * (h + 1) + q_out * c["q_lora_rank"]) if c.get("q_lora_rank") else q_out * h
        gate = heads if c.get("gated_attention_proj_granularity_type", "head_wise") == "head_wise" else heads * v
        return q + (r + rope) * h + r + heads * (nope + v) * r + gate * h + h * heads * v
    d = c.get("linear_head_dim") or c["head_dim"]
    p = heads * d
    return 5 * p * h + 3 * p * c["short_conv_kernel_size"] + heads * h + heads + p + d + h * p


def dummy_weight_bytes(c: dict[str, Any]) -> int:
    """The bytes of every tensor config.json `c` describes: embedding, layers (the MTP layers too), norm, LM head."""
    h, vocab, layers, group = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"], c["layer_group_size"]
    mtp = c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0
    experts, shared = c["num_experts"], c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    plain = 2 * vocab * h + h  # embedding, LM head, final norm
    routed = 0
    for i in range(layers + mtp):
        mla = (i + 1) % group == 0 or i >= layers // group * group
        plain += 2 * h + _attention(c, mla)
        if i >= c["first_k_dense_replace"]:
            plain += experts * h + experts + 3 * shared * h  # router, its bias, shared experts
            routed += experts * 3 * c["moe_intermediate_size"] * h
        else:
            plain += 3 * c["intermediate_size"] * h
        if i >= layers:  # the MTP layer's enorm, hnorm, eh_proj, final_layernorm
            plain += 3 * h + 2 * h * h
    return int(plain * BF16 + routed * _expert_bytes_per_weight(c))
