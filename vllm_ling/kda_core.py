"""The stateful half of a KDA layer: short conv + delta-rule recurrence over vLLM's cache slots.

Both runners take the same arguments and write o [n, H, d] into `out` (the custom op's output buffer: no copy
of their own result):
  qkv [n, 3·P] (pre-conv projections), g [n, H, d] fp32 log-decay, beta [n, H] fp32,
  conv_w [3·P, K] fp32, conv_state [slots, 3·P, width] (dim-first view), rec_state [slots, H, d(v), d(k)] fp32,
  meta: vLLM's GDNAttentionMetadata (decodes first, then prefills; spec-decode rows separate).
A sequence whose `has_initial_state` is False starts from zero state, whatever its slot held.

`run_cuda_gate_in_kernel` takes the raw forget-gate projection f and the β logits instead of g and β, for vLLM's
KDA kernels that apply the gate themselves (docs/vllm-seams.md §KDA kernels).
"""

from __future__ import annotations

import logging
from functools import cache
from typing import NamedTuple

import torch

from vllm_ling import compat, envs, flashkda as flash, startup_log
from vllm_ling.ops.conv import causal_conv1d_torch
from vllm_ling.ops.kda import chunk_kda_torch, kda_safe_gate, kda_softplus_gate, recurrent_kda_torch

logger = logging.getLogger("vllm_ling")
GATE_ENV = "VLLM_LING_KDA_GATE"
NULL_SLOT = 0  # vLLM's NULL_BLOCK_ID: the state slot of no block (v1/attention/backends/utils.py, 0.32-0.34)
GATES = envs.VARIABLES[GATE_ENV].choices  # our gate before the op (run_cuda), or in vLLM's kernels (run_cuda_gate_in_kernel)


def default_gate() -> str:
    """`kernel`: every supported vLLM ships the raw-gate KDA kernels. On the H200 (vLLM 0.33, full size, batch 1,
    FP8) they took the step from 4.349 to 4.063 ms and 1,071 to 1,001 kernels, and their prefill is the closer
    one to the fp32 oracle (docs/speed.md §Kernels)."""
    return envs.VARIABLES[GATE_ENV].default


def _initial_states(rec_state: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    """The prefill rows' starting states, gathered from their slots, zero for a sequence without initial state
    (a fresh one: its slot may hold a finished sequence's state). Masks the gathered copy, not the slot: no
    host sync, and the cache is written only with the final states (as vLLM 0.34's in-tree KDA does)."""
    h0 = rec_state[slots].contiguous()
    return h0.masked_fill_(~has_initial_state[:, None, None, None], 0)


def _heads(x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 3·P] -> q, k, v each [1, n, H, d], dense: the FLA kernels index them as contiguous [T, H, d] (a
    strided chunk handed to `fused_recurrent_kda_fwd` made every verify-batch sequence but the first read
    another token's channels). One copy makes all three ([3, n, H, d]), not one copy each; one token needs none."""
    n = x.shape[0]
    qkv = x.view(n, 3, -1, head_dim).transpose(0, 1)
    qkv = qkv if qkv.is_contiguous() else qkv.contiguous()
    return qkv[0][None], qkv[1][None], qkv[2][None]


def _head_views(x: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[n, 3·P] (row stride free) -> q, k, v as strided [1, n, H, d] views, no copy: for kernels that take a
    token stride (vLLM's raw-gate `fused_recurrent_kda` checks q, k, v share it)."""
    qkv = x.unflatten(-1, (3, -1, head_dim))
    return qkv[:, 0][None], qkv[:, 1][None], qkv[:, 2][None]


def _row_split(meta) -> tuple[slice | torch.Tensor | None, slice | torch.Tensor | None]:
    """(MTP verification rows, plain rows) of a batch, None where a kind is absent: vLLM's GDN metadata
    puts verify rows at spec_token_indx and the others at non_spec_token_indx when both are present."""
    spec = meta.spec_sequence_masks is not None
    spec_only = spec and meta.num_prefills == 0 and meta.num_decodes == 0
    spec_rows = None if not spec else (slice(None) if spec_only else meta.spec_token_indx)
    plain_rows = None if spec_only else (meta.non_spec_token_indx if spec else slice(None))
    return spec_rows, plain_rows


def _output(qkv: torch.Tensor, rec_state: torch.Tensor, head_dim: int, out: torch.Tensor | None) -> torch.Tensor:
    return out if out is not None else qkv.new_empty(qkv.shape[0], rec_state.shape[1], head_dim)


def run_torch(qkv, g, beta, conv_w, conv_state, rec_state, meta, head_dim: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """CPU path, our torch-native ops; MTP verification rows as vLLM's CUDA kernels treat them."""
    out = _output(qkv, rec_state, head_dim, out)
    spec_rows, plain_rows = _row_split(meta)
    for rows, runner in ((spec_rows, _verify_torch), (plain_rows, _plain_torch)):
        if rows is not None:
            out[rows] = runner(qkv[rows], g[rows], beta[rows], conv_w, conv_state, rec_state, meta, head_dim)
    return out


def _plain_torch(qkv, g, beta, conv_w, conv_state, rec_state, meta, head_dim: int) -> torch.Tensor:
    """Prefill and plain decode rows: varlen conv + chunked (or, decode-only, recurrent) KDA."""
    cu = meta.non_spec_query_start_loc.long()
    num_seqs = cu.numel() - 1
    slots = meta.non_spec_state_indices_tensor[:num_seqs].long()
    has_init = meta.has_initial_state
    has_init = torch.ones(num_seqs, dtype=torch.bool) if has_init is None else has_init[:num_seqs].bool()
    width = conv_w.shape[1] - 1

    x, conv_out = causal_conv1d_torch(
        qkv, conv_w, conv_state[slots, :, :width].to(qkv.dtype), cu, has_init, activation="silu"
    )
    conv_state[slots, :, :width] = conv_out.to(conv_state.dtype)

    q, k, v = _heads(x, head_dim)
    h0 = _initial_states(rec_state, slots, has_init)
    inputs = (q, k, v, g.unsqueeze(0), beta.unsqueeze(0))
    if bool((cu[1:] - cu[:-1] <= 1).all()):  # decode-only batch
        o, h_t = recurrent_kda_torch(*inputs, initial_state=h0, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    else:
        o, h_t = chunk_kda_torch(
            *inputs, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
        )
        _checkpoints_torch(getattr(meta, "checkpoint", None), qkv, inputs, h0, cu, conv_state, rec_state, width)
    rec_state[slots] = h_t
    return o[0]


def _checkpoints_torch(checkpoint, qkv, inputs, h0, cu, conv_state, rec_state, width: int) -> None:
    """In-prefill checkpoints (vLLM's MambaPrefillCheckpointMetadata, one entry a row): for a row whose offset o > 0,
    the state after the first o tokens of its query, written to the checkpoint block's slot: the recurrent state
    (the same chunked recurrence over those tokens, from the row's initial state) and the conv window (the last
    W-1 pre-conv inputs before o; vLLM's offsets are multiples of 16 >= W-1)."""
    if checkpoint is None:
        return
    q, k, v, g, beta = inputs
    for row, (offset, slot) in enumerate(zip(checkpoint.checkpoint_offsets.tolist(),
                                             checkpoint.state_indices.tolist())):
        if offset <= 0 or slot == NULL_SLOT:
            continue
        bos = int(cu[row])
        part = slice(bos, bos + offset)
        _, h = chunk_kda_torch(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part],
                               initial_state=h0[row:row + 1], output_final_state=True, use_qk_l2norm_in_kernel=True,
                               cu_seqlens=cu.new_tensor([0, offset]))
        rec_state[slot] = h[0]
        conv_state[slot, :, :width] = qkv[bos + offset - width:bos + offset].T.to(conv_state.dtype)


def _verify_torch(qkv, g, beta, conv_w, conv_state, rec_state, meta, head_dim: int) -> torch.Tensor:
    """MTP verification rows: each sequence is its last accepted token plus its drafts.

    Mirrors vLLM's `causal_conv1d_update(num_accepted_tokens=...)` and `fused_recurrent_kda_fwd` with 2-D
    state slots. Sequence i resumes from offset a = num_accepted_tokens[i] - 1: its conv window is
    conv_state[slot, :, a : a+W-1] (the row holds W-1+num_spec inputs) and its recurrent state is
    rec_state[slots[i, a]]. After its L tokens the conv row becomes [row[a+1 : a+W-1], x_0..x_{L-1}], and
    the fp32 state after token t is written to slots[i, t], so the next step can resume from whichever
    draft was accepted. Slot 0 is vLLM's null block (padding): zero output, nothing written.
    """
    num_spec = meta.num_spec_decodes
    slots = meta.spec_state_indices_tensor[:num_spec].long()
    qsl = meta.spec_query_start_loc[: num_spec + 1].long().tolist()
    accepted = meta.num_accepted_tokens[:num_spec].long().tolist()
    ns = conv_w.shape[1] - 1
    out = qkv.new_zeros(qkv.shape[0], rec_state.shape[1], head_dim)
    for i, (bos, eos) in enumerate(zip(qsl[:-1], qsl[1:])):
        a = accepted[i] - 1
        if eos == bos or int(slots[i, a]) <= 0:
            continue
        row = slots[i, 0]
        window = conv_state[row, :, a : a + ns].clone()  # [D, W-1]
        x, _ = causal_conv1d_torch(qkv[bos:eos], conv_w, window[None].to(qkv.dtype),
                                   torch.tensor([0, eos - bos]), torch.ones(1, dtype=torch.bool), activation="silu")
        rolled = torch.cat([window[:, 1:], qkv[bos:eos].T.to(conv_state.dtype)], dim=-1)  # [D, W-2+L]
        conv_state[row, :, : rolled.shape[-1]] = rolled
        q, k, v = _heads(x, head_dim)
        o, _, states = recurrent_kda_torch(
            q, k, v, g[None, bos:eos], beta[None, bos:eos], initial_state=rec_state[slots[i, a]][None].clone(),
            use_qk_l2norm_in_kernel=True, return_all_states=True,
        )
        for t in range(eos - bos):
            if int(slots[i, t]) > 0:
                rec_state[slots[i, t]] = states[t].to(rec_state.dtype)
        out[bos:eos] = o[0].to(out.dtype)
    return out


def _verify_conv(x, conv_w, conv_state, meta) -> torch.Tensor:
    """vLLM's conv update over MTP verification rows: each sequence resumes at its accepted offset."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    slots = meta.spec_state_indices_tensor
    return causal_conv1d_update(
        x, conv_state, conv_w, None, activation="silu", conv_state_indices=slots[:, 0][: meta.num_spec_decodes],
        num_accepted_tokens=meta.num_accepted_tokens, query_start_loc=meta.spec_query_start_loc,
        max_query_len=slots.size(-1), validate_data=False,
    )


def _prefill_conv(x, conv_w, conv_state, meta) -> torch.Tensor:
    """vLLM's varlen conv over prefill (and plain decode) rows, [n, 3·P] in and out."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn

    return causal_conv1d_fn(
        x.transpose(0, 1), conv_w, None, activation="silu", conv_states=conv_state,
        has_initial_state=meta.has_initial_state, cache_indices=meta.non_spec_state_indices_tensor,
        query_start_loc=meta.non_spec_query_start_loc, metadata=meta,
    ).transpose(0, 1)


def _decode_conv(x, conv_w, conv_state, meta) -> torch.Tensor:
    """vLLM's conv update over one-token plain decode rows."""
    from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_update

    return causal_conv1d_update(
        x, conv_state, conv_w, None, activation="silu",
        conv_state_indices=meta.non_spec_state_indices_tensor[: x.shape[0]], validate_data=True,
    )


def run_cuda(qkv, g, beta, conv_w, conv_state, rec_state, meta, head_dim: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA path: vLLM's conv kernels (fp32 kernel weights, as vLLM's own KDA layer hands them) and vendored FLA
    KDA kernels, fed our fp32 gate."""
    from vllm.third_party.flash_linear_attention.ops.kda import (
        chunk_kda,
        fused_recurrent_kda,
        fused_recurrent_kda_fwd,
    )

    out = _output(qkv, rec_state, head_dim, out)
    scale = head_dim**-0.5
    spec_rows, plain_rows = _row_split(meta)

    if spec_rows is not None:  # MTP verification: per-draft-position state slots
        num_spec = meta.num_spec_decodes
        q, k, v = _heads(_verify_conv(qkv[spec_rows], conv_w, conv_state, meta), head_dim)
        o, _ = fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g[spec_rows].unsqueeze(0).contiguous(), beta=beta[spec_rows].unsqueeze(0).contiguous(),
            scale=scale, initial_state=rec_state, inplace_final_state=True,
            cu_seqlens=meta.spec_query_start_loc[: num_spec + 1], ssm_state_indices=meta.spec_state_indices_tensor,
            num_accepted_tokens=meta.num_accepted_tokens, use_qk_l2norm_in_kernel=True,
        )
        out[spec_rows] = o[0]

    if plain_rows is None:
        return out
    slots = meta.non_spec_state_indices_tensor
    qsl = meta.non_spec_query_start_loc
    x_in = qkv[plain_rows]
    g_in, beta_in = g[plain_rows].unsqueeze(0).contiguous(), beta[plain_rows].unsqueeze(0).contiguous()
    if meta.num_prefills > 0:
        _no_checkpoint_writer(meta, "Triton chunk_kda")
        q, k, v = _heads(_prefill_conv(x_in, conv_w, conv_state, meta), head_dim)
        o, h_t = chunk_kda(
            q=q, k=k, v=v, g=g_in, beta=beta_in, scale=scale,
            initial_state=_initial_states(rec_state, slots, meta.has_initial_state),
            output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=qsl,
        )
        rec_state[slots] = h_t.to(rec_state.dtype)
    else:
        q, k, v = _heads(_decode_conv(x_in, conv_w, conv_state, meta), head_dim)
        o, _ = fused_recurrent_kda(
            q=q, k=k, v=v, g=g_in, beta=beta_in, scale=scale, initial_state=rec_state,
            use_qk_l2norm_in_kernel=True, cu_seqlens=qsl[: meta.num_decodes + 1], ssm_state_indices=slots,
        )
    out[plain_rows] = o[0].to(out.dtype)
    return out


def _no_checkpoint_writer(meta, kernel: str) -> None:
    """A prefill kernel that cannot write in-prefill checkpoints must never be handed one: vLLM would then serve the
    checkpoint block's stale state as a cached prefix (the layer declares checkpoints only where its kernel writes
    them, vllm_ling/kda.py)."""
    if getattr(meta, "checkpoint", None) is not None:
        raise RuntimeError(f"vllm-ling: an in-prefill KDA checkpoint reached {kernel}, which cannot write it; serve "
                           f"with VLLM_LING_KDA_PREFILL_CHECKPOINT=0")


@cache
def _checkpoint_exporter(window: int):
    return compat.flashkda_checkpoint_exporter(window)


class Gate(NamedTuple):
    """The forget gate's parameters, for kernels that apply it: g = λ·σ(exp(A_log)·(f + dt_bias)) with
    λ = lower_bound, or Kimi's −exp(A_log)·softplus(f + dt_bias) when lower_bound is None. fp32, as the gate."""
    A_log: torch.Tensor  # [H]
    dt_bias: torch.Tensor  # [H·d]
    lower_bound: float | None


def dense_slots(rec_state: torch.Tensor) -> bool:
    """vLLM's raw-gate KDA kernels index a slot's state as dense [H, V, K] (they refuse anything else)."""
    _, h, v, k = rec_state.shape
    return rec_state.stride()[1:] == (v * k, k, 1)


@cache
def _say_not_dense(strides: tuple[int, ...]) -> None:
    """Once per process and layout: the raw-gate path fell back (the self-check reads this line)."""
    logger.warning("%s", startup_log.KDA_GATE_FELL_BACK.text(
        reason=f"vLLM's raw-gate KDA kernels need each cache slot's state dense [H, V, K], and this cache's state "
               f"strides are {strides}; {GATE_ENV}=kernel serves as {GATE_ENV}=ours"))


def gate_torch(f: torch.Tensor, b: torch.Tensor, gate: Gate) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [n, H, d], β [n, H]) in fp32 from the raw projections, by our torch ops (the law the kernels apply)."""
    if gate.lower_bound is None:
        g = kda_softplus_gate(f, gate.A_log, gate.dt_bias)
    else:
        g = kda_safe_gate(f, gate.A_log, gate.dt_bias, gate.lower_bound)
    return g, b.float().sigmoid()


def run_cuda_gate_in_kernel(qkv, f, b, gate: Gate, conv_w, conv_state, rec_state, meta, head_dim: int,
                            out: torch.Tensor | None = None, flashkda: bool = False) -> torch.Tensor:
    """CUDA path on vLLM's KDA kernels that apply the gate and σ(β) inside (the ones its Kimi layer uses):
    f [n, H·d] and b [n, H] are the raw projections, row-strided views of the fused GEMM's output.
    Against `run_cuda` this drops the gate + β kernel of every layer, the q|k|v copy of a verify step and, on
    plain decode, the output copy (the kernel writes `out`). Same conv calls, same state slots, same null slot 0.
    `flashkda`: a batch with prefills runs its plain rows through FlashKDA (vllm_ling.flashkda) instead of the
    Triton chunk_kda; decode and verification rows keep the Triton recurrent kernels either way.
    A state that is not dense per slot takes `run_cuda` with our gate."""
    if not dense_slots(rec_state):
        _say_not_dense(tuple(rec_state.stride()))
        return run_cuda(qkv, *gate_torch(f, b, gate), conv_w, conv_state, rec_state, meta, head_dim, out)
    kda = compat.kda_gate_kernels()
    out = _output(qkv, rec_state, head_dim, out)
    heads = rec_state.shape[1]
    raw = dict(A_log=gate.A_log, dt_bias=gate.dt_bias, lower_bound=gate.lower_bound)
    spec_rows, plain_rows = _row_split(meta)

    def raw_gate(rows):
        return f[rows].unflatten(-1, (heads, head_dim))[None], b[rows][None]

    if spec_rows is not None:  # MTP verification: per-draft-position state slots
        q, k, v = _head_views(_verify_conv(qkv[spec_rows], conv_w, conv_state, meta), head_dim)
        raw_g, raw_beta = raw_gate(spec_rows)
        into = out[None] if plain_rows is None else None
        o, _ = kda.fused_recurrent_kda(
            q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, **raw, initial_state=rec_state,
            cu_seqlens=meta.spec_query_start_loc[: meta.num_spec_decodes + 1],
            ssm_state_indices=meta.spec_state_indices_tensor, num_accepted_tokens=meta.num_accepted_tokens, out=into,
        )
        if into is None:
            out[spec_rows] = o[0]

    if plain_rows is None:
        return out
    slots = meta.non_spec_state_indices_tensor
    x_in = qkv[plain_rows]
    raw_g, raw_beta = raw_gate(plain_rows)
    if meta.num_prefills > 0:
        q, k, v = _heads(_prefill_conv(x_in, conv_w, conv_state, meta), head_dim)
        h0 = _initial_states(rec_state, slots, meta.has_initial_state)
        if flashkda:
            into = out[None] if spec_rows is None else None  # all rows are plain: o goes straight into `out`
            checkpoint = getattr(meta, "checkpoint", None)
            o, h_t, states = flash.prefill(q, k, v, raw_g, raw_beta, gate.A_log, gate.dt_bias, gate.lower_bound, h0,
                                           meta.non_spec_query_start_loc, into,
                                           None if checkpoint is None else checkpoint.checkpoint_offsets)
            if checkpoint is not None:  # the state and its conv window into the checkpoint block, as vLLM's Kimi
                _checkpoint_exporter(conv_w.shape[1] - 1).export(
                    checkpoint, raw_qkv=x_in, conv_state=conv_state, recurrent_checkpoint=states,
                    recurrent_state=rec_state, cu_seqlens=meta.non_spec_query_start_loc)
        else:
            _no_checkpoint_writer(meta, "Triton chunk_kda")
            o, h_t = kda.chunk_kda_with_fused_gate(
                q=q, k=k, v=v, raw_g=raw_g, raw_beta=raw_beta, A_log=gate.A_log, g_bias=gate.dt_bias,
                lower_bound=gate.lower_bound, scale=head_dim**-0.5, initial_state=h0,
                output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=meta.non_spec_query_start_loc,
            )
        rec_state[slots] = h_t.to(rec_state.dtype)
        if o.data_ptr() != out.data_ptr():
            out[plain_rows] = o[0].to(out.dtype)
        return out
    x = _decode_conv(x_in, conv_w, conv_state, meta)
    into = out[None] if spec_rows is None else None
    o, _ = kda.fused_recurrent_kda_packed_decode(
        mixed_qkv=x, raw_g=raw_g, raw_beta=raw_beta, **raw, initial_state=rec_state,
        state_indices=slots[: x.shape[0]], out=into,
    )
    if into is None:
        out[plain_rows] = o[0]
    return out
