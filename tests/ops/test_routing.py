"""Our one-kernel router (vllm_ling.ops.routing) against the torch reference router (vllm_ling.ops.moe).

The kernel runs in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU) in a child process (the
`interpret` fixture, tests/ops/conftest.py). The same source runs compiled on the GPU.
"""

from __future__ import annotations

import json

import pytest

from vllm_ling.ops.routing import ROUTER_ENV, check_routing_shape, router_choice

CHILD = r"""
import json, sys
import torch
from vllm_ling.ops.moe import grouped_topk
from vllm_ling.ops.routing import ling_grouped_topk

out = []
for t, e, g, tg, k, renorm, scale in json.loads(sys.argv[1]):
    gen = torch.Generator().manual_seed(t * 1000 + e)
    logits = torch.randn(t, e, generator=gen) * 3
    bias = torch.randn(e, generator=gen) * 0.2
    w, ids = ling_grouped_topk(logits, bias, g, tg, k, renorm, scale)
    w_ref, ids_ref = grouped_topk(logits, bias, g, tg, k, renorm, scale)
    # the same reference with every group allowed: a router that ignored the groups would match this one
    w_all, ids_all = grouped_topk(logits, bias, g, g, k, renorm, scale)
    out.append({"dtypes": [str(w.dtype), str(ids.dtype)], "shape": list(ids.shape),
                "ids_equal": torch.equal(ids.long(), ids_ref),
                "w_err": (w - w_ref).abs().max().item() if t else 0.0,
                "groups_matter": not torch.equal(ids_all, ids_ref)})
print(json.dumps(out))
"""

# tokens, experts, groups, topk_group, top_k, renormalize, scale
CASES = [
    (1, 512, 8, 4, 8, True, 2.5),  # Ling-3.0-flash, one decode token
    (9, 512, 8, 4, 8, True, 2.5),  # a batch: one program per token
    (4, 96, 3, 2, 3, False, 1.0),  # groups not a power of two (padded), no renormalisation
    (0, 512, 8, 4, 8, True, 2.5),  # an empty batch launches nothing
]


@pytest.fixture(scope="module")
def results(interpret) -> list[dict]:
    return interpret(CHILD, json.dumps(CASES))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"T{c[0]}-E{c[1]}-G{c[2]}" for c in CASES])
def test_kernel_routes_like_the_reference(results, case):
    """Same experts in the same order (descending biased score), weights equal to fp32 rounding, fp32/int32."""
    r, (t, *_, k, _, _) = results[case], CASES[case]
    assert r["dtypes"] == ["torch.float32", "torch.int32"] and r["shape"] == [t, k]
    assert r["ids_equal"]
    assert r["w_err"] <= 1e-6


def test_the_cases_can_tell_group_limited_routing_apart(results):
    """Negative control: on these inputs, ignoring the group limit picks other experts."""
    assert all(r["groups_matter"] for r, c in zip(results, CASES) if c[0] > 1)


@pytest.mark.parametrize("experts, groups, topk_group, top_k", [
    (512, 7, 4, 8),    # unequal groups
    (480, 8, 4, 8),    # 60 per group: not a power of two
    (512, 8, 9, 8),    # more groups chosen than exist
    (512, 8, 1, 65),   # more experts than one group of 64 holds
])
def test_shape_rules_refuse_with_the_alternative(experts, groups, topk_group, top_k):
    with pytest.raises(ValueError, match="VLLM_LING_ROUTER=vllm"):
        check_routing_shape(experts, groups, topk_group, top_k)


def test_router_choice_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ROUTER_ENV, raising=False)
    assert router_choice() == "ours"
    monkeypatch.setenv(ROUTER_ENV, " VLLM ")
    assert router_choice() == "vllm"
    monkeypatch.setenv(ROUTER_ENV, "fast")
    with pytest.raises(ValueError, match="'fast' is not one of ours, vllm"):
        router_choice()
