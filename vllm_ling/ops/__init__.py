"""Torch-native ops for the CPU engine, where vLLM's Triton KDA and conv kernels cannot run."""

from vllm_ling.ops.conv import causal_conv1d_torch, causal_conv1d_update_torch
from vllm_ling.ops.kda import chunk_kda_torch, kda_safe_gate, kda_softplus_gate, recurrent_kda_torch

__all__ = [
    "causal_conv1d_torch",
    "causal_conv1d_update_torch",
    "chunk_kda_torch",
    "kda_safe_gate",
    "kda_softplus_gate",
    "recurrent_kda_torch",
]
