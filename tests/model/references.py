"""Hand-written fp64 references of Ling-3.0's equations (docs/architecture.md), read from checkpoint tensors.

Written from docs/architecture.md, not from our model code or vLLM's: they are what the engine's layers
are checked against where transformers has no counterpart (SwiGLU clamps, the MTP draft).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


def checkpoint_tensors(model_dir: str, prefix: str) -> dict[str, torch.Tensor]:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for name, shard in index.items():
        if name.startswith(prefix):
            with safe_open(str(Path(model_dir) / shard), "pt") as f:
                out[name.removeprefix(prefix)] = f.get_tensor(name).double()
    return out


def swiglu_trained(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """Ling-3.0's clamped SwiGLU, shared and routed experts alike: min(SiLU(g), L) · clamp(u, ±L)."""
    return F.silu(g).clamp(max=limit) * u.clamp(-limit, limit)


def swiglu_silu_of_min(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """The other form, vLLM's fused-MoE "silu" + swiglu_limit: SiLU(min(g, L)) · clamp(u, ±L)."""
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


def moe_reference(x: torch.Tensor, w: dict, cfg: dict, layer: int, clamps: bool = True, groups: bool = True,
                  routed_swiglu=swiglu_trained):
    """Ling-3.0 MoE (docs/architecture.md §MoE) in fp64: grouped noaux_tc routing, renormalised ×2.5, clamped
    SwiGLUs, shared expert. `routed_swiglu` swaps the routed experts' clamp form (tests show it is pinned)."""
    x = x.double()
    n_exp, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    n_group, top_groups = (cfg["n_group"], cfg["topk_group"]) if groups else (1, 1)
    scores = torch.sigmoid(x @ w["gate.weight"].T)
    biased = scores + w["gate.expert_bias"]
    group_score = biased.view(-1, n_group, n_exp // n_group).topk(2, dim=-1).values.sum(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, group_score.topk(top_groups, -1).indices, True)
    biased = biased.masked_fill(~keep.repeat_interleave(n_exp // n_group, dim=1), float("-inf"))
    idx = biased.topk(k, dim=-1).indices
    weights = scores.gather(1, idx)
    weights = weights / weights.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    lim_r = cfg["expert_swiglu_limit_list"][layer] or None if clamps else None
    lim_s = cfg["share_expert_swiglu_limit_list"][layer] or None if clamps else None

    def expert(prefix: str, h: torch.Tensor, limit, routed: bool) -> torch.Tensor:
        g, u = h @ w[f"{prefix}.gate_proj.weight"].T, h @ w[f"{prefix}.up_proj.weight"].T
        if limit is None:
            a = F.silu(g) * u
        else:
            a = (routed_swiglu if routed else swiglu_trained)(g, u, limit)
        return a @ w[f"{prefix}.down_proj.weight"].T

    out = expert("shared_experts", x, lim_s, routed=False)
    for t in range(x.shape[0]):
        for j in range(k):
            out[t] += weights[t, j] * expert(f"experts.{int(idx[t, j])}", x[t : t + 1], lim_r, routed=True)[0]
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) by θ_j·pos, θ_j = theta^(−2j/d) (docs/architecture.md §MLA). x: [T, ..., d]."""
    d = x.shape[-1]
    angle = positions.double()[:, None] / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    out = torch.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
    out[..., 1::2] = x[..., 1::2] * cos + x[..., 0::2] * sin
    return out


def mla_reference(x: torch.Tensor, w: dict, cfg: dict, positions: torch.Tensor) -> torch.Tensor:
    """Gated MLA over one causal sequence (docs/architecture.md §MLA), head-wise gate, no q-LoRA.
    x: [T, hidden] -> [T, hidden]."""
    x = x.double()
    t, h = x.shape[0], cfg["num_attention_heads"]
    nope, rope, v_dim, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    q = (x @ w["q_proj.weight"].T).view(t, h, nope + rope)
    latent = x @ w["kv_a_proj_with_mqa.weight"].T
    c, k_pe = latent[:, :r], latent[:, r:]
    kv = (rms_norm(c, w["kv_a_layernorm.weight"], cfg["rms_norm_eps"]) @ w["kv_b_proj.weight"].T).view(t, h, nope + v_dim)
    k = torch.cat([kv[..., :nope], rope_interleaved(k_pe, positions, cfg["rope_theta"])[:, None].expand(t, h, rope)], -1)
    q = torch.cat([q[..., :nope], rope_interleaved(q[..., nope:], positions, cfg["rope_theta"])], -1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / (nope + rope) ** 0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), kv[..., nope:])
    o = o * torch.sigmoid(x @ w["g_proj.weight"].T)[..., None]
    return o.reshape(t, h * v_dim) @ w["dense.weight"].T


def mtp_reference(embeds: torch.Tensor, hidden: torch.Tensor, w: dict, cfg: dict, lm_head: torch.Tensor) -> torch.Tensor:
    """The MTP draft (docs/architecture.md §MTP) over a sequence: row t uses embed(token t+1) and the target's
    post-norm h_t.

    z = W_eh [RMSNorm_e(e); RMSNorm_h(h)]; z += MLA(RMSNorm_in(z)) at position t; z += MoE(RMSNorm_post(z))
    (no clamps: the MTP index is past the clamp lists); logits = lm_head(RMSNorm_final(z)).
    """
    eps = cfg["rms_norm_eps"]
    e, h = embeds.double(), hidden.double()
    z = torch.cat([rms_norm(e, w["enorm.weight"], eps), rms_norm(h, w["hnorm.weight"], eps)], -1) @ w["eh_proj.weight"].T
    attn_w = {k.removeprefix("attention."): v for k, v in w.items() if k.startswith("attention.")}
    z = z + mla_reference(rms_norm(z, w["input_layernorm.weight"], eps), attn_w, cfg, torch.arange(z.shape[0]))
    moe_w = {k.removeprefix("mlp."): v for k, v in w.items() if k.startswith("mlp.")}
    z = z + moe_reference(rms_norm(z, w["post_attention_layernorm.weight"], eps), moe_w, cfg, layer=len(
        cfg["expert_swiglu_limit_list"]), clamps=False)
    return rms_norm(z, w["final_layernorm.weight"], eps) @ lm_head.double().T


def mtp_draft_guesses(model_dir: str, seqs: list[list[int]], hiddens: list[torch.Tensor]) -> list[list[int]]:
    """Per sequence, the draft's greedy guess for every position t+2 (row t: embed(token t+1) with h_t), from
    the checkpoint's draft layer (index num_hidden_layers), embedding and lm_head."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    w = checkpoint_tensors(model_dir, f"model.layers.{cfg['num_hidden_layers']}.")
    emb = checkpoint_tensors(model_dir, "model.word_embeddings.")["weight"]
    head = checkpoint_tensors(model_dir, "lm_head.")["weight"]
    return [mtp_reference(emb[torch.tensor(seq[1:])], h[:-1], w, cfg, head).argmax(-1).tolist()
            for seq, h in zip(seqs, hiddens)]
