"""FlashKDA for the KDA prefill: the fused CUDA kernel vLLM vendors as `vllm._flashkda_C`, where its contract holds.

The contract, read from the schema the extension registers (vLLM 0.33 and 0.34, the same) and from FlashKDA's
source (docs/speed.md §FlashKDA cites both):

    fwd(q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound,
        initial_state=None, final_state=None, cu_seqlens=None, checkpoint_state=None, checkpoint_offsets=None)

- q, k, v, out: bf16 [1, T, H, 128], contiguous. The kernel L2-normalises q and k itself (eps 1e-6 inside the root).
- g: the raw forget-gate projection, bf16 [1, T, H, 128], contiguous. The kernel applies the bounded gate itself, in
  fp32: g = lower_bound · σ(exp(A_log) · (g + dt_bias)) with A_log fp32 [H], dt_bias fp32 [H, 128] and
  lower_bound in [-5, 0) (FlashKDA's documented range; at -5 a 16-token chunk's inverse decay e^80 still fits bf16).
  That is Ling's safe gate (docs/architecture.md §KDA) term for term, so the raw projection goes in as it is.
- beta: the raw β logits, bf16 [1, T, H], any strides (the kernel transposes a copy); σ is applied inside.
- initial_state / final_state: [N, H, V, K] (V-major, the layout of vLLM's KDA cache), fp32 or bf16, contiguous.
- cu_seqlens: int32 or int64 [N + 1]; workspace: uint8, `get_workspace_size(T, H, N)` bytes, which the kernel does
  not check (it would write past a smaller buffer), so each call asks the extension for its own call's size.
- Inside a call the running state is bf16 (a chunk of 16 tokens at a time) and σ is `tanh.approx.f32`; the cache's
  state stays fp32 between calls. The Triton chunk_kda keeps the state fp32: tests/gpu/test_flashkda_gpu.py measures
  both against our fp32 recurrence.

Decode and MTP verification never come here: they stay on vLLM's Triton recurrent kernels (kda_core).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_ling import compat, startup_log

FLASHKDA, TRITON, TORCH = startup_log.KDA_PREFILL_KERNELS  # the prefill kernels, as the start-up line names them
# The --kda-prefill-backend values under which FlashKDA serves wherever its contract holds: `flashkda`, and `auto`
# (vLLM's default; vLLM's own auto serves FlashKDA for its Kimi-K3 and GLM-5.3-Flash layers too). Auto earned it on
# 2026-12-05 (vLLM 0.34.0, one H100): tests/gpu/test_flashkda_gpu.py held FlashKDA's output and final state to our
# fp32 recurrence, within Triton's bf16 bars and 2x Triton's error measured beside it, and one layer's prefill ran
# 2.1-2.4x faster than Triton chunk_kda at 4K-64K tokens (BENCHMARKS.md §KDA prefill). `triton` keeps Triton; every
# other value (Kimi-K3's flashinfer and fused) serves Triton too. The watchdog's preflight keeps a copy
# (ling_watchdog.preflight.FLASHKDA_BACKENDS; tests/watchdog/test_preflight.py holds the two to each other).
SERVES_FLASHKDA = ("auto", "flashkda")
HEAD_DIM = 128
LOWER_BOUND_RANGE = (-5.0, 0.0)  # [low, high)
CAPABILITY_MAJORS = (9, 10, 12)  # sm_90a, sm_100f, sm_120f builds; a GB10 (12.1) runs the sm_120f code
CHUNK = 16  # tokens per tile of FlashKDA's workspace
TILE_BYTES_PER_HEAD = 3 * CHUNK * HEAD_DIM * 2 + HEAD_DIM * 4 + 2 * CHUNK * CHUNK * 2  # k/q decayed, k restored,
# g total (fp32), the 16 x 16 inverse and q·k blocks (bf16): 13,824 B per head per tile


class PrefillChoice(NamedTuple):
    """Which kernel runs a KDA layer's prefill and why; `asked` is --kda-prefill-backend as vLLM hands it on."""

    kernel: str
    reason: str
    asked: str

    @property
    def flashkda(self) -> bool:
        return self.kernel == FLASHKDA

    @property
    def failed(self) -> bool:
        """FlashKDA was asked for by name and does not serve."""
        return self.asked == "flashkda" and not self.flashkda


def contract_gaps(capability: tuple[int, int] | None, dtype: torch.dtype, head_dim: int, lower_bound: float | None,
                  state_dtype: torch.dtype, has_kernel: bool, gate_in_kernel: bool) -> list[str]:
    """Each way this layer falls outside FlashKDA's contract, in words; empty when FlashKDA can serve it exactly."""
    gaps = []
    if capability is None or capability[0] not in CAPABILITY_MAJORS:
        gaps.append(f"CUDA capability {capability} (FlashKDA is built for majors {CAPABILITY_MAJORS})")
    if not has_kernel:
        gaps.append(f"this vLLM has no loadable {compat.FLASHKDA_MODULE}")
    if dtype != torch.bfloat16:
        gaps.append(f"model dtype {dtype} (FlashKDA takes bf16)")
    if head_dim != HEAD_DIM:
        gaps.append(f"head dim {head_dim} (FlashKDA takes {HEAD_DIM})")
    low, high = LOWER_BOUND_RANGE
    if lower_bound is None:
        gaps.append("Kimi's softplus gate (FlashKDA applies only the bounded safe gate)")
    elif not low <= lower_bound < high:
        gaps.append(f"gate lower bound {lower_bound} (FlashKDA takes [{low:g}, {high:g}))")
    if state_dtype not in (torch.float32, torch.bfloat16):
        gaps.append(f"recurrent state {state_dtype} (FlashKDA takes fp32 or bf16)")
    if not gate_in_kernel:
        gaps.append("VLLM_LING_KDA_GATE=ours hands the kernels a computed gate; FlashKDA applies it from the raw "
                    "projection")
    return gaps


def choose(asked: str, *, on_cpu: bool, gaps: list[str]) -> PrefillChoice:
    """The prefill kernel for --kda-prefill-backend `asked` (vLLM's auto | triton | flashkda; a Kimi-only value
    such as flashinfer or fused serves Triton): FlashKDA wherever its contract holds unless Triton is asked for,
    else Triton chunk_kda, the fallback; our torch ops on the CPU engine. With the prefix cache, vLLM ends each
    prefill chunk on a block boundary and the final state either kernel writes is the checkpoint, unless the layers
    declare in-prefill checkpoints, which FlashKDA and the torch path write and Triton cannot (vllm_ling.kda
    `checkpoint_alignment`; docs/speed.md §In-prefill checkpoints)."""
    asked = (asked or "auto").lower()
    if on_cpu:
        return PrefillChoice(TORCH, "the CPU engine: FlashKDA and Triton chunk_kda are CUDA kernels", asked)
    if asked == "triton":
        return PrefillChoice(TRITON, "--kda-prefill-backend triton", asked)
    if asked not in SERVES_FLASHKDA:
        return PrefillChoice(TRITON, f"--kda-prefill-backend {asked} is a Kimi-K3 kernel vllm-ling does not wire",
                             asked)
    if gaps:
        return PrefillChoice(TRITON, "FlashKDA's contract does not hold: " + "; ".join(gaps), asked)
    return PrefillChoice(FLASHKDA, f"--kda-prefill-backend {asked}; bf16, head dim {HEAD_DIM}, bounded gate", asked)


def workspace_bytes(tokens: int, heads: int, seqs: int) -> int:
    """FlashKDA's workspace for a call over `tokens` tokens of `seqs` sequences and `heads` heads: one 16-token tile
    per chunk of each sequence, at most ceil(tokens / 16) + seqs tiles, 13,824 B per head each (FlashKDA's
    `get_workspace_size`; tests/gpu/test_flashkda_gpu.py compares the two)."""
    return heads * (-(-tokens // CHUNK) + seqs) * TILE_BYTES_PER_HEAD


def engine_workspace_bytes(max_batched_tokens: int, max_seqs: int, heads: int) -> int:
    """What one engine reserves for every KDA layer together: the workspace of the largest prefill a step can hold
    (max_num_batched_tokens tokens, no more sequences than tokens). Layers run one after another and share it."""
    return workspace_bytes(max_batched_tokens, heads, min(max_seqs, max_batched_tokens))


def reserve(max_batched_tokens: int, max_seqs: int, heads: int) -> int:
    """Grow vLLM's per-worker scratch (compat.workspace_manager) to the engine's FlashKDA workspace now, while the
    layers are built: vLLM measures the memory the model holds before it sizes the KV cache, and its profiling run
    skips the KDA op, so a buffer first taken at the first prefill would come out of the KV cache's share. The
    manager is locked after warm-up; every later call asks for no more than this. Returns the bytes reserved
    (0 outside a vLLM GPU worker: each call then allocates its own)."""
    manager = compat.workspace_manager()
    if manager is None:
        return 0
    size = engine_workspace_bytes(max_batched_tokens, max_seqs, heads)
    manager.get_simultaneous(((size,), torch.uint8))
    return size


def _workspace(size: int, device: torch.device) -> torch.Tensor:
    manager = compat.workspace_manager()
    if manager is None:
        return torch.empty(size, dtype=torch.uint8, device=device)
    return manager.get_simultaneous(((size,), torch.uint8))[0]


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, raw_g: torch.Tensor, raw_beta: torch.Tensor,
            A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float, initial_state: torch.Tensor,
            cu_seqlens: torch.Tensor, out: torch.Tensor | None = None,
            checkpoint_offsets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(o [1, T, H, d] bf16, final states [N, H, V, K], checkpoint states [N, H, V, K] or None) of the prefill rows
    through FlashKDA, as chunk_kda's raw-gate form returns the first two: q, k, v [1, T, H, d] bf16 (the conv
    output, not normalised), raw_g [1, T, H, d] the forget gate's projection, raw_beta [1, T, H] the β logits,
    initial_state [N, H, V, K] (zero rows for fresh sequences), `out` a contiguous [1, T, H, d] bf16 buffer to write
    o into (else one is allocated). With `checkpoint_offsets` [N] (int32, 0 for none) FlashKDA also writes each
    row's state after that many of its tokens (an in-prefill checkpoint, as vLLM's Kimi layer asks it)."""
    ops = compat.flashkda_ops()
    _, tokens, heads, head_dim = q.shape
    seqs = cu_seqlens.numel() - 1
    size = int(ops.get_workspace_size(tokens, heads, seqs))
    if out is None or not out.is_contiguous():
        out = torch.empty_like(q)
    final_state = torch.empty_like(initial_state)
    checkpoint = None if checkpoint_offsets is None else torch.empty_like(initial_state)
    ops.fwd(q.contiguous(), k.contiguous(), v.contiguous(), raw_g.contiguous(), raw_beta, head_dim**-0.5, out,
            _workspace(size, q.device), A_log.contiguous(), dt_bias.view(heads, head_dim).contiguous(),
            float(lower_bound), initial_state.contiguous(), final_state, cu_seqlens.contiguous(), checkpoint,
            None if checkpoint_offsets is None else checkpoint_offsets.contiguous())
    return out, final_state, checkpoint
