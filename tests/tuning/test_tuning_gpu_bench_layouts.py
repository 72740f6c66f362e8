"""The weight layouts and the reference the CUDA runner relies on, checked on the CPU."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ling_tuning.gpu_bench import dequantize, gptq_pack, pack_nibbles, reference_moe, unpack_nibbles  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def codes(*shape):
    return torch.randint(0, 16, shape, dtype=torch.uint8, generator=GEN)


def test_nibble_packing_is_vllms_wna16_layout_and_round_trips():
    q = codes(3, 8, 64)
    packed = pack_nibbles(q)
    assert torch.equal(packed, q[..., 1::2] * 16 + q[..., ::2])  # vLLM test_fused_moe_wn16's packing
    assert torch.equal(unpack_nibbles(packed), q)


def test_compressed_tensors_int32_words_viewed_as_bytes_are_the_same_layout():
    """docs/architecture.md §INT4: weight_packed int32 [out, in/8], element j at bits 4·(j mod 8) of word j/8."""
    q = codes(4, 32)
    words = np.zeros((4, 4), dtype=np.uint32)
    for j in range(32):
        words[:, j // 8] |= q[:, j].numpy().astype(np.uint32) << (4 * (j % 8))
    as_checkpoint = torch.from_numpy(words.view(np.int32))  # int32 on disk, little-endian
    assert torch.equal(as_checkpoint.view(torch.uint8), pack_nibbles(q))


def test_gptq_packing_matches_vllms_pack_rows():
    q = codes(2, 16, 64)  # [E, out, in]
    got = gptq_pack(q, chunk=1)
    assert got.shape == (2, 8, 16) and got.dtype == torch.int32
    quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    for e in range(2):
        assert torch.equal(got[e], quant_utils.pack_rows(q[e].T.contiguous().int(), 4, 64, 16))


def test_dequantize_applies_the_group_scale_to_code_minus_eight():
    q = codes(2, 64)
    s = torch.rand(2, 2).to(torch.bfloat16)
    w = dequantize(pack_nibbles(q), s, 32)
    assert torch.allclose(w[:, :32], (q[:, :32].float() - 8) * s[:, :1].float())
    assert torch.allclose(w[:, 32:], (q[:, 32:].float() - 8) * s[:, 1:].float())


def test_reference_equals_a_token_by_token_moe():
    e, n, k, top, group = 4, 32, 64, 2, 32
    w13, w2 = pack_nibbles(codes(e, 2 * n, k)), pack_nibbles(codes(e, k, n))
    s13, s2 = torch.rand(e, 2 * n, k // group) / 50, torch.rand(e, k, n // group) / 50
    x = torch.randn(5, k, generator=GEN)
    ids = torch.stack([torch.randperm(e, generator=GEN)[:top] for _ in range(5)])
    w = torch.rand(5, top, generator=GEN)
    out = reference_moe(x, ids, w, w13, s13, w2, s2, group)
    for t in range(5):
        want = torch.zeros(k)
        for j in range(top):
            ex = ids[t, j].item()
            h = dequantize(w13[ex], s13[ex], group) @ x[t]
            want += w[t, j] * (dequantize(w2[ex], s2[ex], group) @ (torch.nn.functional.silu(h[:n]) * h[n:]))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-5)


def cpu_runner(fused_experts):
    """A CudaRunner on CPU tensors with vLLM's fused_experts replaced: exercises its check logic."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from ling_tuning.gpu_bench import CudaRunner
    from ling_tuning.shapes import MoEShape

    r = object.__new__(CudaRunner)
    r.shape = MoEShape(num_experts=8, intermediate=64, hidden=128, top_k=2, group_size=32)
    r.seed, r.rotations, r.replays, r.dev = 0, 2, 1, torch.device("cpu")
    r._inputs, r._smem_seen, r.quant = {}, {}, None
    r.w13, r.w2 = pack_nibbles(codes(8, 128, 128)), pack_nibbles(codes(8, 128, 64))
    r.s13, r.s2 = torch.rand(8, 128, 4) / 50, torch.rand(8, 128, 2) / 50
    r._fm = SimpleNamespace(fused_experts=fused_experts, fused_moe_kernel_gptq_awq=None)
    r._override = lambda cfg: nullcontext()
    r._time = lambda call, m: 42.0
    return r


def test_runner_accepts_a_correct_kernel():
    def exact(x, w13, w2, w, ids, global_num_experts, quant_config):
        return reference_moe(x, ids, w, w13, runner.s13, w2, runner.s2, 32).to(torch.bfloat16)

    runner = cpu_runner(exact)
    got = runner.triton(4, {"BLOCK_SIZE_M": 4, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "SPLIT_K": 1})
    assert got.us == 42.0 and got.rel_err < 1e-2 and got.smem is None  # CUDA kernel: nothing compiled
    triton_m = runner.shape.cuda_max_tokens + 8
    got = runner.triton(triton_m, {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1,
                                   "num_warps": 4, "num_stages": 2, "SPLIT_K": 1})
    assert got.us == 42.0 and runner.experts_touched(triton_m) <= runner.shape.num_experts


def test_runner_rejects_a_kernel_that_leaves_the_previous_output_in_place():
    """The allocator hands back the last output's memory; a kernel that writes nothing would match
    the previous config's result on the same inputs. Two input sets per M expose it."""
    stale = {}

    def writes_nothing(x, w13, w2, w, ids, global_num_experts, quant_config):
        if "out" not in stale:  # the first call leaves a correct result behind
            stale["out"] = reference_moe(x, ids, w, w13, runner.s13, w2, runner.s2, 32).to(torch.bfloat16)
        return stale["out"]

    runner = cpu_runner(writes_nothing)
    got = runner.triton(4, {"BLOCK_SIZE_M": 4, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "SPLIT_K": 1})
    assert got.us is None and got.rel_err > 0.5
