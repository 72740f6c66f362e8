"""Our one-program MoE token alignment (vllm_ling.ops.moe_align) against the layout vLLM's CUDA op produces.

The reference below is written from vLLM's `moe_align_block_size` contract (csrc/moe/moe_align_sum_kernels.cu):
rows sorted by expert, each expert's rows padded to the block size with the sentinel `numel`, one expert id
per block (TAIL_EXPERT past the total), the padded total. The order within one expert is free. The kernel runs in
Triton's interpreter in a child process (the `interpret` fixture, tests/ops/conftest.py).
"""

from __future__ import annotations

import json

import pytest

CHILD = r"""
import json, sys
import torch
from vllm_ling.ops.moe_align import TAIL_EXPERT, moe_align_small

def vllm_buffers(numel, experts, block):
    # sized as vllm/model_executor/layers/fused_moe/moe_align_block_size.py sizes them, filled with garbage
    padded = numel + experts * (block - 1)
    if numel < experts:
        padded = min(numel * block, padded)
    blocks = -(-padded // block)
    return (torch.full((padded,), -7, dtype=torch.int32), torch.full((blocks,), -7, dtype=torch.int32),
            torch.full((1,), -7, dtype=torch.int32))

def reference(ids, experts, block, numel):
    flat = ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < experts)
    counts = torch.bincount(flat[valid], minlength=experts)
    padded = (counts + block - 1) // block * block
    start = torch.cumsum(padded, 0) - padded
    return counts, padded, start, int(padded.sum())

def align_and_check(ids, experts, block, scatter):
    # our kernel on vLLM's buffers, then every part of the layout against the reference
    numel = ids.numel()
    sorted_ids, expert_ids, total = vllm_buffers(numel, experts, block)
    sc = torch.full((numel, 1), -7, dtype=torch.int32) if scatter else None
    moe_align_small(ids, experts, block, sorted_ids, expert_ids, total, sc)
    counts, padded, start, tot = reference(ids, experts, block, numel)
    flat = ids.reshape(-1).long()
    rows_ok, pad_ok = True, True
    for e in torch.nonzero(counts).flatten().tolist():
        s, c, p = int(start[e]), int(counts[e]), int(padded[e])
        rows_ok &= sorted(sorted_ids[s:s + c].tolist()) == torch.nonzero(flat == e).flatten().tolist()
        pad_ok &= bool((sorted_ids[s + c:s + p] == numel).all())
    blocks_used = tot // block
    want_blocks = [int(torch.searchsorted(torch.cumsum(padded, 0), b * block, right=True)) for b in range(blocks_used)]
    return {"total": int(total.item()), "total_ref": tot, "rows_ok": rows_ok, "pad_ok": pad_ok,
            "tail_sentinel": bool((sorted_ids[tot:] == numel).all()),
            "experts_ok": expert_ids[:blocks_used].tolist() == want_blocks,
            "experts_tail": bool((expert_ids[blocks_used:] == TAIL_EXPERT).all()),
            "scatter": None if sc is None else sc.flatten().tolist(),
            "invalid_rows": [i for i, e in enumerate(flat.tolist()) if not 0 <= e < experts]}

def all_ok(r):
    return r["total"] == r["total_ref"] and all(r[k] for k in ("rows_ok", "pad_ok", "tail_sentinel", "experts_ok",
                                                               "experts_tail"))

out = []
for tokens, k, experts, block, collide, invalid, scatter in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(tokens * 100 + block)
    pool = max(k, 4) if collide else experts  # a small pool makes tokens share experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    if invalid:
        ids[0, 0] = experts  # out of range: skipped
    out.append(align_and_check(ids, experts, block, scatter))

# random shapes: experts, top-k, tokens (<= MAX_ROWS rows), block sizes 1-64, shared experts, stray ids
import random
rng, fuzz = random.Random(1), []
for _ in range(20):
    experts = rng.choice([8, 40, 64, 512]); k = min(rng.choice([1, 2, 4, 8]), experts)
    tokens, block = rng.randint(1, 128 // k), rng.choice([1, 4, 8, 16, 32, 64])
    pool = rng.choice([k, max(k, 3), experts])
    ids = torch.stack([torch.tensor(rng.sample(range(pool), k)) for _ in range(tokens)]).int()
    if rng.random() < 0.2:
        ids[rng.randrange(tokens), 0] = experts + rng.randrange(3)
    fuzz.append([experts, k, tokens, block, pool, all_ok(align_and_check(ids, experts, block, False))])

# the dispatch: what goes to vLLM's op, unchanged
from vllm_ling.ops.moe_align import MAX_ROWS, wrap
calls = []
op = wrap(lambda *a, **kw: calls.append((a[0].numel(), a[6] is not None, sorted(kw))))
small = torch.zeros(1, 8, dtype=torch.int32)
buf = vllm_buffers(8, 512, 16)
op(small, 512, 16, *buf)                                    # a CPU tensor
op(small, 512, 16, *buf, torch.arange(512), None)            # an expert map
op(small, 512, 16, *buf, None, torch.zeros(8, 1, dtype=torch.int32))  # 0.33's scatter_idx passes through
big = torch.zeros(MAX_ROWS + 8, dtype=torch.int32)
op(big, 512, 16, *vllm_buffers(big.numel(), 512, 16))
print(json.dumps({"cases": out, "fuzz": fuzz, "fallbacks": calls}))
"""

# tokens, top-k, experts, block size, tokens share experts, one out-of-range id, scatter_idx asked
CASES = [
    (1, 8, 512, 16, False, False, False),  # Ling-3.0-flash, one decode token
    (2, 8, 512, 64, False, False, True),  # MTP verify (2 rows per expert at most), Humming's scatter_idx
    (16, 8, 512, 32, True, False, False),  # 128 rows (MAX_ROWS) on 8 experts: 16 rows each, half a block
    (5, 3, 40, 8, True, True, True),  # an id out of range is skipped; odd sizes
]


@pytest.fixture(scope="module")
def results(interpret) -> dict:
    pytest.importorskip("vllm")
    return interpret(CHILD, json.dumps(CASES), timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"T{c[0]}-k{c[1]}-E{c[2]}-B{c[3]}" for c in CASES])
def test_kernel_lays_rows_out_as_vllms_op(results, case):
    """Every row at its expert's padded place, sentinels between and after, one expert per block, the total."""
    r = results["cases"][case]
    assert r["total"] == r["total_ref"]
    assert r["rows_ok"] and r["pad_ok"] and r["tail_sentinel"]
    assert r["experts_ok"] and r["experts_tail"]
    if r["scatter"] is not None:  # identity for the rows routed, -1 for those skipped
        assert r["scatter"] == [-1 if i in r["invalid_rows"] else i for i in range(len(r["scatter"]))]


def test_random_shapes_lay_out_as_vllms_op(results):
    """20 random (experts, top-k, tokens, block, expert pool) cases, each checked as the named ones are."""
    assert [c for c in results["fuzz"] if not c[-1]] == [] and len(results["fuzz"]) == 20


def test_the_cases_exercise_padding_and_shared_experts(results):
    """Negative control on the inputs: a case where experts hold several rows and blocks are mostly padding."""
    assert results["cases"][2]["total"] == 8 * 32 and results["cases"][0]["total"] == 8 * 16


def test_other_calls_go_to_vllms_op_unchanged(results):
    """CPU tensors, an expert map and more than MAX_ROWS rows reach vLLM's op; scatter_idx passes through."""
    assert results["fallbacks"] == [[8, False, []], [8, True, []], [8, False, ["scatter_idx"]], [136, False, []]]


def test_unknown_choice_is_refused_with_the_choices(monkeypatch):
    from vllm_ling.ops.moe_align import ALIGN_ENV, align_choice, install

    monkeypatch.setenv(ALIGN_ENV, "fast")
    with pytest.raises(ValueError, match="vllm, ours"):
        align_choice()
    monkeypatch.setenv(ALIGN_ENV, "")
    assert align_choice() == "vllm" and install() is False  # the default leaves vLLM's op alone


def test_plugin_wraps_vllms_op_when_asked_and_logs_a_bad_choice(monkeypatch, caplog):
    """VLLM_LING_MOE_ALIGN=ours: vLLM's op is wrapped once (a second install keeps one wrapper). A value we do not
    know: an error line names the choices and vLLM's op stays."""
    pytest.importorskip("vllm")
    from vllm import _custom_ops as ops

    from vllm_ling.ops.moe_align import ALIGN_ENV
    from vllm_ling.plugin import _install_moe_align

    original = ops.moe_align_block_size
    monkeypatch.setattr(ops, "moe_align_block_size", original)  # restored after the test
    monkeypatch.setenv(ALIGN_ENV, "fast")
    with caplog.at_level("ERROR", logger="vllm_ling"):
        _install_moe_align()
    assert ops.moe_align_block_size is original and "vllm, ours" in caplog.text
    monkeypatch.setenv(ALIGN_ENV, "ours")
    _install_moe_align()
    _install_moe_align()
    assert ops.moe_align_block_size.vllm_ling_wraps is original
