"""vLLM's vendored Triton KDA kernels fed our fp32 safe gate, against our torch ops (and FLA's naive op if present).

Run on a CUDA host with vLLM 0.34 or 0.33:  LING_GPU_RESULTS=/tmp/out pytest tests/gpu/test_kda_kernels_gpu.py -v
Writes the measured errors to $LING_GPU_RESULTS/kda_kernels.json when that variable is set.

The references run on the CPU in fp32 from the same bf16 inputs: `recurrent_kda_torch`, which tests/ops proves
equal to flash-linear-attention 0.6.0's `naive_recurrent_kda` (≈1e-7), plus that naive op itself when it is
importable here. Errors are `rms_ratio` = rms(diff) / rms(ref) (FLA's `get_err_ratio`) and `max_rel` =
max|diff| / max|ref|.
"""

from __future__ import annotations

import json
import os
import sys
from itertools import pairwise
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (vLLM's KDA kernels are Triton GPU kernels)", allow_module_level=True)
kda_ops = pytest.importorskip("vllm.third_party.flash_linear_attention.ops.kda")

try:
    import vllm_ling  # noqa: F401
except ImportError:  # a bare checkout on the GPU host: import the plugin from the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_ling.ops.kda import chunk_kda_torch, kda_safe_gate, kda_softplus_gate, recurrent_kda_torch  # noqa: E402

try:
    from fla.ops.kda.naive import naive_recurrent_kda
except Exception:  # noqa: BLE001 (optional here; a broken Triton build must not fail the module)
    naive_recurrent_kda = None

H, K = 4, 128  # Ling's head_dim; V = K, which vLLM's fused recurrent kernel assumes (o = empty_like(k))
LENS = [1, 63, 64, 65, 300, 1000]
BF16_RMS, BF16_MAX = 2e-2, 5e-2  # bf16 inputs and bf16 intermediates (l2-normed q/k, WY matrices) in the kernel
RESULTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    out = os.environ.get("LING_GPU_RESULTS")
    if out:
        import triton
        import vllm

        Path(out).mkdir(parents=True, exist_ok=True)
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
                "triton": triton.__version__, "fla_naive_available": naive_recurrent_kda is not None,
                "H": H, "K": K, "lens": LENS}
        (Path(out) / "kda_kernels.json").write_text(json.dumps({"meta": meta, **RESULTS}, indent=2))


def errors(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.detach().float().cpu(), got.detach().float().cpu()
    diff = got - ref
    return {
        "max_abs": diff.abs().max().item(),
        "max_rel": (diff.abs().max() / ref.abs().max().clamp_min(1e-12)).item(),
        "rms_ratio": (diff.square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-12)).item(),
        "finite": bool(torch.isfinite(got).all()),
    }


def check(name: str, err: dict, rms: float, max_rel: float) -> None:
    assert err["finite"] and err["rms_ratio"] <= rms and err["max_rel"] <= max_rel, (
        f"{name}: rms_ratio {err['rms_ratio']:.3g} (limit {rms}), max_rel {err['max_rel']:.3g} (limit {max_rel}), "
        f"max_abs {err['max_abs']:.3g}, finite {err['finite']}"
    )


def make_inputs(lens, seed):
    """bf16 q, k, v [1, T, H, K]; our fp32 safe gate from a bf16 projection; fp32 beta; fp32 V-major states."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    q, k, v, f = (torch.randn(1, T, H, K, generator=gen).bfloat16() for _ in range(4))
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(N, H, K, K, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, k=k, v=v, beta=beta, h0=h0, cu=cu, f=f.view(T, H * K), A_log=A_log, dt_bias=dt_bias)


def cuda(x: dict) -> dict:
    return {key: val.cuda() for key, val in x.items()}


def fla_naive_reference(q, k, v, g, beta, h0, cu):
    """naive_recurrent_kda per sequence on L2-normalised q, k (eps 1e-6), states transposed to V-major."""
    def l2(x):
        return x.float() / torch.sqrt(x.float().square().sum(-1, keepdim=True) + 1e-6)

    outs, states = [], []
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        o, S = naive_recurrent_kda(l2(q[:, bos:eos]), l2(k[:, bos:eos]), v[:, bos:eos].float(), g[:, bos:eos],
                                   beta[:, bos:eos], initial_state=h0[n : n + 1].transpose(-1, -2),
                                   output_final_state=True)
        outs.append(o)
        states.append(S.transpose(-1, -2))
    return torch.cat(outs, 1), torch.cat(states)


def test_chunk_kda_with_our_safe_gate_matches_reference_varlen():
    x = make_inputs(LENS, seed=0)
    d = cuda(x)
    g = kda_safe_gate(d["f"], d["A_log"], d["dt_bias"])[None]  # fp32 [1, T, H, K] in (-5, 0)
    v_in = d["v"].clone()
    o, ht = kda_ops.chunk_kda(q=d["q"], k=d["k"], v=v_in, g=g, beta=d["beta"], initial_state=d["h0"].clone(),
                              output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=d["cu"])
    torch.cuda.synchronize()

    # v upcast (exactly) so the references return fp32 o: the errors then measure the kernel, not our rounding.
    ref_in = dict(q=x["q"], k=x["k"], v=x["v"].float(), g=g.cpu(), beta=x["beta"], initial_state=x["h0"],
                  use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    o_ref, s_ref = recurrent_kda_torch(**ref_in)
    o_chunk, s_chunk = chunk_kda_torch(**ref_in, output_final_state=True)
    res = RESULTS["chunk_kda"] = {
        "o_vs_recurrent_torch": errors(o_ref, o), "state_vs_recurrent_torch": errors(s_ref, ht),
        "o_vs_chunk_torch": errors(o_chunk, o), "state_vs_chunk_torch": errors(s_chunk, ht),
        "chunk_torch_vs_recurrent_torch": {"o": errors(o_ref, o_chunk), "state": errors(s_ref, s_chunk)},
        "output_dtype": str(o.dtype), "state_dtype": str(ht.dtype),
        "v_overwritten_by_output": not torch.equal(v_in, d["v"]),  # chunk_kda writes o into v's buffer
        "per_sequence": [],
    }
    for n, (bos, eos) in enumerate(pairwise(x["cu"].tolist())):
        res["per_sequence"].append({"len": eos - bos, "o": errors(o_ref[:, bos:eos], o[:, bos:eos]),
                                    "state": errors(s_ref[n], ht[n])})
    if naive_recurrent_kda is not None:
        o_fla, s_fla = fla_naive_reference(x["q"], x["k"], x["v"], g.cpu(), x["beta"], x["h0"], x["cu"])
        res["o_vs_fla_naive"], res["state_vs_fla_naive"] = errors(o_fla, o), errors(s_fla, ht)
        res["recurrent_torch_vs_fla_naive"] = {"o": errors(o_fla, o_ref), "state": errors(s_fla, s_ref)}

    # Negative control: the same kernel fed Kimi's softplus gate must be far from the safe-gate reference.
    g_kimi = kda_softplus_gate(d["f"], d["A_log"], d["dt_bias"])[None]
    o_kimi, _ = kda_ops.chunk_kda(q=d["q"], k=d["k"], v=d["v"].clone(), g=g_kimi, beta=d["beta"],
                                  initial_state=d["h0"].clone(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=d["cu"])
    res["softplus_gate_o_vs_reference"] = errors(o_ref, o_kimi)

    assert o.shape == o_ref.shape and ht.shape == s_ref.shape and ht.dtype == torch.float32
    check("our chunk vs our recurrent (fp32, CPU)", res["chunk_torch_vs_recurrent_torch"]["o"], 1e-5, 1e-4)
    check("chunk_kda o", res["o_vs_recurrent_torch"], BF16_RMS, BF16_MAX)
    check("chunk_kda final state", res["state_vs_recurrent_torch"], BF16_RMS, BF16_MAX)
    if naive_recurrent_kda is not None:
        check("chunk_kda o vs FLA naive", res["o_vs_fla_naive"], BF16_RMS, BF16_MAX)
    assert res["softplus_gate_o_vs_reference"]["rms_ratio"] > 10 * BF16_RMS, "a wrong gate law went unnoticed"


def test_fused_recurrent_kda_decode_updates_state_slots_in_place():
    """Four decode steps for five sequences whose states live in scattered slots of a paged pool."""
    N, steps, slots = 5, 4, torch.tensor([7, 2, 11, 4, 1], dtype=torch.int32)  # slot 0 is vLLM's null block
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(12, H, K, K, generator=gen)
    pool_gpu, ref_pool = pool.cuda(), pool.clone()
    cu = torch.arange(N + 1, dtype=torch.int32)
    step_errors = []
    for step in range(steps):
        x = make_inputs([1] * N, seed=10 + step)
        d = cuda(x)
        g = kda_safe_gate(d["f"], d["A_log"], d["dt_bias"])[None]
        o, _ = kda_ops.fused_recurrent_kda(q=d["q"], k=d["k"], v=d["v"], g=g, beta=d["beta"], initial_state=pool_gpu,
                                           inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                                           cu_seqlens=cu.cuda(), ssm_state_indices=slots.cuda())
        o_ref, s_ref = recurrent_kda_torch(x["q"], x["k"], x["v"].float(), g.cpu(), x["beta"],
                                           initial_state=ref_pool[slots.long()], use_qk_l2norm_in_kernel=True,
                                           cu_seqlens=cu)
        ref_pool[slots.long()] = s_ref
        step_errors.append(errors(o_ref, o))
    torch.cuda.synchronize()
    others = torch.ones(12, dtype=torch.bool)
    others[slots.long()] = False
    res = RESULTS["fused_recurrent_kda_decode"] = {
        "o_per_step": step_errors, "state_in_slots": errors(ref_pool[slots.long()], pool_gpu[slots.long()]),
        "other_slots_untouched": torch.equal(pool_gpu.cpu()[others], pool[others]),
    }
    for i, err in enumerate(step_errors):
        check(f"decode step {i} o", err, 1e-2, 2e-2)  # fp32 math, only o is rounded to bf16
    check("decode states", res["state_in_slots"], 1e-4, 1e-4)
    assert res["other_slots_untouched"], "fused_recurrent_kda wrote outside ssm_state_indices"


def test_fused_recurrent_kda_spec_verify_writes_a_state_per_draft_token():
    """MTP verification: 2-D ssm_state_indices give every draft token a slot; the next round resumes from the
    slot of the last accepted token (`num_accepted_tokens`, via fused_recurrent_kda_fwd)."""
    N, Tq = 3, 3
    idx = torch.tensor([[5, 9, 2], [11, 1, 7], [3, 10, 6]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(2)
    pool = torch.randn(12, H, K, K, generator=gen)
    pool_gpu = pool.cuda()
    cu = torch.arange(0, N * Tq + 1, Tq, dtype=torch.int32)
    res = RESULTS["fused_recurrent_kda_spec_verify"] = {}

    x = make_inputs([Tq] * N, seed=20)
    d = cuda(x)
    g = kda_safe_gate(d["f"], d["A_log"], d["dt_bias"])[None]
    o, _ = kda_ops.fused_recurrent_kda(q=d["q"], k=d["k"], v=d["v"], g=g, beta=d["beta"], initial_state=pool_gpu,
                                       inplace_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.cuda(),
                                       ssm_state_indices=idx.cuda())
    o_ref, _, states = recurrent_kda_torch(x["q"], x["k"], x["v"].float(), g.cpu(), x["beta"],
                                           initial_state=pool[idx[:, 0].long()], use_qk_l2norm_in_kernel=True,
                                           cu_seqlens=cu, return_all_states=True)
    torch.cuda.synchronize()
    res["round1_o"] = errors(o_ref, o)
    res["round1_states"] = errors(states, pool_gpu[idx.flatten().long()])

    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    resume = states[(cu[:-1] + accepted - 1).long()]  # state after each sequence's last accepted token
    x2 = make_inputs([Tq] * N, seed=21)
    d2 = cuda(x2)
    g2 = kda_safe_gate(d2["f"], d2["A_log"], d2["dt_bias"])[None]
    o2, _ = kda_ops.fused_recurrent_kda_fwd(q=d2["q"], k=d2["k"], v=d2["v"], g=g2, beta=d2["beta"], scale=K**-0.5,
                                            initial_state=pool_gpu, inplace_final_state=True, cu_seqlens=cu.cuda(),
                                            ssm_state_indices=idx.cuda(), num_accepted_tokens=accepted.cuda(),
                                            use_qk_l2norm_in_kernel=True)
    o2_ref, _, states2 = recurrent_kda_torch(x2["q"], x2["k"], x2["v"].float(), g2.cpu(), x2["beta"],
                                             initial_state=resume, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                             return_all_states=True)
    torch.cuda.synchronize()
    res["round2_o"] = errors(o2_ref, o2)
    res["round2_states"] = errors(states2, pool_gpu[idx.flatten().long()])

    check("verify round 1 o", res["round1_o"], 1e-2, 2e-2)
    check("verify round 1 per-token states", res["round1_states"], 1e-4, 1e-4)
    check("verify round 2 o (resumed at num_accepted_tokens)", res["round2_o"], 1e-2, 2e-2)
    check("verify round 2 per-token states", res["round2_states"], 1e-4, 1e-4)
