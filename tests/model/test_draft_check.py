"""The MTP draft must run on the target's LM head, FP8 included: the check fails on a head that reads the
target's FP8 bytes through a BF16 method (the silent 0%-acceptance trap), or on one the target's differs from."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vllm_layers import vllm_layer_context

from vllm_ling import fp8
from vllm_ling.draft import check as draft_check

pytest.importorskip("vllm")
VOCAB, HIDDEN = 512, 256


class _Model(nn.Module):
    def __init__(self, head: nn.Module, embed: nn.Module) -> None:
        super().__init__()
        self.lm_head, self.model = head, nn.Module()
        self.model.embed_tokens = embed


def _head(quantized: bool, weight: torch.Tensor) -> nn.Module:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=fp8.LingFp8Config(kernel="w8a8") if quantized else None,
                          prefix="lm_head")
    head.weight.weight_loader(head.weight, weight)
    if not quantized:
        head.quant_method.process_weights_after_loading(head)
    return head


@pytest.fixture(scope="module")
def parts(tiny_bf16):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    with vllm_layer_context(tiny_bf16):
        torch.manual_seed(0)
        weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) / 16
        embed = VocabParallelEmbedding(VOCAB, HIDDEN)
        target = _Model(_head(True, weight), embed)
        yield target, weight, embed, _head(True, weight), None
        draft_check._targets.discard(target)


def _check(target: nn.Module, draft: nn.Module) -> str:
    draft_check._targets.clear()
    draft_check.register_target(target)
    return draft_check.check_draft_shares_target(draft)


def test_a_draft_on_the_targets_fp8_head_passes_and_says_so(parts):
    target, _, embed, _, _ = parts
    line = _check(target, _Model(target.lm_head, embed))
    assert "shared with" in line and "Fp8" in line and "float8_e4m3fn" in line


def test_a_draft_with_its_own_equal_fp8_head_passes(parts):
    target, _, embed, own_fp8, _ = parts
    assert "equal to" in _check(target, _Model(own_fp8, embed))


def test_a_draft_reading_the_fp8_bytes_through_a_bf16_method_fails(parts):
    target, weight, embed, _, _ = parts
    trap = _head(False, weight)
    trap.weight = target.lm_head.weight  # the FP8 tensor, read by UnquantizedEmbeddingMethod
    with pytest.raises(RuntimeError, match="runs Unquantized.* where the target runs Fp8"):
        _check(target, _Model(trap, embed))


def test_a_draft_with_a_bf16_head_under_an_fp8_target_fails(parts):
    target, _, embed, _, _ = parts
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    fresh = _head(False, torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16))
    assert isinstance(fresh, ParallelLMHead)
    with pytest.raises(RuntimeError, match="MTP draft lm_head"):
        _check(target, _Model(fresh, embed))
