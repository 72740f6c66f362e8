"""Torch-native KDA (Kimi Delta Attention) ops: the forget gate, the chunked prefill and the recurrent decode.

vLLM's KDA kernels (`vllm.third_party.flash_linear_attention.ops.kda`) are Triton-only, so vLLM's CPU engine
runs these instead. `chunk_kda_torch` and `recurrent_kda_torch` keep the calling convention of vLLM's vendored
`chunk_kda` / `fused_recurrent_kda`: q, k `[B, T, H, K]`, v `[B, T, H, V]`, natural-log decay g `[B, T, H, K]`,
beta `[B, T, H]`, packed varlen through `cu_seqlens` (then B = 1), and recurrent states stored **V-major**,
`[N, H, V, K]`, the transpose of the math layout below (and of FLA-naive's `[K, V]`).

Per head, with the state S ∈ ℝ^{K×V} in math layout (docs/architecture.md §KDA, step 6):

    S̄_t = Diag(exp(g_t)) · S_{t-1}                  decay acts on the key channels
    S_t = S̄_t + β_t · k_t · (v_t − S̄_tᵀ k_t)ᵀ       delta-rule write
    o_t = S_tᵀ (scale · q_t)

The ground truth is flash-linear-attention's `naive_recurrent_kda` (`fla/ops/kda/naive.py`); tests/ops compares
both ops against it. All math runs in fp32: inputs are upcast on entry and only `o` is cast back to v's dtype.
"""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # q / sqrt(Σq² + eps), as in vLLM's l2norm_fwd and the fused recurrent kernel
CHUNK_SIZE = 64  # FLA_CHUNK_SIZE; any positive size gives the same result up to rounding


# ----------------------------------------------------------------------------------------------------------------
# Forget gate
# ----------------------------------------------------------------------------------------------------------------


def _gate_input(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (f + dt_bias as fp32 `[..., H, K]`, exp(A_log) as fp32 `[H, 1]`)."""
    H = A_log.numel()  # [H] in the checkpoint; Kimi's legacy [1, 1, H, 1] has the same numel
    if f.dim() == 2:  # [T, H*K]
        if f.shape[-1] % H:
            raise ValueError(f"`f` of shape {list(f.shape)} must be [T, H*K] with H={H} (A_log.numel()).")
        f = f.unflatten(-1, (H, f.shape[-1] // H))
    elif f.dim() < 2 or f.shape[-2] != H:
        raise ValueError(f"`f` must be [T, H*K] or [..., H, K] with H={H} (A_log.numel()), got {list(f.shape)}.")
    K = f.shape[-1]
    if dt_bias.numel() != H * K:
        raise ValueError(f"`dt_bias` must have H*K={H * K} elements, got shape {list(dt_bias.shape)}.")
    # fp32: the decay compounds over thousands of tokens, a bf16 gate would quantise every step.
    a = f.float() + dt_bias.float().view(H, K)
    return a, A_log.float().view(H, 1).exp()


def kda_safe_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float = -5.0,
) -> torch.Tensor:
    """Ling-3.0's bounded forget gate, in fp32: g = λ · sigmoid(exp(A_log_h) · (f + dt_bias)), λ = `lower_bound`.

    g ∈ (λ, 0), so the per-step decay exp(g) ∈ (e^λ, 1); with λ = -5 the strongest forgetting keeps
    e⁻⁵ ≈ 0.0067 of the state. With VLLM_LING_KDA_GATE=ours (and on the CPU) the plugin computes this gate
    itself and hands the log-space g to `chunk_kda` / `fused_recurrent_kda`; vLLM's raw-gate kernels apply the
    same law inside (docs/vllm-seams.md §KDA kernels).

    Args:
        f: forget-gate projection, `[T, H*K]` or `[..., H, K]`, any float dtype.
        A_log: per-head log decay rate, `[H]`.
        dt_bias: per-channel bias, `[H*K]`.
        lower_bound: λ, must be negative. Default: `-5.0` (`kda_lower_bound`).

    Returns:
        fp32 log-space decay g of shape `[..., H, K]` (`[T, H, K]` for a 2-D `f`).
    """
    if not lower_bound < 0:
        raise ValueError(f"`lower_bound` must be negative (log-space decay), got {lower_bound}; Ling uses -5.0.")
    a, rate = _gate_input(f, A_log, dt_bias)
    return lower_bound * torch.sigmoid(rate * a)


def kda_softplus_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    threshold: float = 20.0,
) -> torch.Tensor:
    """Kimi's unbounded forget gate, in fp32: g = -exp(A_log_h) · softplus(f + dt_bias), softplus threshold 20.

    Not Ling-3.0's law (g is unbounded below); kept so tests can show that a model run with it differs.
    Same shapes as `kda_safe_gate`.
    """
    a, rate = _gate_input(f, A_log, dt_bias)
    return -rate * F.softplus(a, threshold=threshold)


# ----------------------------------------------------------------------------------------------------------------
# Shared input handling
# ----------------------------------------------------------------------------------------------------------------


def _spans(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """Token ranges [bos, eos) of the sequences in the flattened [B*T] token axis."""
    if cu_seqlens is None:
        return [(b * T, (b + 1) * T) for b in range(B)]
    if B != 1:
        raise ValueError(f"The batch size must be 1 when `cu_seqlens` is given, got {B}; flatten varlen inputs.")
    cu = cu_seqlens.tolist()
    if cu_seqlens.dim() != 1 or len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(a > b for a, b in pairwise(cu)):
        raise ValueError(f"`cu_seqlens` must be non-decreasing [0, ..., T={T}], got {cu}.")
    return list(pairwise(cu))


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float | None,
    initial_state: torch.Tensor | None, use_qk_l2norm_in_kernel: bool, cu_seqlens: torch.Tensor | None,
) -> tuple:
    """Check shapes, flatten to [B*T, H, ...] fp32, apply the in-kernel L2 norm and the scale to q.

    Returns (q, k, v, g, beta, S0 [N, H, K, V] in math layout (a view of initial_state), spans).
    """
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(
            f"q, k and g must share the shape [B, T, H, K], got {list(q.shape)}, {list(k.shape)}, {list(g.shape)}."
        )
    B, T, H, K = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V]={[B, T, H, 'V']}, got {list(v.shape)} (grouped heads unsupported).")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H]={[B, T, H]}, got {list(beta.shape)} (head-wise beta only).")
    V = v.shape[-1]
    spans = _spans(T, B, cu_seqlens)
    if initial_state is not None:
        if initial_state.shape != (len(spans), H, V, K):
            raise ValueError(f"initial_state must be [N, H, V, K]={[len(spans), H, V, K]} (vLLM's V-major layout), "
                             f"got {list(initial_state.shape)}.")
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32 (states accumulate in fp32), got {initial_state.dtype}.")
    q, k, v, g, beta = (x.reshape(B * T, *x.shape[2:]).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + L2NORM_EPS)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * (K**-0.5 if scale is None else scale)
    if initial_state is None:
        S0 = q.new_zeros(len(spans), H, K, V)
    else:
        S0 = initial_state.transpose(-1, -2)  # V-major [N, H, V, K] -> math layout [N, H, K, V]
    return q, k, v, g, beta, S0, spans


# ----------------------------------------------------------------------------------------------------------------
# Chunked (parallel) form, for prefill
# ----------------------------------------------------------------------------------------------------------------


def _decay_scores(x: torch.Tensor, k: torch.Tensor, G: torch.Tensor, block: int) -> torch.Tensor:
    """S_rc = Σ_i x_ri k_ci exp(Γ_ri − Γ_ci) for c ≤ r, zero above the diagonal; x, k, G: [H, C, K] -> [H, C, C].

    exp(Γ_r − Γ_c) is factored as exp(Γ_r − Γ_s)·exp(Γ_s − Γ_c) around the first row s of each block of
    `block` rows, so the scores are two matmuls per block instead of an [H, C, C, K] tensor. Both factors stay
    within fp32 range while the decay summed over a block is above -80 (see `_row_block`); factoring around the
    chunk start instead would overflow once a chunk's decay sums below ≈ -88 (64 steps at -5 reach -320).
    """
    C = k.shape[1]
    scores = x.new_zeros(C, C).expand(x.shape[0], C, C).clone()
    for s in range(0, C, block):
        e = min(s + block, C)
        ref = G[:, s : s + 1]
        k_ref = k[:, :e] * (ref - G[:, :e]).exp()  # ≤ 1 for c ≤ s, ≤ e^80 inside the block
        scores[:, s:e, :e] = (x[:, s:e] * (G[:, s:e] - ref).exp()) @ k_ref.transpose(1, 2)
    return scores.tril()


def _row_block(g: torch.Tensor) -> int:
    """Largest row block (≤ 16) whose decay sums stay above -80: 16 for Ling's safe gate (g > -5)."""
    strongest = -g.min().item() if g.numel() else 0.0
    return max(1, min(16, int(1 + 80 / strongest))) if strongest > 0 else 16


def _kda_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens for all heads (docs/architecture.md §KDA, the chunked form), fp32.

    q (already scaled), k, g: [H, C, K]; v: [H, C, V]; beta: [H, C]; S: [H, K, V]. Returns (o [H, C, V], S).
    With Γ = cumsum(g) over the chunk:
        A_rc   = β_r Σ_i k_ri k_ci exp(Γ_ri − Γ_ci)  (c < r)
        Aqk_rc = Σ_i q_ri k_ci exp(Γ_ri − Γ_ci)      (c ≤ r)
        W, U   = (I + A)⁻¹ Diag(β) · [exp(Γ) ⊙ K, V]               (WY representation)
        V′     = U − W S
        O      = (Q ⊙ exp(Γ)) S + Aqk V′
        S_next = Diag(exp(Γ_C)) S + (exp(Γ_C − Γ) ⊙ K)ᵀ V′
    """
    C, K = k.shape[-2:]
    G = g.cumsum(1)
    Aqk = _decay_scores(q, k, G, block)
    A = _decay_scores(k, k, G, block).tril(-1) * beta[..., None]
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * torch.cat([G.exp() * k, v], dim=-1)
    W, U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True).split([K, v.shape[-1]], -1)
    v_new = U - W @ S
    o = (q * G.exp()) @ S + Aqk @ v_new
    G_last = G[:, -1:]  # [H, 1, K]
    S = G_last.transpose(1, 2).exp() * S + ((G_last - G).exp() * k).transpose(1, 2) @ v_new
    return o, S


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA for prefill; same calling convention as vLLM's vendored `chunk_kda`.

    Vectorised over heads, looping over sequences and chunks of `chunk_size` tokens (the last chunk of a
    sequence may be shorter, so any length works). Computed in fp32 throughout; unlike vLLM's kernel, the
    L2-normalised q/k and the WY matrices are not rounded to the input dtype.

    Args:
        q, k: `[B, T, H, K]`. v: `[B, T, H, V]`.
        g: natural-log per-channel decay `[B, T, H, K]` (e.g. `kda_safe_gate`).
        beta: write strength `[B, T, H]`.
        scale: applied to q. Default: `K ** -0.5`.
        initial_state: fp32 `[N, H, V, K]` (V-major, as vLLM stores it); zeros when None.
        output_final_state: also return the fp32 state after each sequence, `[N, H, V, K]`.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6) first. Ling passes True.
        cu_seqlens: int `[N+1]` offsets of N packed sequences (B must be 1); else the B rows are the sequences.
        chunk_size: tokens per chunk. Default: 64.

    Returns:
        (o `[B, T, H, V]` in v's dtype, final state or None).
    """
    if chunk_size < 1:
        raise ValueError(f"`chunk_size` must be positive, got {chunk_size}; vLLM uses 64.")
    out_shape, out_dtype = v.shape, v.dtype
    q, k, v, g, beta, S0, spans = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                           cu_seqlens)
    if g.numel() and g.max() > 0:
        raise ValueError(f"`g` is a log-space decay and must be <= 0, got max {g.max().item():.4g}; "
                         "compute it with `kda_safe_gate`.")
    block = _row_block(g)
    o = v.new_empty(v.shape)
    final = []
    for n, (bos, eos) in enumerate(spans):
        S = S0[n]
        for s in range(bos, eos, chunk_size):
            e = min(s + chunk_size, eos)
            o_c, S = _kda_chunk(*(x[s:e].transpose(0, 1) for x in (q, k, v, g, beta)), S, block)
            o[s:e] = o_c.transpose(0, 1)
        final.append(S.transpose(-1, -2))
    final_state = torch.stack(final).contiguous() if output_final_state else None
    return o.view(out_shape).to(out_dtype), final_state


# ----------------------------------------------------------------------------------------------------------------
# Recurrent form, for decode and speculative verification
# ----------------------------------------------------------------------------------------------------------------


def _delta_rule_steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    states: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence for a batch of equal-length sequences, fp32.

    q (already scaled), k, g: [B, L, H, K]; v: [B, L, H, V]; beta: [B, L, H]; S: [B, H, K, V].
    Writes the state after token t into `states[:, t]` ([B, L, H, K, V]) when given. Returns (o [B, L, H, V], S).
    """
    o = v.new_empty(v.shape)
    for t in range(q.shape[1]):
        k_t = k[:, t, :, None, :]  # [B, H, 1, K]
        S = S * g[:, t, :, :, None].exp()  # S̄
        u = beta[:, t, :, None] * (v[:, t] - (k_t @ S).squeeze(-2))  # β (v − S̄ᵀk), [B, H, V]
        S = S + k_t.transpose(-1, -2) * u[:, :, None, :]
        o[:, t] = (q[:, t, :, None, :] @ S).squeeze(-2)
        if states is not None:
            states[:, t] = S
    return o, S


def recurrent_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    return_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Recurrent KDA (the delta rule in the module docstring), for decode and MTP verification.

    Same arguments and layouts as `chunk_kda_torch`; fp32 state math. Sequences of equal length (a decode
    batch, a verify batch) are stepped together; ragged batches loop over sequences.

    Returns:
        (o `[B, T, H, V]` in v's dtype, final state fp32 `[N, H, V, K]`), plus, with `return_all_states`, the
        fp32 state after every token `[B*T, H, V, K]` (what vLLM's `fused_recurrent_kda_fwd` writes per draft
        slot when verifying speculative tokens).
    """
    out_shape, out_dtype = v.shape, v.dtype
    q, k, v, g, beta, S0, spans = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel,
                                           cu_seqlens)
    H, K, V = S0.shape[1:]
    states = q.new_empty(q.shape[0], H, K, V) if return_all_states else None
    lens = {eos - bos for bos, eos in spans}
    if len(lens) == 1:  # one batched pass: [N*L, ...] -> [N, L, ...]
        L = lens.pop()
        o, S = _delta_rule_steps(*(x.unflatten(0, (len(spans), L)) for x in (q, k, v, g, beta)), S0,
                                 None if states is None else states.unflatten(0, (len(spans), L)))
        final_state = S
    else:
        o, final = v.new_empty(v.shape), []
        for n, (bos, eos) in enumerate(spans):
            o_n, S = _delta_rule_steps(*(x[None, bos:eos] for x in (q, k, v, g, beta)), S0[n][None],
                                       None if states is None else states[None, bos:eos])
            o[bos:eos] = o_n[0]
            final.append(S[0])
        final_state = torch.stack(final)
    o = o.reshape(out_shape).to(out_dtype)
    final_state = final_state.transpose(-1, -2).contiguous()
    if return_all_states:
        return o, final_state, states.transpose(-1, -2).contiguous()
    return o, final_state
