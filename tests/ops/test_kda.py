"""chunk_kda_torch / recurrent_kda_torch against flash-linear-attention 0.6.0's naive references."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from vllm_ling.ops.kda import chunk_kda_torch, kda_safe_gate, kda_softplus_gate, recurrent_kda_torch

LENS = [1, 63, 64, 65, 300]  # around the 64-token chunk edge, plus several chunks
SHAPES = pytest.mark.parametrize("H, K, V", [pytest.param(4, 32, 16, id="H4-K32-V16"),
                                             pytest.param(2, 64, 64, id="H2-K64-V64")])
RTOL = 1e-5  # fp32: max abs error relative to max |ref|; measured ≈ 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """vLLM's in-kernel L2 norm, x / sqrt(Σx² + 1e-6); FLA's naive ops expect normalised q, k."""
    return x / torch.sqrt(x.float().square().sum(-1, keepdim=True) + 1e-6)


def make_inputs(lens, H=4, K=32, V=16, seed=0, dtype=torch.float32, gate=kda_safe_gate):
    """Packed varlen q, k, v, g, beta ([1, T, H, .]), cu_seqlens and a V-major initial state [N, H, V, K]."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k = (torch.randn(1, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen)
    f = torch.randn(T, H * K, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen)
    g = gate(f, A_log, dt_bias)[None]
    beta = torch.rand(1, T, H, generator=gen)
    h0 = torch.randn(len(lens), H, V, K, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


def fla_reference(naive, q, k, v, g, beta, initial_state, cu_seqlens):
    """FLA's varlen recipe: `naive_recurrent_kda` once per sequence, then concatenate; states made V-major."""
    outs, states = [], []
    for n, (bos, eos) in enumerate(pairwise(cu_seqlens.tolist())):
        o, S = naive.naive_recurrent_kda(
            l2norm(q[:, bos:eos]), l2norm(k[:, bos:eos]), v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos],
            initial_state=initial_state[n : n + 1].transpose(-1, -2), output_final_state=True,
        )
        outs.append(o)
        states.append(S.transpose(-1, -2))
    return torch.cat(outs, 1), torch.cat(states)


def rel_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    """max |got − ref| / max |ref|, NaN-safe (a NaN anywhere gives inf)."""
    err = (got.float() - ref.float()).abs().max()
    return float("inf") if not torch.isfinite(err) else (err / ref.float().abs().max().clamp_min(1e-12)).item()


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float = RTOL) -> None:
    assert got.shape == ref.shape, f"{name}: shape {list(got.shape)} != reference {list(ref.shape)}"
    err = rel_err(ref, got)
    assert err <= rtol, f"{name}: max abs err / max |ref| = {err:.3g} > {rtol}"


def run_chunk(x, **kw):
    return chunk_kda_torch(**x, output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)


def run_recurrent(x, **kw):
    return recurrent_kda_torch(**x, use_qk_l2norm_in_kernel=True, **kw)


@SHAPES
def test_recurrent_matches_fla_naive_varlen_with_initial_state(fla_naive, H, K, V):
    x = make_inputs(LENS, H, K, V)
    o_ref, s_ref = fla_reference(fla_naive, **x)
    o, s = run_recurrent(x)
    assert_close("o", o_ref, o)
    assert_close("final_state", s_ref, s)


@SHAPES
def test_chunk_matches_fla_naive_varlen_with_initial_state(fla_naive, H, K, V):
    x = make_inputs(LENS, H, K, V)
    o_ref, s_ref = fla_reference(fla_naive, **x)
    o, s = run_chunk(x)
    assert_close("o", o_ref, o)
    assert_close("final_state", s_ref, s)


def test_chunk_matches_fla_naive_chunk(fla_naive):
    """naive_chunk_kda (the same WY algorithm, T a multiple of 64) on pre-normalised q, k, no in-kernel norm."""
    x = make_inputs([128], seed=1)
    q, k = l2norm(x["q"]), l2norm(x["k"])
    o_ref, s_ref = fla_naive.naive_chunk_kda(q, k, x["v"], x["g"], x["beta"],
                                             initial_state=x["initial_state"].transpose(-1, -2),
                                             output_final_state=True)
    o, s = chunk_kda_torch(q, k, x["v"], x["g"], x["beta"], initial_state=x["initial_state"], output_final_state=True)
    assert_close("o", o_ref, o)
    assert_close("final_state", s_ref.transpose(-1, -2), s)


@pytest.mark.parametrize("chunk_size", [16, 64, 100])
def test_chunk_equals_recurrent_for_any_chunk_size(chunk_size):
    x = make_inputs(LENS, seed=2)
    o_rec, s_rec = run_recurrent(x)
    o, s = run_chunk(x, chunk_size=chunk_size)
    assert_close("o", o_rec, o)
    assert_close("final_state", s_rec, s)


def test_chunked_prefill_split_at_arbitrary_points_equals_one_shot():
    x = make_inputs([300], seed=3)
    o_full, s_full = run_chunk(x)
    outs, state = [], x["initial_state"]
    for bos, eos in [(0, 1), (1, 37), (37, 101), (101, 229), (229, 300)]:
        part = {key: val[:, bos:eos] for key, val in x.items() if key not in ("initial_state", "cu_seqlens")}
        o, state = chunk_kda_torch(**part, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert_close("o", o_full, torch.cat(outs, 1))
    assert_close("final_state", s_full, state)


def test_batch_rows_equal_packed_varlen():
    """Without cu_seqlens each of the B rows is one sequence, as in vLLM's `chunk_kda`."""
    x = make_inputs([50, 50, 50], seed=4)
    rows = {key: x[key].view(3, 50, *x[key].shape[2:]) for key in ("q", "k", "v", "g", "beta")}
    for run in (run_chunk, run_recurrent):
        o_packed, s_packed = run(x)
        o_rows, s_rows = run({**rows, "initial_state": x["initial_state"], "cu_seqlens": None})
        assert_close(f"{run.__name__} o", o_packed.view(3, 50, *o_packed.shape[2:]), o_rows)
        assert_close(f"{run.__name__} final_state", s_packed, s_rows)


def test_uniform_and_ragged_recurrent_paths_agree():
    """Equal-length batches (decode, verify) are stepped together; the result must match one-by-one stepping."""
    x = make_inputs([3, 3, 3], seed=5)
    o_all, s_all = run_recurrent(x)
    for n in range(3):
        one = {key: x[key][:, 3 * n : 3 * n + 3] for key in ("q", "k", "v", "g", "beta")}
        o, s = run_recurrent({**one, "initial_state": x["initial_state"][n : n + 1], "cu_seqlens": None})
        assert_close(f"seq {n} o", o_all[:, 3 * n : 3 * n + 3], o)
        assert_close(f"seq {n} state", s_all[n : n + 1], s)


@pytest.mark.parametrize("lens", [pytest.param([4, 4], id="uniform"), pytest.param([1, 5, 2], id="ragged")])
def test_return_all_states_holds_the_state_after_every_token(lens):
    x = make_inputs(lens, seed=6)
    _, final, states = run_recurrent(x, return_all_states=True)
    cu = x["cu_seqlens"]
    assert states.shape == (sum(lens), 4, 16, 32)
    assert_close("state at each sequence end", final, states[cu[1:].long() - 1])
    bos, t = cu[1].item(), cu[1].item() + 1  # second token of the second sequence
    prefix = {key: x[key][:, bos : t + 1] for key in ("q", "k", "v", "g", "beta")}
    _, s_prefix = run_recurrent({**prefix, "initial_state": x["initial_state"][1:2], "cu_seqlens": None})
    assert_close("state after a middle token", s_prefix[0], states[t])


def test_bf16_inputs_compute_in_fp32_and_return_v_dtype():
    x = make_inputs(LENS, seed=7, dtype=torch.bfloat16)
    x32 = {key: val.float() if key in ("q", "k", "v") else val for key, val in x.items()}
    for run in (run_chunk, run_recurrent):
        o, s = run(x)
        o32, s32 = run(x32)
        assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
        assert_close(f"{run.__name__} o", o32, o, rtol=8e-3)  # only the final bf16 rounding of o
        assert_close(f"{run.__name__} final_state", s32, s, rtol=1e-6)


def test_strong_unbounded_decay_stays_finite_and_exact():
    """Kimi's softplus gate reaches g ≈ -370 here; the chunk path must shrink its row blocks, not overflow.

    The tolerance is looser: the chunk-local cumsum reaches |Γ| ≈ 2·10⁴, where fp32 spacing is 2·10⁻³, so
    exp(Γ_r − Γ_c) carries that absolute error (vLLM's chunk kernel shares it; the recurrent form does not).
    """
    x = make_inputs([130], seed=8, gate=lambda f, a, b: kda_softplus_gate(f * 20, a + 1.0, b))
    assert x["g"].min() < -300
    o_rec, s_rec = run_recurrent(x)
    o, s = run_chunk(x)
    assert_close("o", o_rec, o, rtol=1e-4)
    assert_close("final_state", s_rec, s, rtol=1e-4)


def test_perturbed_gate_breaks_agreement(fla_naive):
    """Negative control: a 5 % error in the gate of each sequence's last token must be far outside the tolerance."""
    x = make_inputs(LENS, seed=9)
    o_ref, s_ref = fla_reference(fla_naive, **x)
    g = x["g"].clone()
    g[0, x["cu_seqlens"][1:].long() - 1] *= 0.95
    for run in (run_chunk, run_recurrent):
        o, s = run({**x, "g": g})
        assert rel_err(o_ref, o) > 100 * RTOL and rel_err(s_ref, s) > 100 * RTOL


def test_initial_state_is_read_v_major(fla_naive):
    """Negative control: handing over FLA's K-major state (same shape when K == V) must change the result."""
    x = make_inputs([5], K=16, V=16, seed=10)  # short: the gate forgets the initial state within ~50 tokens
    o_ref, s_ref = fla_reference(fla_naive, **x)
    wrong = {**x, "initial_state": x["initial_state"].transpose(-1, -2).contiguous()}
    for run in (run_chunk, run_recurrent):
        o, s = run(wrong)
        assert rel_err(o_ref, o) > 100 * RTOL and rel_err(s_ref, s) > 100 * RTOL


def test_default_scale_is_inverse_sqrt_head_dim():
    x = make_inputs([20], seed=11)
    for run in (run_chunk, run_recurrent):
        assert_close(run.__name__, run(x, scale=32**-0.5)[0], run(x)[0], rtol=0)
        assert rel_err(run(x)[0], run(x, scale=0.5)[0]) > 1e-2


def test_empty_sequence_keeps_its_initial_state():
    x = make_inputs([5, 0, 7], seed=12)
    for run in (run_chunk, run_recurrent):
        _, s = run(x)
        assert torch.equal(s[1], x["initial_state"][1])


def test_inputs_and_initial_state_are_not_modified():
    x = make_inputs([5, 70], seed=14)
    before = {key: val.clone() for key, val in x.items()}
    for run in (run_chunk, run_recurrent):
        run(x)
        assert all(torch.equal(x[key], before[key]) for key in x), run.__name__


def test_bad_inputs_raise_errors_that_name_the_value():
    x = make_inputs([4, 4], seed=13)
    with pytest.raises(ValueError, match="float32"):
        run_chunk({**x, "initial_state": x["initial_state"].bfloat16()})
    with pytest.raises(ValueError, match=r"\[N, H, V, K\]"):
        run_recurrent({**x, "initial_state": x["initial_state"][:1]})
    with pytest.raises(ValueError, match="batch size must be 1"):
        run_chunk({**x, **{key: x[key].view(2, 4, *x[key].shape[2:]) for key in ("q", "k", "v", "g", "beta")}})
    with pytest.raises(ValueError, match="cu_seqlens"):
        run_recurrent({**x, "cu_seqlens": torch.tensor([0, 5, 7])})
    with pytest.raises(ValueError, match="must be <= 0"):
        run_chunk({**x, "g": -x["g"]})
