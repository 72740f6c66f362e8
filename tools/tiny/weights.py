"""Random weights for the tensor table (`ling_tools.tensors`), and the variants' edits to them.

Each tensor is drawn from a generator seeded by sha256(f"{seed}/{name}"): the same seed gives the same
bytes, and checkpoints that share a tensor name (BF16 and INT4, default and qlora) share its values.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from ling_tools.tensors import TensorSpec, tensor_specs

STABLE_BIAS_GAIN = 100.0  # expert_bias N(0, 0.05) -> N(0, 5): selection set by the bias, far above bf16 noise
ECHO_DAMPING = 0.03  # scale of every layer's output projection in the mtp_echo variant


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def init_tensor(name: str, spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """Draw one tensor, scaled so that activations stay O(1) through the layers.

    Linears (router and experts too) are N(0, 1/fan_in): each projection keeps unit variance, so
    KDA/MLA/MoE outputs are O(1), the router logits have std ~1 and the expert gate/up pre-activations
    have std ~1 (the clamps bind). The lm_head has 3x that gain: logits std ~3, a peaked next-token
    distribution. The routing bias N(0, 0.05) is comparable to the spread of the sigmoid scores, so
    top-k with the bias differs from top-k without it on many tokens. The fp32 tensors are stored in
    fp32: their real on-disk dtype is unverified, so loaders must cast whatever they find.
    """
    shape = spec.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if spec.kind in ("linear", "router", "expert"):
        x = normal(shape[1] ** -0.5)
    elif spec.kind == "lm_head":
        x = normal(3.0 * shape[1] ** -0.5)
    elif spec.kind == "embedding":
        x = normal(1.0)
    elif spec.kind == "norm":
        x = 1.0 + normal(0.05)
    elif name.endswith("_conv1d.weight"):
        x = normal(0.3)  # ~kaiming for fan-in 4: keeps SiLU out of its linear region
    elif name.endswith("A_log"):
        x = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    elif name.endswith("dt_bias"):  # inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        x = dt + torch.log(-torch.expm1(-dt))
    elif name.endswith("expert_bias"):
        x = normal(0.05)
    else:
        raise ValueError(f"{name}: no init recipe for kind {spec.kind!r}")
    return x.float() if spec.kind == "fp32" else x.to(torch.bfloat16)


def random_weights(config: dict[str, Any], seed: int, live_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """All tensors of `tensor_specs(config)`. Ids >= `live_vocab` (past the tokenizer) are padding, as in
    the real vocab: their lm_head rows are zero, so their logit 0 sits far below the top live logits and
    greedy decoding never emits an id the tokenizer cannot decode."""
    tensors = {name: init_tensor(name, spec, _generator(seed, name)) for name, spec in tensor_specs(config).items()}
    if live_vocab is not None:
        tensors["lm_head.weight"][live_vocab:] = 0
    return tensors


def widen_router_bias(tensors: dict[str, torch.Tensor]) -> None:
    """Variant stable_router: expert choice set by a wide bias, not by near-ties that bf16 flips."""
    for name, t in tensors.items():
        if name.endswith("mlp.gate.expert_bias"):
            t.mul_(STABLE_BIAS_GAIN)


def make_draft_agree(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Turn a random checkpoint into one whose MTP draft predicts what the target will say (variant mtp_echo).

    Every main layer's output projections (KDA o_proj, MLA dense, MLP down) are damped ×ECHO_DAMPING,
    so the target's next token is mostly f(current token) = argmax lm_head(norm(embed(t))) while KDA and
    MLA state still shape the logits. The draft passes its embedding through untouched (eh_proj = [I, 0],
    its attention and MoE outputs zeroed, norms = the target's final norm), so it predicts f(t+1): the
    target's next token after t+1. Acceptance is then high but not forced, so both the accept and the
    reject paths of verification run.
    """
    n, h = config["num_hidden_layers"], config["hidden_size"]
    outputs = (".attention.o_proj.weight", ".attention.dense.weight", "down_proj.weight")
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(outputs):
            layer = int(name.split(".")[2])
            t.mul_(0.0 if layer >= n else ECHO_DAMPING)
    mtp = f"model.layers.{n}."
    eye = torch.zeros(h, 2 * h, dtype=tensors[mtp + "eh_proj.weight"].dtype)
    eye[:, :h] = torch.eye(h)
    tensors[mtp + "eh_proj.weight"] = eye
    for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"{mtp}{norm}.weight"].fill_(1.0)
    tensors[mtp + "final_layernorm.weight"] = tensors["model.norm.weight"].clone()
