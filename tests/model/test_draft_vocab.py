"""The MTP draft's vocabulary (vllm_ling/draft/vocab.py): the head rows it gathers (BF16, and vLLM's per-channel FP8
layout), its top token against the full logits restricted to its ids, on the CPU, and when the draft takes it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_helpers import draft_vocab_file

pytest.importorskip("vllm")

from vllm_ling.draft import vocab as draft_vocab  # noqa: E402
from vllm_ling.draft.vocab import DraftVocab, head_rows  # noqa: E402
from vllm_ling.draft.vocab_file import FORMAT  # noqa: E402

V, K = 300, 64


def _bf16_head(seed: int = 0) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(weight=torch.randn(V + 20, K, generator=gen).to(torch.bfloat16))  # padded rows past V


def _fp8_head(seed: int = 0) -> tuple[SimpleNamespace, torch.Tensor]:
    """vLLM's per-channel online FP8 layout: the FP8 weight kept as the transpose view [K, V], scale [V, 1]."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(V + 20, K, generator=gen)
    scale = w.abs().amax(dim=1, keepdim=True) / 448.0
    q = (w / scale).to(draft_vocab.FP8)
    return SimpleNamespace(weight=q.t(), weight_scale=scale), q.to(torch.float32) * scale  # head, its dequantized W


def test_bf16_rows_are_the_heads_rows():
    head, ids = _bf16_head(), torch.tensor([5, 0, 299, 17])
    rows, scale = head_rows(head, ids)
    assert scale is None and torch.equal(rows, head.weight[ids]) and rows.is_contiguous()


def test_fp8_rows_and_scales_come_from_the_transposed_layout():
    (head, dequant), ids = _fp8_head(), torch.tensor([5, 0, 299, 17])
    rows, scale = head_rows(head, ids)
    assert rows.dtype == draft_vocab.FP8 and rows.shape == (4, K) and scale.shape == (4,)
    assert torch.equal(rows.to(torch.float32) * scale[:, None], dequant[ids])


def test_block_fp8_rows_are_the_dequantized_heads_rows():
    """The block scheme's head, W8 [V, K] with one scale per 128 x 128 block (vLLM's online block method): the
    gathered rows are W8 · s_b of exactly those rows, each row reading the scale of its own block of rows."""
    gen = torch.Generator().manual_seed(3)
    v, k = 300, 256  # three row blocks (the last one partial), two column blocks
    w = torch.randn(v, k, generator=gen) * torch.linspace(0.1, 4.0, v)[:, None]
    pad = torch.zeros(384, k)
    pad[:v] = w
    s = pad.view(3, 128, 2, 128).abs().amax(dim=(1, 3)) / 448.0  # [ceil(v/128), k/128]
    q = (w / s.repeat_interleave(128, 0)[:v].repeat_interleave(128, 1)).to(draft_vocab.FP8)
    head = SimpleNamespace(weight=q, weight_scale_inv=s)
    ids = torch.tensor([299, 0, 130, 127, 128, 5])
    rows, scale = head_rows(head, ids)
    want = q.float()[ids] * s[ids // 128].repeat_interleave(128, 1)
    assert scale is None and rows.dtype == torch.bfloat16 and rows.shape == (6, k)
    torch.testing.assert_close(rows.float(), want.to(torch.bfloat16).float())
    assert (rows.float() - w[ids]).abs().max() < 0.1 * w[ids].abs().max()  # and it is W, to FP8's precision


def test_a_head_whose_rows_cannot_be_gathered_is_refused():
    marlin = SimpleNamespace(weight=torch.zeros(K // 16, V * 2, dtype=torch.int32), weight_scale=torch.ones(1, V))
    with pytest.raises(ValueError, match="VLLM_LING_FP8_KERNEL=w8a8"):
        head_rows(marlin, torch.tensor([1]))


def _bound(ids: list[int], head) -> DraftVocab:
    vocab = DraftVocab(ids, V)
    vocab.bind(head)
    return vocab


@pytest.mark.parametrize("fp8", [False, True])
def test_the_top_token_is_the_full_logits_argmax_over_the_vocabulary(fp8):
    """Independent reference: the whole head's fp32 logits, every id outside the vocabulary masked."""
    head, weight = _fp8_head(1) if fp8 else (_bf16_head(1), None)
    weight = weight if fp8 else head.weight.to(torch.float32)
    h = torch.randn(6, K, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    full = h.to(torch.float32) @ weight.t()
    ids = sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:40].tolist())
    masked = torch.full_like(full, float("-inf"))
    masked[:, ids] = full[:, ids]
    assert torch.equal(_bound(ids, head).top_tokens(h), masked.argmax(dim=-1))
    everything = _bound(list(range(V)), head).top_tokens(h)
    assert torch.equal(everything, full[:, :V].argmax(dim=-1))  # the whole vocabulary: the plain greedy draft
    without_top = [i for i in range(V) if i not in set(everything.tolist())]
    assert not set(_bound(without_top, head).top_tokens(h).tolist()) & set(everything.tolist())  # control


def test_top_tokens_before_bind_is_an_error():
    with pytest.raises(RuntimeError, match="before bind"):
        DraftVocab([1], V).top_tokens(torch.zeros(1, K))


def _vllm_config(tp: int = 1, top_tokens: bool = True) -> SimpleNamespace:
    spec = SimpleNamespace(use_local_argmax_reduction=top_tokens)
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp), speculative_config=spec)


def test_the_draft_reads_the_file_only_where_vllm_asks_it_for_top_tokens(tmp_path, monkeypatch):
    from vllm_ling.draft.mtp import _draft_vocab

    assert _draft_vocab(_vllm_config(), V) is None  # unset: the whole head
    monkeypatch.setenv(draft_vocab.ENV, draft_vocab_file(tmp_path, "v", [3, 1]))
    assert _draft_vocab(_vllm_config(), V).ids_list == [3, 1]
    with pytest.raises(ValueError, match="use_local_argmax_reduction.*true"):
        _draft_vocab(_vllm_config(top_tokens=False), V)
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        _draft_vocab(_vllm_config(tp=2), V)
