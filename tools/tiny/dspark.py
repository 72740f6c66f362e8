"""Tiny DSpark drafters for a tiny Ling target: the real drafter's tensor names and config format (docs/dspark.md).

Names are those vLLM's `Qwen3DSparkForCausalLM` and SGLang's `LingDSparkModel` load (no `model.` prefix, no
embedding, no LM head: both are the target's); the config is a Qwen3 config named `LingDSparkModel` with the
DSpark fields in SGLang's prefixed `dspark_*` spelling, so the plugin's normalisation runs on it.

- random (the reject path): the drafter's guesses almost never match the target;
- `agree=True` (the accept path), for an `mtp_echo` target, whose next token is mostly f(t) = argmax
  lm_head(norm(embed(t))): the backbone's output is zeroed (final norm 0, so the base logits are 0) and the
  Markov head carries f: markov_w1[t] = u_f(t), markov_w2[j] = s·u_j with unit random u in R^rank, so the bias
  peaks at j = f(previous token) (rank 256 keeps the u's of 2,048 tokens far enough apart). Each block position
  then drafts f of the token before it, as the echo target does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vllm_ling.draft.dspark import required_tensors

TINY_DSPARK = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128,
               "intermediate_size": 512, "block_size": 8, "markov_rank": 256}
TINY_TARGET_LAYER_IDS = [1, 2, 4]  # after layers 1 (KDA), 2 (MLA) and 4 (KDA) of the 6-layer tiny target
MARKOV_SCALE = 30.0  # logit gap of the agreeing drafter's Markov bias: f(prev) wins by far


def dspark_config(target: dict[str, Any], target_layer_ids: list[int] | None = None) -> dict[str, Any]:
    """The drafter's config.json for `target` (a tiny Ling config)."""
    t = TINY_DSPARK
    return {
        "architectures": ["LingDSparkModel"], "model_type": "qwen3",
        "hidden_size": target["hidden_size"], "target_hidden_size": target["hidden_size"],
        "vocab_size": target["vocab_size"], "num_hidden_layers": t["num_hidden_layers"],
        "num_attention_heads": t["num_attention_heads"], "num_key_value_heads": t["num_key_value_heads"],
        "head_dim": t["head_dim"], "intermediate_size": t["intermediate_size"], "hidden_act": "silu",
        "rms_norm_eps": target["rms_norm_eps"], "rope_theta": 1000000.0,
        "max_position_embeddings": target["max_position_embeddings"], "attention_bias": False,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "dspark_block_size": t["block_size"], "dspark_markov_rank": t["markov_rank"],
        "dspark_markov_head_type": "vanilla", "dspark_noise_token_id": target["pad_token_id"],
        "dspark_target_layer_ids": list(target_layer_ids or TINY_TARGET_LAYER_IDS),
        "enable_confidence_head": True, "confidence_head_with_markov": True,
    }


def _shape(name: str, c: dict[str, Any]) -> tuple[int, ...]:
    h, hd, v, r = c["hidden_size"], c["head_dim"], c["vocab_size"], c["dspark_markov_rank"]
    q, kv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["intermediate_size"]
    table = {"fc.weight": (h, c["target_hidden_size"] * len(c["dspark_target_layer_ids"])),
             "markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r),
             "confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
             "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    key = name.split(".", 2)[2] if name.startswith("layers.") else name
    return table.get(key, (h,))  # the norms


def random_dspark_weights(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor the drafter's checkpoint holds: linears ~ N(0, 1/fan_in), norms 1, bf16 (confidence fp32)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in required_tensors(config_view(config)):
        shape = _shape(name, config)
        if len(shape) == 1 and not name.endswith("proj.bias"):
            t = torch.ones(shape)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        out[name] = t.to(torch.float32 if name.startswith("confidence_head") else torch.bfloat16)
    return out


def config_view(config: dict[str, Any]) -> dict[str, Any]:
    """The written config as the plugin sees it after normalisation (vllm_ling.draft.dspark)."""
    from vllm_ling.draft.dspark import normalise_draft_config

    return normalise_draft_config(json.loads(json.dumps(config)))


def target_echo(target_dir: Path, config: dict[str, Any]) -> torch.Tensor:
    """f(t) = argmax lm_head(RMSNorm(embed(t))) for every token t, from the target's files (fp32)."""
    index = json.loads((target_dir / "model.safetensors.index.json").read_text())["weight_map"]
    need = ("model.word_embeddings.weight", "model.norm.weight", "lm_head.weight")
    tensors = {k: v for f in sorted({index[n] for n in need}) for k, v in load_file(target_dir / f).items() if k in need}
    x = tensors[need[0]].float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * tensors[need[1]].float()
    return (x @ tensors[need[2]].float().T).argmax(-1)


def make_dspark_agree(tensors: dict[str, torch.Tensor], echo: torch.Tensor, seed: int = 0) -> None:
    """Zero the backbone's output (norm = 0) and make the Markov head draft echo[prev] (module docstring)."""
    gen = torch.Generator().manual_seed(seed + 1)
    w1 = tensors["markov_head.markov_w1.weight"]
    u = torch.randn(w1.shape, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    tensors["markov_head.markov_w1.weight"] = u[echo].to(w1.dtype)
    tensors["markov_head.markov_w2.weight"] = (MARKOV_SCALE * u).to(w1.dtype)
    tensors["norm.weight"] = torch.zeros_like(tensors["norm.weight"])


def make_tiny_dspark(out: Path, target_dir: Path, *, seed: int = 0, agree: bool = False,
                     force: bool = False) -> Path:
    """Write a tiny drafter for the tiny target in `target_dir` into `out`; returns `out`."""
    out, target_dir = Path(out), Path(target_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} is not empty (use force=True / --force to overwrite)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    target = json.loads((target_dir / "config.json").read_text())
    config = dspark_config(target)
    tensors = random_dspark_weights(config, seed)
    if agree:
        make_dspark_agree(tensors, target_echo(target_dir, target), seed)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
