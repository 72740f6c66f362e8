"""Inside vLLM: the MTP draft must run on the target's LM head and embedding, quantized or not (docs/speed.md §MTP).

vLLM's proposer hands the draft the target's `lm_head` and `embed_tokens` modules. A draft left with its own
head reads whatever its own parameters hold; with the FP8 LM head (vllm_ling.fp8) that trap is silent: a draft
whose head holds the target's FP8 bytes but a BF16 method reads them as BF16, its guesses are garbage and the
acceptance falls to nothing, with no error (NVIDIA's Spark guide for this model saw accept length 1.00 so).
`check_draft_shares_target` runs on the draft's first step and raises unless each of the two modules is the
target's, or matches it exactly: the same quantization method class and equal parameters (FP8 weight and
scales alike).
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

logger = logging.getLogger("vllm_ling")

_targets: weakref.WeakSet = weakref.WeakSet()


def register_target(model: nn.Module) -> None:
    _targets.add(model)


def _method(module: nn.Module) -> str:
    return type(getattr(module, "quant_method", None)).__name__


def _params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def compare(name: str, mine: nn.Module, theirs: nn.Module) -> str | None:
    """None when `mine` computes what `theirs` does (the same module, or the same method and equal tensors);
    else what differs."""
    if mine is theirs:
        return None
    if _method(mine) != _method(theirs):
        return f"{name} runs {_method(mine)} where the target runs {_method(theirs)}"
    ours, target = _params(mine), _params(theirs)
    if ours.keys() != target.keys():
        return f"{name} holds {sorted(ours)} where the target holds {sorted(target)}"
    for key, tensor in ours.items():
        other = target[key]
        if tensor.dtype != other.dtype:
            return f"{name}.{key} is {tensor.dtype} where the target's is {other.dtype}"
        if tensor.data_ptr() != other.data_ptr() and not (tensor.shape == other.shape and torch.equal(tensor, other)):
            return f"{name}.{key} differs from the target's"
    return None


def describe(head: nn.Module) -> str:
    weight = head.weight
    return f"{_method(head)}, {str(weight.dtype).removeprefix('torch.')}"


def check_draft_shares_target(draft: nn.Module, label: str = "MTP draft", subject: str = "MTP draft",
                              fix: str = "Serve without --speculative-config or fix the checkpoint.") -> str:
    """Raise unless the draft's lm_head and embedding compute what the target's do (module docstring); log and
    return the verdict line. `label` names the draft in that line, `subject` in the failure, which ends in `fix`.
    Every drafter of ours runs it: the MTP draft and the DSpark drafter (vllm_ling.draft.dspark)."""
    targets = list(_targets)
    if len(targets) != 1:
        raise RuntimeError(f"vllm-ling draft check: expected one target model in this process, found {len(targets)}")
    target = targets[0]
    pairs = (("lm_head", draft.lm_head, target.lm_head),
             ("embedding", draft.model.embed_tokens, target.model.embed_tokens))
    problems = [p for p in (compare(*pair) for pair in pairs) if p]
    if problems:
        raise RuntimeError(f"vllm-ling self-check FAILED: {subject} " + "; ".join(problems) + f". {fix}")
    shared = draft.lm_head is target.lm_head and draft.model.embed_tokens is target.model.embed_tokens
    line = (f"{label}: lm_head and embedding {'shared with' if shared else 'equal to'} the target's "
            f"(lm_head {describe(target.lm_head)})")
    logger.info("vllm-ling self-check: %s", line)
    return line
