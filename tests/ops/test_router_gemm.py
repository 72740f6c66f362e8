"""Our fp32 router GEMM (vllm_ling.ops.router_gemm) against an fp64 product, in Triton's interpreter on the CPU.

The kernel runs in a child process under TRITON_INTERPRET=1 (the `interpret` fixture, tests/ops/conftest.py); the
same source runs compiled on the GPU (tests/gpu/test_router_gemm_gpu.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_ling.ops.router_gemm import GEMM_ENV, MAX_TOKENS, gemm_choice

CHILD = r"""
import json, sys
import torch
from vllm_ling.ops.router_gemm import router_gemm_small

out = []
for m, e, k, dtype, block_e in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(m * 7 + e + k)
    x = torch.randn(m, k, generator=gen).to(getattr(torch, dtype))
    w = torch.randn(e, k, generator=gen) / k ** 0.5
    got = router_gemm_small(x, w, block_e=block_e)
    ref = x.double() @ w.double().t()
    # the mistake a tolerance must catch: a weight read in bf16 (or a tf32 dot) instead of fp32
    bf16_w = (x.double() @ w.bfloat16().double().t())
    scale = ref.abs().max().item()
    out.append({"dtype": str(got.dtype), "shape": list(got.shape),
                "err": (got.double() - ref).abs().max().item() / scale,
                "bf16_weight_err": (bf16_w - ref).abs().max().item() / scale,
                "rows_alone": all(torch.equal(router_gemm_small(x[i:i + 1].repeat(m, 1), w, block_e=block_e)[0],
                                              got[i]) for i in range(m))})
print(json.dumps(out))
"""

# rows, experts, width, input dtype, experts per program (None: the kernel's own choice, `block_experts`)
CASES = [
    (1, 512, 2560, "bfloat16", None),  # Ling-3.0-flash, one decode token
    (2, 512, 2560, "bfloat16", None),  # an MTP k=1 verify step
    (2, 512, 2560, "bfloat16", 4),  # the same at 4 experts a program
    (3, 66, 200, "float32", 4),  # rows, experts and width off every block size
    (MAX_TOKENS, 96, 512, "bfloat16", 2),  # the largest batch it takes
]
TOLERANCE = 1e-5  # fp32 accumulation over K <= 2,560, relative to the largest logit


@pytest.fixture(scope="module")
def results(interpret) -> list[dict]:
    return interpret(CHILD, json.dumps(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"M{c[0]}-E{c[1]}-K{c[2]}" for c in CASES])
def test_logits_match_an_fp64_product_to_fp32_rounding(results, case):
    r, (m, e, *_) = results[case], CASES[case]
    assert r["dtype"] == "torch.float32" and r["shape"] == [m, e]
    assert r["err"] <= TOLERANCE
    assert r["bf16_weight_err"] > 10 * TOLERANCE, "the tolerance would not catch a bf16 weight"


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"M{c[0]}-E{c[1]}-K{c[2]}" for c in CASES])
def test_a_rows_logits_do_not_depend_on_the_other_rows(results, case):
    """The same row in a batch of copies of itself gives bit-identical logits: no row reads another's input."""
    assert results[case]["rows_alone"]


def test_more_rows_than_a_program_holds_are_refused():
    from vllm_ling.ops.router_gemm import router_gemm_small

    with pytest.raises(ValueError, match=f"1 <= M <= {MAX_TOKENS}"):
        router_gemm_small(torch.zeros(MAX_TOKENS + 1, 8), torch.zeros(4, 8))


def test_the_op_on_a_cpu_tensor_is_torchs_fp32_product():
    from vllm_ling.ops.router_gemm import router_logits

    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(16, 64)
    assert torch.equal(router_logits(x, w), torch.nn.functional.linear(x.float(), w))


def test_the_setting_is_validated_by_name(monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "cublas")
    with pytest.raises(ValueError, match="VLLM_LING_ROUTER_GEMM='cublas'.*ours, vllm.*default \\(ours\\)"):
        gemm_choice()
    monkeypatch.delenv(GEMM_ENV)
    assert gemm_choice() == "ours"  # the default since it timed faster than cuBLAS


SCALED_CHILD = r"""
import json
import torch
from vllm_ling.ops.router_gemm import router_gemm_small
out = {}
gen = torch.Generator().manual_seed(5)
w = torch.randn(300, 640, generator=gen) / 640 ** 0.5  # 640: a width off the kernel's K blocks
scale = w.abs().amax(dim=1) / 448.0
q = (w / scale[:, None]).to(torch.float8_e4m3fn)
for m in (1, 2, 5):
    x = torch.randn(m, 640, generator=gen).to(torch.bfloat16)
    for name, rows in (("fp8", q), ("bf16", w.to(torch.bfloat16))):
        ref = (x.double() @ rows.double().t()) * scale.double()
        got = router_gemm_small(x, rows, scale=scale)
        unscaled = router_gemm_small(x, rows)
        top = ref.abs().max().item()
        out[f"{name}-M{m}"] = {"err": (got.double() - ref).abs().max().item() / top,
                               "unscaled_err": (unscaled.double() - ref).abs().max().item() / top}
print(json.dumps(out))
"""


def test_a_per_row_scale_multiplies_each_rows_sums(interpret):
    """The draft vocabulary's head (vllm_ling/draft/vocab.py): FP8 (and BF16) rows read as stored, widened to fp32,
    each row's sum times its scale; without the scale the same call is far off (the check can fail)."""
    for case, r in interpret(SCALED_CHILD).items():
        assert r["err"] <= TOLERANCE, (case, r)
        assert r["unscaled_err"] > 1, (case, r)
