"""Gated multi-head latent attention of Ling-3.0 (docs/architecture.md §MLA).

q = W_q x; [c_kv; k_pe] = W_kva x; [k_nope_h; v_h] = W_kvb,h RMSNorm(c_kv); interleaved RoPE (64 dims,
theta 6e6) on q_pe and the head-shared k_pe; softmax over (q·k)/√192; o_h ← σ(W_g x)_h · o_h (fp32 gate,
before `dense`); y = W_dense o.

Two kernels compute the same attention:
- vLLM's MLA layer (latent KV cache of 576 values per token): used whenever `model_config.use_mla`,
  i.e. on GPUs;
- vLLM's ordinary `Attention` over the decompressed k/v (head 192, v zero-padded to 192 and sliced
  back), used when MLA is disabled (`VLLM_MLA_DISABLE=1`), which the CPU engine needs: vLLM 0.32
  forces a 128-token block on hybrid MLA models while its CPU MLA backend takes only 16.
"""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.rotary_embedding import get_rope

from vllm_ling import compat
from vllm_ling.config import mla_rope_parameters


class _Identity(nn.Module):
    """Stands in for the MLA wrapper's o_proj so the gate can act before `dense`."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None


class BailingMoeV3MLA(nn.Module):
    """Checkpoint prefix `model.layers.{i}.attention` (renamed `self_attn` on load)."""

    def __init__(self, config, vllm_config, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        cache_config = vllm_config.cache_config
        tp = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads
        self.local_heads = self.num_heads // tp
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.qk_head_dim = self.nope + self.rope
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        scale = self.qk_head_dim**-0.5
        hidden = config.hidden_size
        eps = config.rms_norm_eps

        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden, self.num_heads * self.qk_head_dim, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.q_proj",
            )
            self.kv_a_proj_with_mqa = ReplicatedLinear(
                hidden, self.kv_lora_rank + self.rope, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.kv_a_proj_with_mqa",
            )
            self.fused_qkv_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:  # Ling-3.0-tiny style low-rank q; q_a and kv_a share one GEMM
            self.fused_qkv_a_proj = MergedColumnParallelLinear(
                hidden, [self.q_lora_rank, self.kv_lora_rank + self.rope], bias=False,
                quant_config=quant_config, prefix=f"{prefix}.fused_qkv_a_proj", disable_tp=True,
            )
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=eps)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False,
                quant_config=quant_config, prefix=f"{prefix}.q_b_proj",
            )
            self.q_proj = self.kv_a_proj_with_mqa = None
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim), bias=False,
            quant_config=quant_config, prefix=f"{prefix}.kv_b_proj",
        )
        self.head_wise_gate = config.gated_attention_proj_granularity_type == "head_wise"
        gate_out = self.num_heads if self.head_wise_gate else self.num_heads * self.v_head_dim
        self.g_proj = ColumnParallelLinear(
            hidden, gate_out, bias=False, quant_config=quant_config, prefix=f"{prefix}.g_proj"
        )
        self.dense = RowParallelLinear(
            self.num_heads * self.v_head_dim, hidden, bias=False,
            quant_config=quant_config, prefix=f"{prefix}.dense",
        )
        self.rotary_emb = get_rope(
            self.rope, max_position=config.max_position_embeddings,
            is_neox_style=not getattr(config, "rope_interleave", True),
            rope_parameters=mla_rope_parameters(config),
        )

        self.use_mla = vllm_config.model_config.use_mla
        if self.use_mla:
            modules = MLAModules(
                kv_a_layernorm=self.kv_a_layernorm, kv_b_proj=self.kv_b_proj, rotary_emb=self.rotary_emb,
                o_proj=_Identity(), fused_qkv_a_proj=self.fused_qkv_a_proj,
                kv_a_proj_with_mqa=self.kv_a_proj_with_mqa, q_a_layernorm=self.q_a_layernorm,
                q_b_proj=self.q_b_proj, q_proj=self.q_proj, indexer=None, is_sparse=False,
                topk_indices_buffer=None,
            )
            self.mla_attn = MultiHeadLatentAttentionWrapper(
                hidden, self.local_heads, scale, self.nope, self.rope, self.v_head_dim,
                self.q_lora_rank, self.kv_lora_rank, modules, cache_config, quant_config, prefix,
            )
        else:
            self.attn = Attention(
                self.local_heads, self.qk_head_dim, scale, num_kv_heads=self.local_heads,
                cache_config=cache_config, quant_config=quant_config, prefix=f"{prefix}.attn",
            )

    def _attend_decompressed(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Standard attention over k/v decompressed from the latent: the same math as MLA."""
        n, h = x.shape[0], self.local_heads
        if self.q_proj is not None:
            q, _ = self.q_proj(x)
            latent, _ = self.kv_a_proj_with_mqa(x)
        else:
            q_c, latent = self.fused_qkv_a_proj(x)[0].split([self.q_lora_rank, self.kv_lora_rank + self.rope], -1)
            q, _ = self.q_b_proj(self.q_a_layernorm(q_c))
        q = q.view(n, h, self.qk_head_dim)
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.rope], dim=-1)
        kv, _ = self.kv_b_proj(self.kv_a_layernorm(c_kv.contiguous()))
        k_nope, v = kv.view(n, h, self.nope + self.v_head_dim).split([self.nope, self.v_head_dim], dim=-1)
        q_pe, k_pe = compat.rotate_mla(self.rotary_emb, positions, q[..., self.nope :], k_pe, h)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.view(n, 1, self.rope).expand(n, h, self.rope)], dim=-1)
        v = F.pad(v, (0, self.qk_head_dim - self.v_head_dim))
        o = self.attn(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1))
        return o.view(n, h, self.qk_head_dim)[..., : self.v_head_dim].reshape(n, -1)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.use_mla:
            o = self.mla_attn(positions, hidden_states)
        else:
            o = self._attend_decompressed(positions, hidden_states)
        gate = torch.sigmoid(self.g_proj(hidden_states)[0].float()).to(o.dtype)  # fp32 sigmoid gate
        if self.head_wise_gate:
            o = (o.view(o.shape[0], self.local_heads, self.v_head_dim) * gate.unsqueeze(-1)).view(o.shape[0], -1)
        else:
            o = o * gate
        return self.dense(o)[0]
