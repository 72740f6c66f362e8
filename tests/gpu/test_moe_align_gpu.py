"""Our one-program MoE token alignment on the GPU against vLLM's own CUDA op, on the same routed ids, and the time
per call of both inside a CUDA graph (recorded, not asserted).

Same layout means: the same padded total, the same expert per block (past the total too), the same rows in each expert's range
(in any order: vLLM's op orders them by atomics) and sentinels in the same places; with 0.33's scatter_idx, the
same scatter map. Ling-3.0-flash's routing: 512 experts, top-8. Run: pytest tests/gpu/test_moe_align_gpu.py -q
"""

from __future__ import annotations

import inspect

import pytest
import torch
from gpu_helpers import graph_us, record  # importing gpu_helpers skips the module without CUDA
from vllm import _custom_ops as ops

from vllm_ling.ops.moe_align import MAX_ROWS, moe_align_small

E, K = 512, 8
TOKENS = (1, 2, 4, 8, 16)
BLOCKS = (8, 16, 32, 64)
VLLM_OP = getattr(ops.moe_align_block_size, "vllm_ling_wraps", ops.moe_align_block_size)
SCATTER = "scatter_idx" in inspect.signature(VLLM_OP).parameters  # vLLM 0.33


def _ids(tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(tokens)]).int().cuda()


def _buffers(numel: int, block: int) -> tuple[torch.Tensor, ...]:
    """Sized as vLLM's moe_align_block_size() sizes them; filled with a value neither op writes."""
    padded = min(numel * block, numel + E * (block - 1))
    return (torch.full((padded,), -7, dtype=torch.int32, device="cuda"),
            torch.full((-(-padded // block),), -7, dtype=torch.int32, device="cuda"),
            torch.full((1,), -7, dtype=torch.int32, device="cuda"))


def _vllm(ids, block, bufs, scatter):
    VLLM_OP(ids, E, block, *bufs, None, **({"scatter_idx": scatter} if scatter is not None else {}))


def _ours(ids, block, bufs, scatter):
    moe_align_small(ids, E, block, *bufs, scatter)


def _layout(ids: torch.Tensor, block: int, bufs: tuple[torch.Tensor, ...]) -> dict:
    sorted_ids, expert_ids, total = (b.cpu() for b in bufs)
    t = int(total.item())
    groups = {e: sorted(sorted_ids[s:s + block * n].tolist())  # every row (and sentinel) in each expert's range
              for e, s, n in _ranges(expert_ids[: t // block].tolist(), block)}
    return {"total": t, "experts": expert_ids.tolist(), "groups": groups,  # past the total too (TAIL_EXPERT)
            "sentinels": (sorted_ids == ids.numel()).nonzero().flatten().tolist()}


def _ranges(experts: list[int], block: int) -> list[tuple[int, int, int]]:
    """(expert, first row, blocks) for each run of blocks of one expert."""
    runs = []
    for b, e in enumerate(experts):
        if runs and runs[-1][0] == e:
            runs[-1][2] += 1
        else:
            runs.append([e, b * block, 1])
    return [tuple(r) for r in runs]


@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_our_layout_is_vllms(tokens, block):
    ids = _ids(tokens)
    assert ids.numel() <= MAX_ROWS
    layouts, scatters = [], []
    for fn in (_vllm, _ours):
        bufs = _buffers(ids.numel(), block)
        scatter = torch.full((ids.numel(), 1), -7, dtype=torch.int32, device="cuda") if SCATTER else None
        fn(ids, block, bufs, scatter)
        torch.cuda.synchronize()
        layouts.append(_layout(ids, block, bufs))
        scatters.append(None if scatter is None else scatter.flatten().tolist())
    diff = [(i, a, b) for i, (a, b) in enumerate(zip(layouts[0]["experts"], layouts[1]["experts"])) if a != b]
    assert not diff, (f"expert ids differ at {len(diff)} blocks (index, vLLM, ours), first {diff[:6]}; "
                      f"padded total {layouts[0]['total']} rows = {layouts[0]['total'] // block} blocks")
    assert layouts[0] == layouts[1]
    assert scatters[0] == scatters[1]
    assert layouts[1]["total"] == sum(-(-n // block) * block for n in _counts(ids).values())


def _counts(ids: torch.Tensor) -> dict[int, int]:
    return {e: n for e, n in enumerate(torch.bincount(ids.flatten().long(), minlength=E).tolist()) if n}


def test_time_per_call_beside_vllms_op():
    rows = {}
    for tokens in TOKENS:
        ids, block = _ids(tokens), 16
        for name, fn in (("ours_us", _ours), ("vllm_us", _vllm)):
            bufs = _buffers(ids.numel(), block)
            scatter = torch.empty(ids.numel(), 1, dtype=torch.int32, device="cuda") if SCATTER else None

            def calls(fn=fn, bufs=bufs, scatter=scatter):
                for _ in range(200):
                    fn(ids, block, bufs, scatter)
            rows.setdefault(tokens, {})[name] = round(graph_us(calls, 200), 3)
    record("moe_align_kernel", {"experts": E, "top_k": K, "block": 16, "per_tokens": rows,
                                "device": torch.cuda.get_device_name(), "scatter_idx": SCATTER})
    print(rows)
    assert all(r["ours_us"] > 0 and r["vllm_us"] > 0 for r in rows.values())
