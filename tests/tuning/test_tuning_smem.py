"""The shared-memory model against compiled kernels. It must never under-estimate: the H200's real
compiles (tests/tuning/data/h200_wna16_smem.json) and the earlier offline Triton 3.6 compiles
(tests/tuning/data/triton36_wna16_smem.json: 320 configs, sm_90 and sm_121, no GPU needed)."""

import json
from pathlib import Path

import pytest
from ling_tuning.shapes import PRESETS
from ling_tuning.smem import GB10_SMEM_PER_BLOCK, SMEM_LIMIT_ENV, cuda_wna16_smem, device_smem_limit, triton_wna16_smem
from ling_tuning.space import triton_violations, uses_cuda_kernel

DATA_DIR = Path(__file__).parent / "data"
DATA = json.loads((DATA_DIR / "triton36_wna16_smem.json").read_text())
ROWS = [dict(zip(DATA["columns"], r, strict=True)) for r in DATA["rows"]]
COMPILED = [(r, arch) for r in ROWS for arch in ("sm90", "sm121") if r[arch] is not None]
H200 = json.loads((DATA_DIR / "h200_wna16_smem.json").read_text())
H200_ROWS = [dict(zip(H200["columns"], r, strict=True)) for r in H200["rows"]]
H200_AT_MOST = [dict(zip(H200["columns"], r, strict=True)) for r in H200["at_most"]]
GB10EMU_TABLE = {int(k): v for k, v in json.loads((DATA_DIR / "h200_gb10emu_table.json").read_text()).items()}
LING = PRESETS["ling-3.0-flash"]


def one_a_buffer(r: dict) -> int:
    """The earlier model: max(BM·BK·2 + BK·BN·2, BM·BN·2), no pipelining."""
    bm, bn, bk = r["BLOCK_SIZE_M"], r["BLOCK_SIZE_N"], r["BLOCK_SIZE_K"]
    return max(bm * bk * 2 + bk * bn * 2, bm * bn * 2)


def tile(r: dict) -> tuple[int, ...]:
    return r["BLOCK_SIZE_M"], r["BLOCK_SIZE_N"], r["BLOCK_SIZE_K"], r["num_warps"], r["num_stages"]


def test_model_never_underestimates_what_the_h200_compiled():
    under = [(tile(r), r["compiled"], triton_wna16_smem(r)) for r in H200_ROWS if r["compiled"] > triton_wna16_smem(r)]
    assert len(H200_ROWS) >= 7 and under == []
    assert all(triton_wna16_smem(r) >= r["compiled"] for r in H200_AT_MOST)  # passed under the old bound


def test_model_is_exact_where_the_h200_buffered_a_num_stages_times():
    """stages·BM·BK·2 + BK·BN·2 exactly; (32,256,128,s4) got 3 A buffers and (16,128,64,s2) one: over, safe."""
    exact = {tile(r) for r in H200_ROWS if r["compiled"] == triton_wna16_smem(r)}
    assert exact == {(64, 128, 128, 8, 3), (64, 128, 256, 8, 3), (64, 128, 64, 4, 2), (128, 128, 256, 8, 2),
                     (128, 64, 64, 4, 2)}


def test_the_h200_pipelines_a_so_the_one_buffer_model_underestimated_it():
    """Why the model changed: on hardware num_stages changes this kernel's shared memory."""
    under = {tile(r) for r in H200_ROWS if r["compiled"] > one_a_buffer(r)}
    assert under == {(64, 128, 128, 8, 3), (32, 256, 128, 4, 4), (64, 128, 256, 8, 3), (64, 128, 64, 4, 2),
                     (128, 128, 256, 8, 2), (128, 64, 64, 4, 2)}


def test_model_never_underestimates_an_offline_compile():
    """The offline compiles were not pipelined (one A buffer whatever num_stages), so on them the model
    over-estimates, by exactly the (num_stages-1)·BM·BK·2 of the A buffers they lacked for > 90%."""
    under = [(r, a) for r, a in COMPILED if r[a] > triton_wna16_smem(r)]
    assert len(COMPILED) >= 400 and under == []
    extra = sum(triton_wna16_smem(r) - r[a] == (r["num_stages"] - 1) * r["BLOCK_SIZE_M"] * r["BLOCK_SIZE_K"] * 2
                for r, a in COMPILED)
    assert extra / len(COMPILED) > 0.9


def test_offline_compiles_left_num_stages_out_unlike_the_h200():
    """True of the offline data only (no GPU, no pipelining); the H200 rows above show otherwise."""
    by_tile: dict[tuple, set] = {}
    for r, a in COMPILED:
        by_tile.setdefault((*tile(r)[:4], a), set()).add(r[a])
    assert by_tile and all(len(v) == 1 for v in by_tile.values())
    assert sum(r[a] == one_a_buffer(r) for r, a in COMPILED) / len(COMPILED) > 0.9


def test_gb10_pruning_never_keeps_a_kernel_that_would_not_launch_there():
    sm121 = [r for r in ROWS if r["sm121"] is not None]
    over = [r for r in sm121 if r["sm121"] > GB10_SMEM_PER_BLOCK]
    assert over, "the data must contain configs that do not fit GB10"
    assert all(triton_wna16_smem(r) > GB10_SMEM_PER_BLOCK for r in over)
    # What the offline compiles say would fit but the model drops: only its extra A buffers push it over.
    dropped_but_fit_offline = [r for r in sm121 if r["sm121"] <= GB10_SMEM_PER_BLOCK < triton_wna16_smem(r)]
    assert all(one_a_buffer(r) <= GB10_SMEM_PER_BLOCK for r in dropped_but_fit_offline)


def test_every_triton_entry_of_the_gb10_emulated_h200_table_fits_gb10():
    """The table ling-tune wrote under LING_SMEM_LIMIT=101376 on the H200 (2026-11-29). Entries with
    M > 384 (Ling's 6·E/top_k) run the Triton kernel; the others the CUDA one (no Triton smem)."""
    triton = {m: c for m, c in GB10EMU_TABLE.items() if not uses_cuda_kernel(m, LING)}
    assert sorted(triton) == [385, 1024] and all(m > LING.cuda_max_tokens for m in triton)
    assert {m: triton_wna16_smem(c) for m, c in triton.items()} == {385: 20_480, 1024: 20_480}  # compiled 18,432
    assert all(triton_violations(c, LING, GB10_SMEM_PER_BLOCK) == [] for c in triton.values())


def test_a_config_without_num_stages_counts_tritons_default_of_3():
    cfg = {"BLOCK_SIZE_M": 64, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128}
    assert triton_wna16_smem(cfg) == triton_wna16_smem(cfg | {"num_stages": 3}) == 81_920  # the H200's figure


@pytest.mark.parametrize("bm, bk, expected", [(16, 128, 4096), (64, 256, 32768), (1, 32, 64)])
def test_cuda_kernel_stages_only_the_activation_tile(bm, bk, expected):
    assert cuda_wna16_smem(bm, bk) == expected


def test_limit_can_be_emulated_through_the_environment(monkeypatch):
    monkeypatch.setenv(SMEM_LIMIT_ENV, "101376")
    assert device_smem_limit() == GB10_SMEM_PER_BLOCK


def test_the_launch_limit_emulation_stops_a_first_launch_over_it(monkeypatch):
    """`emulate_launch_limit` in front of Triton's first-launch hook, on a stand-in for a compiled kernel (no GPU
    here): over the limit it raises Triton's OutOfResources before Triton's own hook runs; within it, it records the
    kernel and hands over; reinstalling replaces the limit rather than stacking wrappers."""
    from types import SimpleNamespace

    import pytest
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.errors import OutOfResources

    from ling_tuning.smem import emulate_launch_limit

    handed_over = []
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: handed_over.append(self.name))
    launched = emulate_launch_limit(101_376)
    big = SimpleNamespace(module=None, name="kda_big", metadata=SimpleNamespace(shared=133_120))
    small = SimpleNamespace(module=None, name="kda_small", metadata=SimpleNamespace(shared=77_824))
    with pytest.raises(OutOfResources, match="shared memory"):
        CompiledKernel._init_handles(big)
    CompiledKernel._init_handles(small)
    assert launched == {"kda_big": 133_120, "kda_small": 77_824} and handed_over == ["kda_small"]
    emulate_launch_limit(1 << 30)
    CompiledKernel._init_handles(big)
    assert handed_over == ["kda_small", "kda_big"]
