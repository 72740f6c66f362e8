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
    """ling3-architecture.md §8: weight_packed int32 [out, in/8], element j at bits 4·(j mod 8) of word j/8."""
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
