"""Torch-native depthwise causal conv (KDA's short convolution) with vLLM's conv-state semantics.

    y_t = act( Σ_{j<W} w_{:, j} ⊙ x_{t−W+1+j} + b )

Inputs before a sequence's first token come from its carried conv state, which holds the last W−1 inputs of
the sequence so far, oldest first (zeros for a new sequence). The state is addressed as `[..., D, state_len]`
("dim first"), the view vLLM's `causal_conv1d_fn` / `causal_conv1d_update` take. vLLM's default cache layout
is actually "SD" (`[state_len, D]` in memory); its layers hand the kernels `conv_state.transpose(-1, -2)`, and
these functions accept that strided view too. Only the first W−1 of `state_len` columns are read or written:
the extra `num_spec` columns of a speculative-decoding cache belong to `num_accepted_tokens`, which these
functions do not implement. Math runs in fp32 (vLLM's kernels accumulate in fp32 too).
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")  # swish == silu, as in vLLM


def _check(weight: torch.Tensor, activation: str | None) -> int:
    """Validate the shared arguments and return the number of carried positions W − 1."""
    if weight.dim() != 2 or weight.shape[1] < 2:
        raise ValueError(f"`weight` must be [D, W] with W >= 2, got {list(weight.shape)}; "
                         "squeeze a Conv1d weight [D, 1, W] with `.squeeze(1)`.")
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got {activation!r}.")
    return weight.shape[1] - 1


def _conv(x_ext: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """Valid depthwise conv of fp32 x_ext [B, D, W-1+L] -> [B, D, L], then the activation."""
    y = F.conv1d(x_ext, weight.float()[:, None], None if bias is None else bias.float(), groups=weight.shape[0])
    return y if activation is None else F.silu(y)


def causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    has_initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen prefill, the semantics of vLLM's `causal_conv1d_fn` with tokens first.

    Args:
        x: packed tokens `[T, D]` (vLLM's kernel takes the transpose, `[D, T]`).
        weight: `[D, W]`.
        conv_state: `[N, D, state_len >= W-1]` carried inputs of the N sequences, or None for all zeros.
        cu_seqlens: int `[N+1]` sequence offsets into x.
        has_initial_state: bool `[N]`; False (or None, as in vLLM's CPU op) starts that sequence from zeros.
        activation: None, "silu" or "swish".
        bias: optional `[D]`.

    Returns:
        (y `[T, D]` in x's dtype, new conv state `[N, D, W-1]` in conv_state's dtype (x's when None): the last
        W-1 inputs of each sequence, reaching into the old state for sequences shorter than W-1). conv_state
        is not modified; write the result back to `conv_state[..., :W-1]`.
    """
    ns = _check(weight, activation)
    N, D = cu_seqlens.numel() - 1, x.shape[-1]
    if conv_state is not None and (conv_state.dim() != 3 or conv_state.shape[:2] != (N, D) or conv_state.shape[2] < ns):
        raise ValueError(f"`conv_state` must be [N, D, >= W-1]={[N, D, ns]}, got {list(conv_state.shape)}.")
    new_state = x.new_zeros(N, D, ns, dtype=x.dtype if conv_state is None else conv_state.dtype)
    y = torch.empty_like(x)
    cu = cu_seqlens.tolist()
    carried = [False] * N if has_initial_state is None or conv_state is None else has_initial_state.tolist()
    for n, (bos, eos) in enumerate(pairwise(cu)):
        init = conv_state[n, :, :ns].float() if carried[n] else x.new_zeros(D, ns, dtype=torch.float32)
        x_ext = torch.cat([init, x[bos:eos].float().T], dim=-1)  # [D, W-1+L]
        y[bos:eos] = _conv(x_ext[None], weight, bias, activation)[0].T
        new_state[n] = x_ext[:, x_ext.shape[-1] - ns:]
    return y, new_state


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    activation: str | None = "silu",
    bias: torch.Tensor | None = None,
    conv_state_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode step(s), the semantics of vLLM's `causal_conv1d_update` without `num_accepted_tokens`.

    Each of the N sequences continues from its carried state with Tq new tokens; the state is updated in
    place to the last W-1 inputs. Multi-token input (spec verification) therefore leaves the state after the
    last draft token: rolling back rejected drafts is the caller's job. Every row is processed (vLLM skips
    padded rows whose index is the null block; drop them before calling).

    Args:
        x: `[N, D]` (one token each) or `[N, Tq, D]`.
        conv_state: `[M, D, state_len >= W-1]`, updated in place (a strided view of vLLM's cache works).
        weight: `[D, W]`. activation: None, "silu" or "swish". bias: optional `[D]`.
        conv_state_indices: int `[N]` rows of conv_state per sequence; rows 0..N-1 when None.

    Returns:
        y, same shape and dtype as x.
    """
    ns = _check(weight, activation)
    x3 = x[:, None] if x.dim() == 2 else x  # [N, Tq, D]
    if x3.dim() != 3 or conv_state.dim() != 3 or conv_state.shape[1] != x3.shape[-1] or conv_state.shape[2] < ns:
        raise ValueError(f"`x` must be [N, D] or [N, Tq, D] and `conv_state` [M, D, >= W-1={ns}], "
                         f"got {list(x.shape)} and {list(conv_state.shape)}.")
    idx = torch.arange(x3.shape[0], device=x.device) if conv_state_indices is None else conv_state_indices.long()
    x_ext = torch.cat([conv_state[idx, :, :ns].float(), x3.float().transpose(1, 2)], dim=-1)  # [N, D, W-1+Tq]
    y = _conv(x_ext, weight, bias, activation).transpose(1, 2)  # [N, Tq, D]
    conv_state[idx, :, :ns] = x_ext[..., x_ext.shape[-1] - ns:].to(conv_state.dtype)
    return y.reshape(x.shape).to(x.dtype)
