import math

import pytest
from ling_tuning.shapes import PRESETS
from ling_tuning.smem import GB10_SMEM_PER_BLOCK, triton_wna16_smem
from ling_tuning.space import (
    TRITON_FULL,
    TRITON_QUICK,
    candidates,
    cuda_heuristic_tiles,
    cuda_violations,
    explicit_default_config,
    triton_violations,
    uses_cuda_kernel,
    violations,
    vllm_default_config,
)

LING = PRESETS["ling-3.0-flash"]
H200_SMEM = 232_448


def test_cuda_kernel_serves_decode_and_small_prefill_up_to_6E_over_topk():
    assert LING.cuda_max_tokens == 384
    assert uses_cuda_kernel(1, LING) and uses_cuda_kernel(384, LING)
    assert not uses_cuda_kernel(385, LING)


def test_full_triton_space_is_vllms_1920_configs():
    sizes = [len(v) for v in TRITON_FULL.values()]
    assert sizes == [5, 4, 3, 4, 2, 4]
    pool = candidates(8192, LING, H200_SMEM, "full")
    assert len(pool.kept) + sum(pool.dropped.values()) == 1920


@pytest.mark.parametrize("cfg, rule", [
    ({"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128}, "cuda_block_m"),
    ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 512}, "cuda_k_groups"),  # 512/32 = 16
    ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 16}, "cuda_k_groups"),   # below one group
    ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 96}, "cuda_k_groups"),   # 3 groups
    ({"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 2048, "BLOCK_SIZE_K": 128}, "cuda_threads"),
])
def test_cuda_kernel_rejects_what_moe_wna16_gemm_torch_checks(cfg, rule):
    assert any(v.startswith(rule) for v in cuda_violations(cfg, LING, H200_SMEM))


def test_cuda_k_tile_must_divide_both_gemms():
    # 2560 % 256 == 0 and 768 % 256 == 0 for Ling; a 640-wide expert would not take 256.
    odd = type(LING)(num_experts=512, intermediate=640, hidden=2560, top_k=8, group_size=32)
    cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 256}
    assert cuda_violations(cfg, LING, H200_SMEM) == []
    assert any("K=640" in v for v in cuda_violations(cfg, odd, H200_SMEM))


def test_vllm_default_fails_at_m_1_and_2_like_the_h200_baseline():
    """BENCHMARKS.md (MoE INT4 kernels): default tiles fail at M = 1, 2 (BLOCK_SIZE_K // group 16) and run at M = 4."""
    for m in (1, 2):
        assert cuda_heuristic_tiles(m, LING, vllm_default_config(m, LING)["BLOCK_SIZE_M"])[0][1] == 512
        assert any(v.startswith("cuda_k_groups") for v in violations(m, vllm_default_config(m, LING), LING, H200_SMEM))
    for m in (4, 8, 16, 64, 256):
        assert violations(m, vllm_default_config(m, LING), LING, H200_SMEM) == []


@pytest.mark.parametrize("bm, bn, bk, stages, fits", [
    (16, 256, 256, 2, False),   # 147,456 B: fits the H200, not GB10
    (32, 128, 256, 2, True),    # 98,304 B: just under GB10's 101,376
    (32, 128, 256, 3, False),   # 114,688 B: one more A buffer
    (64, 128, 128, 3, True),    # 81,920 B, as compiled on the H200
    (64, 128, 256, 3, False),   # 163,840 B, as compiled on the H200 (the old model said 98,304: fits)
    (128, 128, 256, 2, False),  # 196,608 B, as compiled on the H200
    (64, 256, 128, 2, True),    # 98,304 B
])
def test_gb10_limit_keeps_and_drops_known_triton_tiles(bm, bn, bk, stages, fits):
    cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1, "num_warps": 4,
           "num_stages": stages}
    assert (triton_violations(cfg, LING, GB10_SMEM_PER_BLOCK) == []) is fits
    assert triton_violations(cfg, LING, H200_SMEM) == []


def test_quick_space_keeps_num_stages_2_and_3_and_stays_small():
    """Stages change this kernel's shared memory on hardware (H200) and may change its speed."""
    assert {2, 3} <= set(TRITON_QUICK["num_stages"])
    assert math.prod(len(v) for v in TRITON_QUICK.values()) == 480  # of vLLM's 1,920
    kept = candidates(1024, LING, GB10_SMEM_PER_BLOCK, "quick").kept
    assert {c["num_stages"] for c in kept} == {2, 3}


def test_explicit_default_is_vllms_default_with_the_cuda_heuristic_tiles_filled_in():
    for m in (4, 16, 64, 384):  # both GEMMs get 256 x 256 here: one explicit entry, the same launches
        bm = vllm_default_config(m, LING)["BLOCK_SIZE_M"]
        assert cuda_heuristic_tiles(m, LING, bm) == [(256, 256)] * 2
        assert explicit_default_config(m, LING) == {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256,
                                                    "SPLIT_K": 1}
    for m in (1, 2):  # the GEMMs disagree (and the first is invalid): left to vLLM, still rejected
        assert explicit_default_config(m, LING) == vllm_default_config(m, LING)
        assert violations(m, explicit_default_config(m, LING), LING, H200_SMEM)
    for m in (385, 1024, 8192):
        assert explicit_default_config(m, LING) == vllm_default_config(m, LING)


def test_smem_pruning_happens_in_candidate_generation_and_only_drops_oversized():
    h200 = candidates(4096, LING, H200_SMEM, "full")
    gb10 = candidates(4096, LING, GB10_SMEM_PER_BLOCK, "full")
    assert all(triton_wna16_smem(c) <= GB10_SMEM_PER_BLOCK for c in gb10.kept)
    assert all(triton_wna16_smem(c) <= H200_SMEM for c in h200.kept)
    over = [c for c in h200.kept if triton_wna16_smem(c) > GB10_SMEM_PER_BLOCK]
    assert over and len(h200.kept) - len(gb10.kept) == len(over) == gb10.dropped["smem"] - h200.dropped["smem"]


def test_order_is_seeded_and_independent_of_the_limit():
    a = candidates(2048, LING, H200_SMEM, "full").kept
    b = candidates(2048, LING, GB10_SMEM_PER_BLOCK, "full").kept
    assert a == candidates(2048, LING, H200_SMEM, "full").kept
    assert b == [c for c in a if triton_wna16_smem(c) <= GB10_SMEM_PER_BLOCK]


def test_max_count_takes_a_prefix_of_triton_configs_only():
    c = candidates(1024, LING, H200_SMEM, "full", max_count=10)
    assert len(c.kept) == 10 and c.kept == candidates(1024, LING, H200_SMEM, "full").kept[:10]
    assert c.dropped["max_count"] > 0
    assert len(candidates(16, LING, H200_SMEM, "full", max_count=10).kept) == 120  # CUDA kernel: all


def test_every_cuda_candidate_passes_the_cuda_checks():
    for m in (1, 16, 384):
        c = candidates(m, LING, GB10_SMEM_PER_BLOCK)
        assert c.kernel == "cuda_wna16" and c.kept
        assert all(cuda_violations(cfg, LING, GB10_SMEM_PER_BLOCK) == [] for cfg in c.kept)
        assert all(cfg["SPLIT_K"] == 1 for cfg in c.kept)


def test_unknown_space_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="quick"):
        candidates(1024, LING, H200_SMEM, "huge")


def test_vllms_own_triton_defaults_fit_gb10():
    """What vLLM runs for M > 384 with no tuned file (and what an untuned side of our table gets)."""
    for m in range(385, 8193, 97):
        cfg = vllm_default_config(m, LING)
        assert triton_violations(cfg, LING, GB10_SMEM_PER_BLOCK) == []
        assert triton_wna16_smem(cfg) <= 16 * 1024
