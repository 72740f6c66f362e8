"""ling_tuning on a real GPU with vLLM 0.34 or 0.33: runner correctness, compiled shared memory vs the
estimate, vLLM's lookup of a written file, and the smem guard's compile probe. Small shapes
(64 experts) keep the module to about a minute; the full Ling run is tests/gpu/tuning_run.sh."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from vllm_ling import smem_guard  # noqa: E402
from ling_tuning.configfile import build_table, config_file_name, write_table  # noqa: E402
from ling_tuning.gpu_bench import CudaRunner  # noqa: E402
from ling_tuning.runner import REL_TOL  # noqa: E402
from ling_tuning.shapes import MoEShape  # noqa: E402
from ling_tuning.smem import triton_wna16_smem  # noqa: E402
from ling_tuning.vllm_check import prove_vllm_loads, vllm_file_name  # noqa: E402

pytestmark = pytest.mark.gpu
SMALL = MoEShape(num_experts=64, intermediate=768, hidden=2560, top_k=8, group_size=32)  # CUDA kernel up to M=48
CUDA_CFG = {"BLOCK_SIZE_M": 4, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "SPLIT_K": 1}


@pytest.fixture(scope="module")
def runner():
    return CudaRunner(SMALL, rotations=4, replays=3)


def test_cuda_kernel_tiles_match_the_dequantized_reference(runner):
    got = runner.triton(4, CUDA_CFG)
    assert got.us and got.us > 0 and got.rel_err < REL_TOL


def test_marlin_on_the_same_codes_matches_the_reference(runner):
    got = runner.marlin(4)
    assert got.us and got.rel_err < REL_TOL


def test_the_check_rejects_a_kernel_reading_the_wrong_experts(runner):
    runner.triton(8, CUDA_CFG)  # references for M=8 computed from the true weights
    true_w13 = runner.w13
    runner.w13 = true_w13.roll(1, dims=0)
    try:
        got = runner.triton(8, CUDA_CFG)
    finally:
        runner.w13 = true_w13
    assert got.us is None and got.rel_err > 0.3


def test_vllms_default_tiles_fail_at_m1_as_in_the_baseline(runner):
    with pytest.raises(RuntimeError, match="BLOCK_SIZE_K"):
        runner.triton(1, None)


@pytest.mark.parametrize("bm, bn, bk, warps, stages", [
    (16, 64, 64, 4, 2), (64, 128, 128, 8, 3), (32, 256, 128, 4, 4), (16, 256, 256, 4, 2), (64, 128, 256, 8, 3)])
def test_compiled_shared_memory_never_exceeds_the_estimate(runner, bm, bn, bk, warps, stages):
    cfg = {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "GROUP_SIZE_M": 1, "num_warps": warps,
           "num_stages": stages, "SPLIT_K": 1}
    got = runner.triton(64, cfg)  # 64·8/64 > 6: the Triton kernel
    assert got.rel_err < REL_TOL
    assert got.smem is not None and 0 < got.smem <= triton_wna16_smem(cfg)


def test_vllm_finds_and_uses_a_written_file_on_this_gpu(runner, tmp_path):
    name = config_file_name(SMALL, torch.cuda.get_device_name())
    assert name == vllm_file_name(SMALL)
    table = build_table({4: CUDA_CFG}, SMALL)
    write_table(tmp_path, name, table, triton.__version__)
    proof = prove_vllm_loads(tmp_path, SMALL, table)
    assert proof["loaded"] and not proof["default_warning"]
    got = runner.triton(4, None, tmp_path)  # fused_experts through vLLM's own lookup of the file
    assert got.us and got.rel_err < REL_TOL


@triton.autotune(configs=[triton.Config({"B": 32}, num_warps=4, num_stages=2),
                          triton.Config({"B": 128}, num_warps=4, num_stages=4)], key=["n"])
@triton.jit
def _matmul(a, b, c, n, B: tl.constexpr):
    offs = tl.arange(0, B)
    acc = tl.zeros((B, B), tl.float32)
    for k in range(0, n, B):
        x = tl.load(a + offs[:, None] * n + (k + offs[None, :]))
        y = tl.load(b + (k + offs[:, None]) * n + offs[None, :])
        acc += tl.dot(x, y)
    tl.store(c + offs[:, None] * n + offs[None, :], acc)


def test_smem_guard_compiles_and_drops_configs_over_the_limit_before_launch():
    import sys

    limit = 16 * 1024  # B=32 at 2 stages needs a few KB; B=128 at 4 stages needs well over 64 KB
    log = smem_guard.install(limit, modules=[sys.modules[__name__]])
    n = 512
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.float16) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=torch.float32)
    _matmul[(1,)](a, b, c, n)
    torch.cuda.synchronize()
    entry = log.kernels[f"{__name__.rsplit('.', 1)[-1]}._matmul"]
    sizes = {cfg: v["smem"] for part in ("kept", "dropped") for cfg, v in entry[part].items()}
    assert all(isinstance(s, int) and s > 0 for s in sizes.values())  # the real compile probe worked
    assert _matmul.best_config.kwargs["B"] == 32 and len(entry["dropped"]) == 1
    assert all(v["smem"] > limit for v in entry["dropped"].values())
    torch.testing.assert_close(c[:32, :32], (a[:32].float() @ b[:, :32].float()), rtol=1e-2, atol=1e-1)
