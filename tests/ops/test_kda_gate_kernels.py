"""vLLM's raw-gate KDA kernels, as `kda_core.run_cuda_gate_in_kernel` calls them, apply Ling's safe gate and σ(β)
exactly as our torch ops do: plain decode (`fused_recurrent_kda_packed_decode`) and MTP verification with
accepted and rejected drafts (`fused_recurrent_kda` with per-position state slots), on row-strided views of one
fused projection row, null slot 0 included. Triton's interpreter runs the kernels on the CPU (vLLM 0.32 ships
them as 0.33 does); the conv before them is not part of this (its kernel does not run in the interpreter:
tests/gpu/test_kda_core_gpu.py runs the whole path). The reference is `recurrent_kda_torch`, which
tests/ops/test_kda.py holds to FLA's naive recurrence.
"""

from __future__ import annotations

import pytest

CHILD = r"""
import importlib, json, sys
import torch
from vllm_ling import compat
from vllm_ling.kda_core import _head_views
from vllm_ling.ops.kda import kda_safe_gate, kda_softplus_gate, recurrent_kda_torch

kda = compat.kda_gate_kernels()
fr = importlib.import_module(compat.KDA_GATE_KERNELS + ".fused_recurrent")
# FLA's `exp = tl.exp` module alias escapes the interpreter's patching of `tl`; call through `tl` (same function).
fr.exp, fr.log = (lambda x: tl.exp(x)), (lambda x: tl.log(x))
law = sys.argv[1]  # "safe": the reference applies our safe gate; "softplus": Kimi's law (must not match)

H, D = 2, 16
P = H * D
gen = torch.Generator().manual_seed(0)
A_log = torch.randn(H, generator=gen)
dt_bias = torch.randn(P, generator=gen)
LB = -5.0

def rows(n):
    # one fused GEMM row per token: q|k|v (post-conv here) | β logits | f | padding, as kda.py splits in_proj
    row = torch.randn(n, 3 * P + H + P + 8, generator=gen)
    return row[:, :3 * P], row[:, 3 * P:3 * P + H], row[:, 3 * P + H:4 * P + H]

def reference(x, b, f, state, starts, writes, cu):
    g = (kda_safe_gate(f, A_log, dt_bias, LB) if law == "safe" else kda_softplus_gate(f, A_log, dt_bias))
    beta = b.sigmoid()
    q, k, v = _head_views(x, D)
    out = torch.zeros(x.shape[0], H, D)
    for i, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        if starts[i] <= 0:
            continue
        o, _, states = recurrent_kda_torch(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[None, bos:eos],
                                           beta[None, bos:eos], initial_state=state[starts[i]][None].clone(),
                                           use_qk_l2norm_in_kernel=True, return_all_states=True)
        out[bos:eos] = o[0]
        for t, slot in enumerate(writes[i]):
            if slot > 0:
                state[slot] = states[t]
    return out

def rel(a, b):
    return float((a - b).norm() / b.norm())

result = {}
# plain decode: three sequences, the middle one padding (slot 0)
x, b, f = rows(3)
slots = [1, 0, 3]
state = torch.randn(5, H, D, D, generator=gen) * 0.1
want_state = state.clone()
want = reference(x, b, f, want_state, slots, [[s] for s in slots], [0, 1, 2, 3])
out = torch.full((3, H, D), 7.0)
kda.fused_recurrent_kda_packed_decode(
    mixed_qkv=x, raw_g=f.unflatten(-1, (H, D))[None], raw_beta=b[None], A_log=A_log, dt_bias=dt_bias,
    lower_bound=LB, initial_state=state, state_indices=torch.tensor(slots, dtype=torch.int32), out=out[None])
result["decode_out"] = rel(out[[0, 2]], want[[0, 2]])
result["decode_state"] = rel(state[[1, 3]], want_state[[1, 3]])
result["decode_null_zero"] = bool((out[1] == 0).all())

# MTP verification: two sequences of 2 tokens; the first accepted 1 (resumes from slot 1), the second 2 (slot 4)
x, b, f = rows(4)
spec = [[1, 2], [3, 4]]
accepted = [1, 2]
state = torch.randn(5, H, D, D, generator=gen) * 0.1
want_state = state.clone()
want = reference(x, b, f, want_state, [s[a - 1] for s, a in zip(spec, accepted)], spec, [0, 2, 4])
q, k, v = _head_views(x, D)
out = torch.full((4, H, D), 7.0)
i32 = dict(dtype=torch.int32)
kda.fused_recurrent_kda(
    q=q, k=k, v=v, raw_g=f.unflatten(-1, (H, D))[None], raw_beta=b[None], A_log=A_log, dt_bias=dt_bias,
    lower_bound=LB, initial_state=state, cu_seqlens=torch.tensor([0, 2, 4], **i32),
    ssm_state_indices=torch.tensor(spec, **i32), num_accepted_tokens=torch.tensor(accepted, **i32), out=out[None])
result["verify_out"] = rel(out, want)
result["verify_state"] = rel(state[1:], want_state[1:])
print(json.dumps(result))
"""

TOL = 1e-4  # fp32 throughout: kernel and reference differ only in summation order


@pytest.fixture(scope="module")
def kernels_present():
    pytest.importorskip("vllm")
    from vllm_ling import compat

    if compat.kda_gate_kernels() is None:
        pytest.skip(f"this vLLM has no {compat.KDA_GATE_KERNELS}")


def test_raw_gate_kernels_apply_our_safe_gate_on_strided_rows(interpret, kernels_present):
    r = interpret(CHILD, "safe", timeout=600)
    assert r["decode_null_zero"], "padding row (slot 0) must come out zero"
    bad = {k: v for k, v in r.items() if k != "decode_null_zero" and not v < TOL}
    assert not bad, f"kernel vs our ops, relative error above {TOL}: {bad}"


def test_a_different_gate_law_is_caught(interpret, kernels_present):
    """Negative control: against Kimi's softplus law the same kernels' outputs differ, so the test above can fail."""
    r = interpret(CHILD, "softplus", timeout=600)
    assert r["decode_out"] > 1e-2 and r["verify_out"] > 1e-2, r
