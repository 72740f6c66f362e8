"""Kimi Delta Attention layer of Ling-3.0 (docs/architecture.md §KDA), with its state in vLLM's hybrid cache.

Per token: q,k,v = SiLU(causal_conv4(W_{q,k,v} x)); β = σ(W_β x); g = λ·σ(exp(A_log)·(W_f x + b_dt))
(the *safe* gate, λ = −5, fp32); S_t = (I − β k kᵀ) Diag(e^g) S_{t−1} + β k vᵀ; o = S_tᵀ (q/√d) with
q, k L2-normed; y = W_o [RMSNorm(o) ⊙ w ⊙ σ(W_g x)].

The stateful part runs inside one opaque custom op (torch.compile must not trace it). On CUDA it hands the raw
f and β logits to the KDA kernels vLLM wrote for its Kimi layer, which apply the same gate inside (the default,
VLLM_LING_KDA_GATE=kernel: measured faster), and a prefill to FlashKDA where its contract holds
(`vllm_ling.flashkda`, vLLM's --kda-prefill-backend picks); with VLLM_LING_KDA_GATE=ours it calls vLLM's vendored
FLA kernels with our precomputed fp32 gate; on CPU it calls our torch-native ops in `vllm_ling.ops`.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
from torch import nn

from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.layernorm import RMSNormGated
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs
from vllm.utils.torch_utils import direct_register_custom_op
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from vllm_ling import compat, envs, flashkda, kda_core, startup_log
from vllm_ling.layout import kda_head_dim

logger = logging.getLogger("vllm_ling")
CHECKPOINT_ENV = "VLLM_LING_KDA_PREFILL_CHECKPOINT"
OP_NAME = "vllm_ling_kda"
GATE_ENV, GATES = kda_core.GATE_ENV, kda_core.GATES


@cache
def _gate_in_kernel(asked: str) -> bool:
    """VLLM_LING_KDA_GATE=kernel: the raw projections go to vLLM's gate-applying kernels (logged once on CUDA)."""
    if asked != "kernel" or compat.is_cpu():  # the CPU path computes the gate by our ops either way
        return asked == "kernel"
    logger.info("%s", startup_log.KDA_GATE_IN_KERNEL.text(env=GATE_ENV))
    return True


def gate_in_kernel() -> bool:
    return _gate_in_kernel(envs.read(GATE_ENV))


@cache
def _say_prefill(choice: flashkda.PrefillChoice) -> None:
    """Once per process and choice: which kernel runs KDA prefills (the self-check reads this line). A warning when
    FlashKDA was asked for by name and does not serve."""
    say = logger.warning if choice.failed else logger.info
    say("%s", startup_log.KDA_PREFILL.text(kernel=choice.kernel, why=choice.reason))


@cache
def _say_checkpoints(on: bool, why: str) -> None:
    logger.info("%s", startup_log.KDA_CHECKPOINT.text(state="ON" if on else "OFF", why=why))


def checkpoint_alignment(vllm_config, choice: flashkda.PrefillChoice) -> int | None:
    """The token grid of this layer's in-prefill checkpoints, or None for none (vLLM's default). With
    VLLM_LING_KDA_PREFILL_CHECKPOINT on (the default) and the prefix cache on (align mode), they are declared where
    the prefill kernel writes them, our torch path and FlashKDA; Triton chunk_kda cannot. Every KDA layer makes the
    same choice, as vLLM requires of all its Mamba groups. Why: without them vLLM ends a prefill pass at the last
    block boundary before a prompt's end to save the state there, one pass more a prompt (docs/speed.md
    §In-prefill checkpoints). MTP keeps them (its engines keep every prefix-cache case with them); DSpark does not:
    its drafter's smaller KV block becomes vLLM's `cache_config.block_size`, on which vLLM 0.33/0.34's scheduler
    then plans KDA checkpoints that its KV manager, on the KDA block, refuses, and a prompt's last hashed position is
    lost (docs/dspark.md §Prefix cache; docs/vllm-seams.md §New releases says how to re-judge this on a release)."""
    if not envs.read(CHECKPOINT_ENV):
        return None
    if getattr(vllm_config.cache_config, "mamba_cache_mode", None) != "align":
        _say_checkpoints(False, "the prefix cache is off: no state is checkpointed")
        return None
    if getattr(vllm_config.speculative_config, "method", None) == "dspark":
        _say_checkpoints(False, "DSpark: vLLM plans them on the drafter's smaller KV block and its KV manager refuses "
                                "them, losing each prompt's last hashed position; vLLM ends a pass there instead")
        return None
    if choice.kernel == flashkda.TRITON:
        _say_checkpoints(False, f"{flashkda.TRITON} cannot write them (FlashKDA and the CPU engine's torch path can): "
                                f"vLLM ends a prompt's prefill pass at its last block boundary instead")
        return None
    alignment = compat.kda_checkpoint_alignment()
    _say_checkpoints(True, f"{choice.kernel} writes the state at the last block boundary inside a prompt's final "
                           f"pass, on a {alignment}-token grid ({CHECKPOINT_ENV}=0 turns them off)")
    return alignment


def prefill_choice(vllm_config, head_dim: int, lower_bound: float | None, state_dtype: torch.dtype,
                   gate_in_kernel: bool) -> flashkda.PrefillChoice:
    """FlashKDA or Triton chunk_kda for this layer's prefills, as --kda-prefill-backend asks and FlashKDA's contract
    allows (vllm_ling.flashkda); logged once."""
    on_cpu = compat.is_cpu()
    gaps = [] if on_cpu else flashkda.contract_gaps(
        compat.cuda_capability(), vllm_config.model_config.dtype, head_dim, lower_bound, state_dtype,
        compat.flashkda_ops() is not None, gate_in_kernel)
    choice = flashkda.choose(compat.kda_prefill_backend_asked(vllm_config), on_cpu=on_cpu, gaps=gaps)
    _say_prefill(choice)
    return choice


def _kda_op(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    get_forward_context().no_compile_layers[layer_name].core(qkv, g, beta, out)


def _kda_op_fake(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor, layer_name: str) -> None:
    return None


direct_register_custom_op(op_name=OP_NAME, op_func=_kda_op, mutates_args=["out"], fake_impl=_kda_op_fake)


_shard_heads = sharded_weight_loader(0)


def _load_head_sharded(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """A per-head or per-channel tensor (A_log, [H] or the checkpoint's [1, 1, H, 1]; dt_bias [P]), flattened, then
    vLLM's sharded loader keeps this rank's heads and its copy casts to the fp32 parameter."""
    _shard_heads(param, loaded.reshape(-1))


def _load_conv_shard(param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
    """q/k/v_conv1d.weight [P, 1, K] -> rows [shard·P/TP, (shard+1)·P/TP) of the fused [3·P/TP, K] fp32 kernel,
    this rank's heads only: the layout the conv kernels read, built once at load (no per-step cat or cast)."""
    local = param.shape[0] // 3
    rows = loaded.reshape(-1, param.shape[1]).narrow(0, get_tensor_model_parallel_rank() * local, local)
    param.data[shard * local:(shard + 1) * local].copy_(rows.to(param.dtype))


class BailingMoeV3KDA(nn.Module, MambaBase):
    """KDA mixer; checkpoint prefix `model.layers.{i}.attention` (renamed `self_attn` on load)."""

    def __init__(self, config, vllm_config, prefix: str) -> None:
        super().__init__()
        quant_config = vllm_config.quant_config
        self.model_config = vllm_config.model_config
        self.cache_config = vllm_config.cache_config
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_heads = config.num_attention_heads
        self.head_dim = kda_head_dim(config)
        self.local_heads = self.num_heads // self.tp_size
        self.conv_size = config.short_conv_kernel_size
        self.num_spec = compat.num_speculative_tokens(vllm_config)
        safe_gate = bool(getattr(config, "kda_safe_gate", True)) and config.kda_lower_bound is not None
        self.lower_bound = float(config.kda_lower_bound) if safe_gate else None  # None: Kimi's softplus law
        self.prefix = prefix
        proj = self.num_heads * self.head_dim
        local_proj = proj // self.tp_size

        # Every projection of x in one GEMM: q | k | v | β-logits | f (forget gate) | g (output gate). They read the
        # same input, so one launch replaces three at the same bytes (docs/speed.md §Kernels); TP shards every
        # part by heads. Each rank's row is padded with zero rows to a multiple of 16 outputs, as vLLM's Kimi layer
        # pads its own merged projection: an unaligned width makes the GPU compile pad the GEMM's rows (Inductor's
        # pad_mm; the H200 saw row stride 2,568 for the tiny checkpoint's 2,564) and the output gate g, which
        # crosses a boundary of vLLM's piecewise graph, then fails the next piece's stride check; and a CUTLASS FP8
        # kernel that cannot pad such a weight with per-channel scales asserts. Ling-3.0-flash's width
        # (20,512; 10,256 per rank at TP = 2) is aligned already: no padding.
        widths = [proj, proj, proj, self.num_heads, proj, proj]
        self.in_proj_pad = -(sum(widths) // self.tp_size) % 16
        self.in_proj = MergedColumnParallelLinear(
            config.hidden_size, widths + [self.in_proj_pad * self.tp_size] * bool(self.in_proj_pad), bias=False,
            quant_config=quant_config, prefix=f"{prefix}.in_proj",
        )
        self._zero_in_proj_pad()
        self.o_proj = RowParallelLinear(
            proj, config.hidden_size, bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        # Gate parameters and the conv stay fp32: the gate is computed in fp32 (docs/architecture.md §KDA).
        fp32 = dict(dtype=torch.float32)
        self.A_log = nn.Parameter(torch.empty(self.local_heads, **fp32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(local_proj, **fp32), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            set_weight_attrs(param, {"weight_loader": _load_head_sharded})
        # q | k | v depthwise conv kernels in one fp32 [3·P/TP, K] tensor (checkpoint: q/k/v_conv1d.weight).
        self.conv1d = nn.Parameter(torch.empty(3 * local_proj, self.conv_size, **fp32), requires_grad=False)
        set_weight_attrs(self.conv1d, {"weight_loader": _load_conv_shard})
        # RMSNorm(o) ⊙ w ⊙ σ(W_g x) over each head (weight shared by all heads), in fp32 (vLLM's gated norm).
        self.o_norm = RMSNormGated(self.head_dim, eps=config.rms_norm_eps, norm_before_gate=True,
                                   activation="sigmoid", dtype=torch.float32)
        self.gate_in_kernel = gate_in_kernel()
        self.prefill = prefill_choice(vllm_config, self.head_dim, self.lower_bound, self.get_state_dtype()[1],
                                      self.gate_in_kernel)
        if self.prefill.flashkda:  # vLLM's scratch grows to the engine's FlashKDA workspace before the KV is sized
            flashkda.reserve(*compat.scheduler_limits(vllm_config), self.local_heads)
        self.checkpoint_alignment = checkpoint_alignment(vllm_config, self.prefill)

        compilation_config = get_current_vllm_config().compilation_config
        if prefix in compilation_config.static_forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        compilation_config.static_forward_context[prefix] = self
        splitting = compilation_config.splitting_ops
        if splitting is not None and f"vllm::{OP_NAME}" not in splitting:
            splitting.append(f"vllm::{OP_NAME}")

    def _zero_in_proj_pad(self) -> None:
        """The padding rows are in no checkpoint: zero them where the weight exists now (BF16). An online-FP8
        weight is still on the meta device here; its padding rows only ever feed the discarded padding outputs
        (one scale per output row, nothing mixes rows)."""
        weight = getattr(self.in_proj, "weight", None)
        if self.in_proj_pad and weight is not None and not weight.is_meta:
            weight.data[-self.in_proj_pad:].zero_()

    def load_in_proj_padding(self) -> None:
        """Load the padding shard (zeros) through the projection's own loader, as if the checkpoint held it:
        vLLM >= 0.34 records which shards of a stacked weight a load filled and refuses a model with an unfilled
        one (`StackedColumnParallelLinear.pop_missing_shards`). An online-FP8 weight gets real zeros this way."""
        if not self.in_proj_pad:
            return
        weight = self.in_proj.weight
        zeros = torch.zeros(self.in_proj_pad * self.tp_size, self.in_proj.input_size, dtype=self.in_proj.params_dtype)
        weight.weight_loader(weight, zeros, len(self.in_proj.output_sizes) - 1)

    # --- hybrid-cache interface (must equal the model's classmethods) ------------------------------
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return compat.kda_state_shape(self.tp_size, self.num_heads, self.head_dim, self.conv_size, self.num_spec)

    def get_state_dtype(self):
        return compat.kda_state_dtype(self.model_config.dtype, self.cache_config.mamba_cache_dtype)

    def get_kv_cache_spec(self, vllm_config):
        """vLLM's Mamba spec, with one in-prefill checkpoint block a sequence when this layer writes them."""
        spec = super().get_kv_cache_spec(vllm_config)
        if self.checkpoint_alignment is None:
            return spec
        return compat.with_prefill_checkpoint(spec, self.checkpoint_alignment)

    def get_prefill_checkpoint_alignment(self) -> int | None:
        """vLLM 0.34 makes Mamba blocks multiples of every layer's alignment (older releases never ask)."""
        return self.checkpoint_alignment

    # --- forward -----------------------------------------------------------------------------------
    @property
    def gate_params(self) -> kda_core.Gate:
        """The forget gate's law and parameters: the safe law for Ling-3.0 (λ = lower_bound), softplus otherwise."""
        return kda_core.Gate(self.A_log, self.dt_bias, self.lower_bound)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        n, p = hidden_states.shape[0], self.local_heads * self.head_dim
        parts = [3 * p, self.local_heads, p, p] + [self.in_proj_pad] * bool(self.in_proj_pad)
        qkv, b, f, gate = self.in_proj(hidden_states)[0].split(parts, dim=-1)[:4]  # views
        if self.gate_in_kernel:  # the op gets the raw projections; the kernels apply σ and the gate in fp32
            g, beta = f, b
        else:  # fp32 log-decay g and write strength β
            g, beta = kda_core.gate_torch(f, b, self.gate_params)
        out = torch.zeros(n, self.local_heads, self.head_dim, dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm.vllm_ling_kda(qkv, g, beta, out, self.prefix)
        o = self.o_norm(out, gate.view(n, self.local_heads, self.head_dim))  # sigmoid gate, not SiLU
        return self.o_proj(o.view(n, -1))[0]

    def core(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, out: torch.Tensor) -> None:
        """Conv + recurrence over the batch's sequences, reading and writing this layer's cache slots. g, β: the
        fp32 gate and write strength, or (gate_in_kernel) the raw f and β-logit projections."""
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None:  # profile / warm-up run without state
            return
        conv_state, rec_state = self.kv_cache
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)  # view as [slots, 3·P, width]
        rec_state = rec_state[..., : self.head_dim]  # [slots, H, d(v), d(k)], ignore page padding
        n = meta.num_actual_tokens
        qkv, g, beta, out = qkv[:n], g[:n], beta[:n], out[:n]
        if self.gate_in_kernel:
            if qkv.is_cuda:
                kda_core.run_cuda_gate_in_kernel(qkv, g, beta, self.gate_params, self.conv1d, conv_state,
                                                 rec_state, meta, self.head_dim, out, flashkda=self.prefill.flashkda)
                return
            g, beta = kda_core.gate_torch(g, beta, self.gate_params)
        run = kda_core.run_cuda if qkv.is_cuda else kda_core.run_torch
        run(qkv, g, beta, self.conv1d, conv_state, rec_state, meta, self.head_dim, out)
