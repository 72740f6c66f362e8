"""A draft vocabulary for the MTP draft: it proposes its token among N frequent ids only (as FR-Spec does).

The draft's one costly matrix is the LM head it shares with the target: 157,184 x 2,560, 0.40 GB in FP8, read once
per verify step just to pick one token. Over a draft vocabulary of N ids the draft reads N rows instead,
  token = ids[argmax_j h · W[ids_j]ᵀ · s[ids_j]]      (s: the FP8 head's per-row scale; 1 for a BF16 head)
0.084 GB for N = 32,768 in FP8 (docs/speed.md §MTP). The target still verifies every proposal, so what is served is
the same whatever the subset; a token outside it can never be proposed, which costs acceptance. The ids come from a
file `python3 -m ling_tools.draft_vocab` counts on the owner's own text (`VLLM_LING_DRAFT_VOCAB=<path>`;
the file: vllm_ling/draft/vocab_file.py).

vLLM (0.32, 0.33) asks a draft model for `get_top_tokens(h)` instead of its logits when the speculative config has
`use_local_argmax_reduction: true` and drafts are greedy (its default); `compat.draft_top_tokens_key` names that key.
The rows are gathered once, on the draft's first forward (after vLLM's proposer hands it the target's head, and
eagerly: vLLM warms each CUDA graph up before capturing it), into tensors of their own: N x 2,560 more bytes.
"""

from __future__ import annotations

import logging

import torch

from vllm_ling import startup_log
from vllm_ling.draft.vocab_file import ENV, load_ids, requested_path
from vllm_ling.ops.router_gemm import MAX_TOKENS, router_gemm_small

logger = logging.getLogger("vllm_ling")

FP8 = torch.float8_e4m3fn


def head_rows(lm_head: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The head's rows `ids` as served, [N, hidden], and their per-row scales (FP8 per channel) or None.

    A BF16 head's weight is [V, hidden]; vLLM's per-channel FP8 method (`VLLM_LING_FP8_SCHEME=channel`, `w8a8`)
    keeps the FP8 weight as the transpose view [hidden, V] with a [V, 1] fp32 scale. The block method (the default
    scheme, `w8a8`) keeps W8 [V, hidden] with one scale per 128 x 128 block, [ceil(V/128), ceil(hidden/128)]: a
    gathered row mixes blocks, so its rows are dequantized once, W = W8 · s_b (fp32, then the model dtype), which
    still reads fewer bytes per draft step than the whole FP8 head. FP8-Marlin (`w8a16`) repacks the weight into
    tiles whose rows cannot be gathered: refused."""
    weight, scale = lm_head.weight, getattr(lm_head, "weight_scale", None)
    if weight.dtype in (torch.bfloat16, torch.float16, torch.float32) and scale is None:
        return weight[ids].contiguous(), None
    if weight.dtype == FP8 and scale is not None and scale.numel() in weight.shape:
        by_row = weight if weight.shape[0] == scale.numel() else weight.t()
        return by_row[ids].contiguous(), scale.reshape(-1)[ids].to(torch.float32).contiguous()
    blocks = getattr(lm_head, "weight_scale_inv", None)
    if weight.dtype == FP8 and blocks is not None and blocks.dim() == 2:
        rows = _block_rows(weight, blocks, ids)
        if rows is not None:
            return rows, None
    raise ValueError(f"vllm-ling: {ENV} needs an LM head whose rows can be gathered (BF16, or FP8 with "
                     f"VLLM_LING_FP8_KERNEL=w8a8, the default); this one holds {weight.dtype} {tuple(weight.shape)}"
                     f" with scale {None if scale is None else tuple(scale.shape)}. Serve with w8a8, or unset {ENV}")


def _block_rows(weight: torch.Tensor, blocks: torch.Tensor, ids: torch.Tensor,
                block: int = 128) -> torch.Tensor | None:
    """Rows `ids` of a 128 x 128 block-scaled FP8 weight [V, K] (or its transpose view), dequantized in fp32 and
    returned in bf16; None when the scale grid does not match the weight's shape (a layout we do not know)."""
    by_row = weight if blocks.shape[0] == -(-weight.shape[0] // block) else weight.t()
    v, k = by_row.shape
    if tuple(blocks.shape) != (-(-v // block), -(-k // block)):
        return None
    s = blocks.float()[ids // block].repeat_interleave(block, 1)[:, :k]
    return (by_row[ids].float() * s).to(torch.bfloat16).contiguous()


class DraftVocab:
    """The draft's top token over its vocabulary (module docstring); rows gathered by `bind` from the served head."""

    def __init__(self, ids: list[int], vocab_size: int) -> None:
        self.ids_list, self.vocab_size = ids, vocab_size
        self.ids: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def bind(self, lm_head: torch.nn.Module) -> None:
        """Gather the rows from the head the draft serves with (once; not while a CUDA graph is captured)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("vllm-ling: the draft vocabulary's rows must be gathered before CUDA graph capture; "
                               f"the draft's first forward ran inside a capture. Unset {ENV} to serve without it")
        device = lm_head.weight.device
        self.ids = torch.tensor(self.ids_list, dtype=torch.long, device=device)
        self.rows, self.scale = head_rows(lm_head, self.ids)
        mib = self.rows.numel() * self.rows.element_size() / 2**20
        logger.info("%s", startup_log.DRAFT_VOCAB.text(ids=len(self.ids_list), vocab=self.vocab_size, env=ENV, mib=mib,
                                                       dtype=self.rows.dtype))

    def top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """ids[argmax(h · rowsᵀ · scale)] per row of h, the logits in fp32."""
        if self.rows is None:
            raise RuntimeError("vllm-ling: DraftVocab.top_tokens before bind(): the draft never ran its forward")
        return self.ids[self.logits(hidden_states).argmax(dim=-1)]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the vocabulary's ids: our small-M kernel on CUDA (16 rows a pass), torch elsewhere."""
        if not h.is_cuda:
            out = torch.nn.functional.linear(h.to(torch.float32), self.rows.to(torch.float32))
            return out if self.scale is None else out * self.scale
        chunks = [router_gemm_small(h[i:i + MAX_TOKENS], self.rows, scale=self.scale)
                  for i in range(0, h.shape[0], MAX_TOKENS)]
        return torch.cat(chunks) if chunks else h.new_empty((0, self.rows.shape[0]), dtype=torch.float32)


def from_env(vocab_size: int) -> DraftVocab | None:
    """The draft vocabulary `VLLM_LING_DRAFT_VOCAB` names, validated now (start-up), or None when unset."""
    path = requested_path()
    return None if path is None else DraftVocab(load_ids(path, vocab_size), vocab_size)
