"""The preflight's per-token KV (the main stack's and, with MTP on, the draft's) and per-sequence KDA state bytes
in defaults.yaml follow from the bundled Ling-3.0-flash config (docs/ops-walls.md "Memory model of the
preflight"): a change to the model's geometry or to the layer rule must show up here, not silently in a wrong
memory verdict."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from ling_watchdog.config import load_config
from ling_watchdog.preflight import footprint
from ling_watchdog.serve_args import ServeArgs

from vllm_ling.layout import is_mla_layer, kda_head_dim, num_mtp_layers
from vllm_ling.configs import flash_config

REPO = Path(__file__).resolve().parents[2]
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
RECURRENT_BYTES = 4  # the KDA recurrent state accumulates in fp32 whatever the model dtype


def recipe_mtp_k() -> int:
    """MTP k of the shipped recipe (serve/serve-int4-mtp.sh): the KDA conv window holds k extra positions."""
    text = (REPO / "serve" / "serve-int4-mtp.sh").read_text()
    return int(re.search(r"MTP_K=\$\{MTP_K:-(\d+)\}", text)[1])


def kda_layer_shapes(cfg: dict, num_spec: int) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """(conv, recurrent) state shapes of one KDA layer at TP 1: K - 1 + num_spec positions of the q, k, v
    channels, and [H, d, d]."""
    heads, d, width = cfg["num_attention_heads"], kda_head_dim(cfg), cfg["short_conv_kernel_size"]
    return (width - 1 + num_spec, 3 * heads * d), (heads, d, d)


def layer_counts(cfg: dict) -> tuple[int, int]:
    """(MLA, KDA) layers of the main stack; the MTP layer is the draft's, counted by the preflight as (1 + k)."""
    mla = sum(is_mla_layer(cfg, i) for i in range(cfg["num_hidden_layers"]))
    return mla, cfg["num_hidden_layers"] - mla


def draft_mla_layers(cfg: dict) -> int:
    """MLA layers of the MTP draft (the layers after the main stack): each gets its own KV cache in vLLM's pool
    when MTP is on (docs/ops-walls.md; tests/model/test_kv_layers_engine.py counts them on the CPU engine)."""
    first = cfg["num_hidden_layers"]
    return sum(is_mla_layer(cfg, i) for i in range(first, first + num_mtp_layers(cfg)))


def mla_bytes_per_token(cfg: dict) -> int:
    """Each MLA layer caches its latent and its RoPE key in the model dtype."""
    return (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * DTYPE_BYTES[cfg["torch_dtype"]]


def kv_bytes_per_token(cfg: dict) -> int:
    mla, _ = layer_counts(cfg)
    return mla * mla_bytes_per_token(cfg)


def draft_kv_bytes_per_token(cfg: dict) -> int:
    return draft_mla_layers(cfg) * mla_bytes_per_token(cfg)


def state_bytes_per_seq(cfg: dict, num_spec: int) -> int:
    """Each KDA layer holds a conv window in the model dtype and the fp32 recurrent state."""
    (conv_pos, conv_ch), (h, dk, dv) = kda_layer_shapes(cfg, num_spec)
    _, kda = layer_counts(cfg)
    return kda * (conv_pos * conv_ch * DTYPE_BYTES[cfg["torch_dtype"]] + h * dk * dv * RECURRENT_BYTES)


def test_kv_bytes_per_token_is_the_mla_latent_of_the_bundled_config():
    assert layer_counts(flash_config()) == (7, 35)  # docs/architecture.md §Layers
    assert load_config().kv_bytes_per_token == kv_bytes_per_token(flash_config())


def test_draft_kv_bytes_per_token_is_the_mla_latent_of_the_bundled_configs_mtp_layer():
    assert num_mtp_layers(flash_config()) == draft_mla_layers(flash_config()) == 1  # docs/architecture.md §MTP
    assert load_config().draft_kv_bytes_per_token == draft_kv_bytes_per_token(flash_config())


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_preflights_kv_counts_the_drafts_mla_layer_when_mtp_is_on(k):
    """7 x 576 x 2 B a token without MTP, (7 + 1) x 576 x 2 B with it, whatever k (every draft step reuses the one
    draft layer): leaving the draft layer out understates the KV of a long sequence by 1/8."""
    cfg, ctx = flash_config(), 131072
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    mla, _ = layer_counts(cfg)
    per_token = (mla + (draft_mla_layers(cfg) if k else 0)) * mla_bytes_per_token(cfg)
    fp = footprint(ServeArgs({"model": "m", "speculative_config": spec}), load_config(), ctx)
    assert fp.kv_per_token == per_token and fp.kv == ctx * per_token + fp.state


def test_state_bytes_per_seq_is_the_kda_state_of_the_bundled_config_at_the_recipes_mtp_k():
    assert recipe_mtp_k() == 1
    assert load_config().state_bytes_per_seq == state_bytes_per_seq(flash_config(), recipe_mtp_k())


def flashkda_bytes_per_tile(cfg: dict) -> int:
    """FlashKDA's workspace per 16-token tile, every KDA head: k and q decayed and k restored (bf16, 16 x d each), the
    chunk's total gate (fp32, d) and two 16 x 16 bf16 blocks (FlashKDA's get_workspace_size)."""
    d, chunk = kda_head_dim(cfg), 16
    return cfg["num_attention_heads"] * (3 * chunk * d * 2 + d * 4 + 2 * chunk * chunk * 2)


def test_flashkda_bytes_per_tile_is_the_plugins_workspace_of_the_bundled_config():
    from vllm_ling.flashkda import workspace_bytes

    cfg = flash_config()
    assert load_config().flashkda_bytes_per_tile == flashkda_bytes_per_tile(cfg) == 442_368
    assert workspace_bytes(16, cfg["num_attention_heads"], 0) == load_config().flashkda_bytes_per_tile
    assert flashkda_bytes_per_tile({**cfg, "num_attention_heads": 16}) != load_config().flashkda_bytes_per_tile


def test_the_check_sees_a_changed_geometry():
    """Negative control: one more MLA layer, or a wider KDA head, and the shipped numbers no longer match."""
    cfg = flash_config()
    assert kv_bytes_per_token({**cfg, "num_hidden_layers": 48}) != load_config().kv_bytes_per_token
    assert draft_kv_bytes_per_token({**cfg, "num_nextn_predict_layers": 0}) != load_config().draft_kv_bytes_per_token
    assert state_bytes_per_seq({**cfg, "head_dim": 256}, 1) != load_config().state_bytes_per_seq
    assert state_bytes_per_seq(cfg, 0) != load_config().state_bytes_per_seq


def test_the_kda_state_shapes_are_vllms():
    """Our shapes are the ones vLLM allocates (vllm_ling.compat), dtypes included; the conv state's two axes are
    ordered differently across vLLM releases, so its size is what is compared."""
    pytest.importorskip("vllm")
    import torch

    from vllm_ling import compat

    cfg = flash_config()
    h, d, width = cfg["num_attention_heads"], kda_head_dim(cfg), cfg["short_conv_kernel_size"]
    for k in (0, 1, 2):
        conv, recurrent = compat.kda_state_shape(1, h, d, width, k)
        our_conv, our_recurrent = kda_layer_shapes(cfg, k)
        assert sorted(conv) == sorted(our_conv) and tuple(recurrent) == our_recurrent
    conv_dtype, recurrent_dtype = compat.kda_state_dtype(getattr(torch, cfg["torch_dtype"]), "auto")
    assert conv_dtype.itemsize == DTYPE_BYTES[cfg["torch_dtype"]] and recurrent_dtype.itemsize == RECURRENT_BYTES


def test_the_dspark_drafter_defaults_are_the_cards_as_the_projection_reads_them():
    """The preflight's assumed drafter (a hub id it cannot read) and ling_bench.projection's are one drafter: its
    files' parameters, its full-attention KV a token (layers x K and V x KV heads x head dim x BF16), its block."""
    from ling_bench.projection import DSPARK, DSPARK_FILE_PARAMS

    cfg = load_config()
    assert cfg.dspark_params == DSPARK_FILE_PARAMS and cfg.dspark_block_size == DSPARK["dspark_block_size"]
    assert cfg.dspark_kv_bytes_per_token == (DSPARK["num_hidden_layers"] * 2 * DSPARK["num_key_value_heads"]
                                             * DSPARK["head_dim"] * DTYPE_BYTES["bfloat16"])
