"""ling_tuning: per-device tuning of vLLM's INT4 fused-MoE tiles (`ling-tune`), the measured MoE
backend choice (`choice.recommended_backend`), and the shared-memory guard for vLLM's vendored
KDA Triton autotuners (`vllm_ling.smem_guard.install`). Modules import torch/vLLM only where they need a GPU.
"""
