"""The shared-memory estimate against what Triton 3.6 actually compiled the vLLM kernel to
(tests/tuning/data/triton36_wna16_smem.json: 320 configs, sm_90 and sm_121, no GPU needed)."""

import json
from pathlib import Path

import pytest
from ling_tuning.smem import GB10_SMEM_PER_BLOCK, SMEM_LIMIT_ENV, cuda_wna16_smem, device_smem_limit, triton_wna16_smem

DATA = json.loads((Path(__file__).parent / "data" / "triton36_wna16_smem.json").read_text())
ROWS = [dict(zip(DATA["columns"], r, strict=True)) for r in DATA["rows"]]
COMPILED = [(r, arch) for r in ROWS for arch in ("sm90", "sm121") if r[arch] is not None]


def test_estimate_never_undershoots_a_compiled_kernel():
    under = [(r, a) for r, a in COMPILED if r[a] > triton_wna16_smem(r)]
    assert len(COMPILED) >= 400 and under == []


def test_estimate_is_exact_for_nearly_every_config():
    exact = sum(r[a] == triton_wna16_smem(r) for r, a in COMPILED)
    assert exact / len(COMPILED) > 0.9


def test_num_stages_does_not_change_this_kernels_shared_memory():
    by_tile: dict[tuple, set] = {}
    for r, a in COMPILED:
        tile = (r["BLOCK_SIZE_M"], r["BLOCK_SIZE_N"], r["BLOCK_SIZE_K"], r["num_warps"], a)
        by_tile.setdefault(tile, set()).add(r[a])
    assert by_tile and all(len(v) == 1 for v in by_tile.values())


def test_gb10_pruning_never_keeps_a_kernel_that_would_not_launch_there():
    sm121 = [r for r in ROWS if r["sm121"] is not None]
    over = [r for r in sm121 if r["sm121"] > GB10_SMEM_PER_BLOCK]
    assert over, "the data must contain configs that do not fit GB10"
    assert all(triton_wna16_smem(r) > GB10_SMEM_PER_BLOCK for r in over)
    wrongly_dropped = [r for r in sm121 if r["sm121"] <= GB10_SMEM_PER_BLOCK < triton_wna16_smem(r)]
    assert len(wrongly_dropped) <= 0.05 * len(sm121)


@pytest.mark.parametrize("bm, bk, expected", [(16, 128, 4096), (64, 256, 32768), (1, 32, 64)])
def test_cuda_kernel_stages_only_the_activation_tile(bm, bk, expected):
    assert cuda_wna16_smem(bm, bk) == expected


def test_limit_can_be_emulated_through_the_environment(monkeypatch):
    monkeypatch.setenv(SMEM_LIMIT_ENV, "101376")
    assert device_smem_limit() == GB10_SMEM_PER_BLOCK
