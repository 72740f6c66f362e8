"""FlashKDA (vLLM's vendored fused CUDA KDA prefill, `vllm._flashkda_C`) against our fp32 recurrence, beside the Triton
chunk_kda that serves otherwise; our glue around it (kda_core, whole prefill batches); its time and memory.

Run on a CUDA host with vLLM 0.34 or 0.33:  LING_GPU_RESULTS=/tmp/out pytest tests/gpu/test_flashkda_gpu.py -q
(tests/gpu/run_on_device.sh flashkda). Writes $LING_GPU_RESULTS/flashkda.json: every error, the timings and
FlashKDA's workspace bytes.

The reference is `recurrent_kda_torch` on the CPU in fp32 (tests/ops holds it to flash-linear-attention's
`naive_recurrent_kda`), fed the same bf16 inputs through our fp32 safe gate and σ(β). Both kernels take the raw
forget-gate projection and β logits, as the layer hands them. Errors: rms_ratio = rms(diff) / rms(ref),
max_rel = max|diff| / max|ref|. FlashKDA keeps its running state in bf16 inside a call (Triton: fp32), so it must
meet the same bf16 bars as Triton and be no worse than K_TIMES x Triton's error (ROUNDOFF where Triton's is below it).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpu_helpers import record  # noqa: E402  (skips the module without CUDA)

torch = pytest.importorskip("torch")
try:
    import vllm_ling  # noqa: F401
except ImportError:  # a bare checkout on the GPU host
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm_ling import compat, flashkda  # noqa: E402
from vllm_ling.kda_core import Gate, gate_torch, run_cuda_gate_in_kernel, run_torch  # noqa: E402
from vllm_ling.ops.kda import kda_safe_gate, recurrent_kda_torch  # noqa: E402

_GAPS = flashkda.contract_gaps(compat.cuda_capability(), torch.bfloat16, 128, -5.0, torch.float32,
                               compat.flashkda_ops() is not None, True)
if _GAPS:
    pytest.skip(f"FlashKDA cannot serve here: {'; '.join(_GAPS)}", allow_module_level=True)

H, D, LB = 4, 128, -5.0  # Ling's head dim and gate bound; 4 heads keep the CPU reference quick
LENS = [1, 63, 64, 65, 1000, 4096]
BF16_RMS, BF16_MAX = 2e-2, 5e-2  # the bars vLLM's Triton chunk_kda meets (tests/gpu/test_kda_kernels_gpu.py)
K_TIMES, ROUNDOFF = 2.0, 2.0**-8  # FlashKDA's error <= max(K_TIMES x Triton's, bf16's unit roundoff)
TIMED_TOKENS, TIMED_HEADS = [4096, 16384, 65536], 32  # one Ling-3.0-flash layer's heads at TP 1
RESULTS: dict = {"meta": {}, "accuracy": {}, "glue": {}, "timing": {}, "workspace": {}}


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    import vllm

    RESULTS["meta"] = {"device": torch.cuda.get_device_name(), "capability": compat.cuda_capability(),
                       "torch": torch.__version__, "vllm": vllm.__version__, "H": H, "D": D, "lower_bound": LB,
                       "k_times": K_TIMES, "roundoff": ROUNDOFF}
    record("flashkda", RESULTS)


def errors(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.detach().float().cpu(), got.detach().float().cpu()
    diff = got - ref
    return {"max_rel": (diff.abs().max() / ref.abs().max().clamp_min(1e-12)).item(),
            "rms_ratio": (diff.square().mean().sqrt() / ref.square().mean().sqrt().clamp_min(1e-12)).item(),
            "finite": bool(torch.isfinite(got).all())}


def within_bf16(name: str, err: dict) -> None:
    assert err["finite"] and err["rms_ratio"] <= BF16_RMS and err["max_rel"] <= BF16_MAX, f"{name}: {err}"


def no_worse(name: str, flash: dict, triton: dict) -> None:
    bar = max(K_TIMES * triton["rms_ratio"], ROUNDOFF)
    assert flash["rms_ratio"] <= bar, (f"{name}: FlashKDA rms_ratio {flash['rms_ratio']:.3g} > {bar:.3g} "
                                       f"(Triton {triton['rms_ratio']:.3g})")


def inputs(lens: list[int], heads: int, seed: int, gate_shift: float = 0.0, device: str = "cpu") -> dict:
    """bf16 q, k, v, raw gate f [1, T, H, D] and β logits [1, T, H]; fp32 A_log, dt_bias (shifted by `gate_shift`:
    -6 makes the decay slow, e^g ~ 0.99, the long-memory regime where a bf16 state's rounding lasts), states."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lens), len(lens)
    q, k, v, f = (torch.randn(1, T, heads, D, generator=gen).bfloat16() for _ in range(4))
    b = torch.randn(1, T, heads, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(heads, generator=gen) * 0.5, torch.randn(heads * D, generator=gen) + gate_shift
    h0 = torch.randn(N, heads, D, D, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = dict(q=q, k=k, v=v, f=f, b=b, A_log=A_log, dt_bias=dt_bias, h0=h0, cu=cu)
    return {key: val.to(device) for key, val in x.items()}


def run_flashkda(d: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return flashkda.prefill(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], LB, d["h0"].clone(),
                            d["cu"])[:2]


def run_triton(d: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return compat.kda_gate_kernels().chunk_kda_with_fused_gate(
        q=d["q"], k=d["k"], v=d["v"], raw_g=d["f"], raw_beta=d["b"], A_log=d["A_log"], g_bias=d["dt_bias"],
        lower_bound=LB, scale=D**-0.5, initial_state=d["h0"].clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=d["cu"])


def reference(x: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Our fp32 recurrence (CPU) on the same bf16 inputs, gate and σ(β) by our ops in fp32."""
    T, heads = x["q"].shape[1], x["q"].shape[2]
    g = kda_safe_gate(x["f"].view(T, heads * D), x["A_log"], x["dt_bias"], LB)[None]
    return recurrent_kda_torch(x["q"], x["k"], x["v"].float(), g, x["b"].float().sigmoid(), initial_state=x["h0"],
                               use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])


CASES = {**{f"len{n}": ([n], 0.0) for n in LENS}, "varlen": (LENS, 0.0), "len4096_slow_decay": ([4096], -6.0)}


@pytest.mark.parametrize("case", list(CASES))
def test_flashkda_matches_our_fp32_recurrence_and_is_no_worse_than_triton(case):
    lens, shift = CASES[case]
    x = inputs(lens, H, seed=list(CASES).index(case), gate_shift=shift)
    d = {key: val.cuda() for key, val in x.items()}
    (o_f, s_f), (o_t, s_t) = run_flashkda(d), run_triton(d)
    torch.cuda.synchronize()
    o_ref, s_ref = reference(x)
    res = RESULTS["accuracy"][case] = {
        "lens": lens, "flashkda": {"o": errors(o_ref, o_f), "state": errors(s_ref, s_f)},
        "triton": {"o": errors(o_ref, o_t), "state": errors(s_ref, s_t)},
        "out_dtype": str(o_f.dtype), "state_dtype": str(s_f.dtype)}
    assert o_f.shape == o_ref.shape and s_f.shape == s_ref.shape and s_f.dtype == torch.float32
    for kernel in ("flashkda", "triton"):
        for what in ("o", "state"):
            within_bf16(f"{case}: {kernel} {what}", res[kernel][what])
    for what in ("o", "state"):
        no_worse(f"{case} {what}", res["flashkda"][what], res["triton"][what])


def test_a_wrong_gate_is_caught():
    """Negative control: FlashKDA fed another bound (-2.5) must miss the -5 reference by far more than the bar."""
    x = inputs([300], H, seed=99)
    d = {key: val.cuda() for key, val in x.items()}
    o, _, _ = flashkda.prefill(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], -2.5, d["h0"],
                               d["cu"])
    err = RESULTS["accuracy"]["wrong_bound_control"] = errors(reference(x)[0], o)
    assert err["rms_ratio"] > 5 * BF16_RMS


def test_the_workspace_formula_is_flashkdas():
    ops = compat.flashkda_ops()
    sizes = [(1, 4, 1), (17, 4, 1), (8192, 32, 2), (8192, 16, 2), (16384, 32, 1024), (65536, 32, 1)]
    got = {f"T{t}_H{h}_N{n}": int(ops.get_workspace_size(t, h, n)) for t, h, n in sizes}
    RESULTS["workspace"]["get_workspace_size"] = got
    RESULTS["workspace"]["recipe_engine_bytes"] = flashkda.engine_workspace_bytes(8192, 2, 32)
    assert got == {f"T{t}_H{h}_N{n}": flashkda.workspace_bytes(t, h, n) for t, h, n in sizes}


# --- the glue: kda_core on whole batches ----------------------------------------------------------------------

K_CONV, NUM_SPEC, SLOTS = 4, 1, 8
CH = 3 * H * D
_gen = torch.Generator().manual_seed(5)
GATE = Gate(torch.randn(H, generator=_gen) * 0.5, torch.randn(H * D, generator=_gen), LB)


def _rows(n: int, seed: int) -> torch.Tensor:
    """One fused bf16 projection row per token: q|k|v, β logits, f (the layer's views are slices of it)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, CH + H + H * D, generator=gen).bfloat16()


def _meta(device: str, *, seqs: list[tuple[int, bool]], slots: list[int], spec: dict | None = None,
          checkpoint: tuple[list[int], list[int]] | None = None):
    """vLLM's GDN metadata for plain sequences (length, has initial state), decodes first, then prefills, each in its
    slot, optionally beside MTP verify rows (`spec`: their token rows and metadata), with the prefill conv's own
    metadata (vLLM's compute_causal_conv1d_metadata, as the GDN builder makes it)."""
    from vllm.v1.attention.backends.utils import compute_causal_conv1d_metadata

    i32 = dict(dtype=torch.int32, device=device)
    lens = [n for n, _ in seqs]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = SimpleNamespace(
        spec_sequence_masks=None, num_prefills=sum(n > 1 for n in lens), num_decodes=sum(n == 1 for n in lens),
        num_spec_decodes=0, non_spec_query_start_loc=qsl.to(device), non_spec_state_indices_tensor=torch.tensor(
            slots, **i32), has_initial_state=torch.tensor([h for _, h in seqs], dtype=torch.bool, device=device))
    if checkpoint is not None:  # vLLM's MambaPrefillCheckpointMetadata: per row an offset (0: none) and a slot
        offsets, into = checkpoint
        meta.checkpoint = SimpleNamespace(checkpoint_offsets=torch.tensor(offsets, **i32),
                                          state_indices=torch.tensor(into, **i32), offsets=offsets)
    if device == "cuda":
        meta.nums_dict, meta.batch_ptr, meta.token_chunk_offset_ptr = compute_causal_conv1d_metadata(
            qsl, device=torch.device(device))
    if spec is not None:
        meta.spec_sequence_masks = torch.tensor(spec["mask"], device=device)
        meta.num_spec_decodes = len(spec["slots"])
        meta.spec_state_indices_tensor = torch.tensor(spec["slots"], **i32)
        meta.spec_query_start_loc = torch.tensor(spec["qsl"], **i32)
        meta.num_accepted_tokens = torch.tensor(spec["accepted"], **i32)
        meta.spec_token_indx = torch.tensor(spec["rows"], device=device)
        meta.non_spec_token_indx = torch.tensor(spec["plain_rows"], device=device)
    return meta


class Caches:
    """One cache's contents on the CPU (fp32, run_torch) and twice on the GPU (bf16 conv, fp32 state), for the
    FlashKDA and the Triton prefill."""

    def __init__(self) -> None:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        gen = torch.Generator().manual_seed(3)
        self.conv_w = torch.randn(CH, K_CONV, generator=gen) * 0.5
        conv = torch.randn(SLOTS, CH, K_CONV - 1 + NUM_SPEC, generator=gen).bfloat16()
        rec = torch.randn(SLOTS, H, D, D, generator=gen) * 0.1
        self.before = rec.clone()
        self.cpu = conv.float(), rec.clone()
        dim_first = is_conv_state_dim_first()
        self.gpu = {}
        for kernel in ("flashkda", "triton"):
            storage = conv.cuda() if dim_first else conv.transpose(1, 2).contiguous().cuda()
            self.gpu[kernel] = (storage if dim_first else storage.transpose(1, 2)), rec.cuda()

    def run(self, rows: torch.Tensor, meta_cpu, meta_gpu, kernels: tuple[str, ...] = ("flashkda", "triton")) -> dict:
        qkv, b, f = rows[:, :CH], rows[:, CH:CH + H], rows[:, CH + H:]
        out = {"ref": run_torch(qkv.float(), *gate_torch(f, b, GATE), self.conv_w, *self.cpu, meta_cpu, D)}
        gate = Gate(GATE.A_log.cuda(), GATE.dt_bias.cuda(), LB)
        for kernel, (conv, rec) in ((k, self.gpu[k]) for k in kernels):
            row = rows.cuda()  # the views keep the fused row's stride, as in the model
            out[kernel] = run_cuda_gate_in_kernel(row[:, :CH], row[:, CH + H:], row[:, CH:CH + H], gate,
                                                  self.conv_w.cuda(), conv, rec, meta_gpu, D,
                                                  flashkda=kernel == "flashkda").float().cpu()
        torch.cuda.synchronize()
        return out


def _judge(name: str, caches: Caches, outs: dict, slots: list[int]) -> None:
    res = RESULTS["glue"][name] = {}
    for kernel in ("flashkda", "triton"):
        rec = caches.gpu[kernel][1].cpu()
        others = torch.ones(SLOTS, dtype=torch.bool)
        others[slots] = False
        res[kernel] = {"o": errors(outs["ref"], outs[kernel]), "state": errors(caches.cpu[1][slots], rec[slots]),
                       "conv_state": errors(caches.cpu[0][slots, :, :K_CONV - 1],  # the window a prefill leaves
                                            caches.gpu[kernel][0][slots, :, :K_CONV - 1]),
                       "other_slots_untouched": torch.equal(rec[others], caches.before[others])}
    for kernel in ("flashkda", "triton"):
        for what in ("o", "state", "conv_state"):
            within_bf16(f"{name}: {kernel} {what}", res[kernel][what])
        assert res[kernel]["other_slots_untouched"], f"{name}: {kernel} wrote outside the batch's slots"
    for what in ("o", "state"):
        no_worse(f"{name} {what}", res["flashkda"][what], res["triton"][what])


def test_a_prefill_batch_through_kda_core_decode_fresh_and_resumed_sequences():
    """A decode, a resumed prefill and a fresh prefill (its slot holds another sequence's state, which must not leak
    in) in scattered slots; then the same slots continue with a second prefill chunk, as chunked prefill does."""
    caches = Caches()
    seqs, slots = [(1, True), (130, True), (257, False)], [6, 2, 4]
    outs = caches.run(_rows(388, seed=40), _meta("cpu", seqs=seqs, slots=slots), _meta("cuda", seqs=seqs, slots=slots))
    _judge("decode+prefill+fresh", caches, outs, slots)
    seqs2 = [(1, True), (64, True), (65, True)]
    outs2 = caches.run(_rows(130, seed=41), _meta("cpu", seqs=seqs2, slots=slots),
                       _meta("cuda", seqs=seqs2, slots=slots))
    _judge("second chunk", caches, outs2, slots)


def test_an_in_prefill_checkpoint_from_flashkda_is_our_torch_paths():
    """VLLM_LING_KDA_PREFILL_CHECKPOINT=1 with FlashKDA: a resumed and a fresh prefill, each with an in-prefill
    checkpoint (offsets 64 and 128, as vLLM hands them on its 16-token grid), into spare slots. FlashKDA's state at the
    offset, stored with its conv window by vLLM's exporter, must equal our torch path's (tests/model/test_kda_core.py
    holds that one to a prefill of the first `offset` tokens), within bf16; the rows' own slots as before. Triton
    chunk_kda, which writes none, refuses the checkpoint."""
    caches = Caches()
    seqs, slots, into = [(130, True), (257, False)], [2, 4], [5, 7]
    checkpoint = ([64, 128], into)
    rows = _rows(387, seed=42)
    outs = caches.run(rows, _meta("cpu", seqs=seqs, slots=slots, checkpoint=checkpoint),
                      _meta("cuda", seqs=seqs, slots=slots, checkpoint=checkpoint), kernels=("flashkda",))
    (conv_ref, rec_ref), (conv, rec) = caches.cpu, caches.gpu["flashkda"]
    res = RESULTS["glue"]["in_prefill_checkpoint"] = {
        "o": errors(outs["ref"], outs["flashkda"]), "state": errors(rec_ref[slots], rec[slots].cpu()),
        "checkpoint_state": errors(rec_ref[into], rec[into].cpu()),
        "checkpoint_conv": errors(conv_ref[into, :, :K_CONV - 1], conv[into, :, :K_CONV - 1].cpu())}
    for what, err in res.items():
        within_bf16(f"in-prefill checkpoint: {what}", err)
    assert not torch.equal(rec[into].cpu(), caches.before[into]), "FlashKDA wrote no checkpoint"
    with pytest.raises(RuntimeError, match="cannot write it"):
        caches.run(rows, _meta("cpu", seqs=seqs, slots=slots), _meta("cuda", seqs=seqs, slots=slots,
                                                                     checkpoint=checkpoint), kernels=("triton",))


def test_a_prefill_beside_mtp_verify_rows_writes_its_rows_only():
    """Two verifying sequences around one prefill in one batch (rows [s0 s0 | p x 70 | s1 s1]): FlashKDA's output
    goes through a buffer of its own and back to the prefill's rows; the verify rows stay on Triton."""
    caches = Caches()
    spec = dict(mask=[True, False, True], slots=[[1, 3], [5, 7]], qsl=[0, 2, 4], accepted=[1, 2],
                rows=[0, 1, 72, 73], plain_rows=list(range(2, 72)))
    kw = dict(seqs=[(70, True)], slots=[6], spec=spec)
    outs = caches.run(_rows(74, seed=50), _meta("cpu", **kw), _meta("cuda", **kw))
    _judge("prefill beside verify rows", caches, outs, [1, 3, 5, 6, 7])


# --- time and memory (recorded, not asserted) ------------------------------------------------------------------


def _timed(fn, repeats: int = 5) -> tuple[float, int]:
    """(median ms of `repeats` calls after a warm-up, peak bytes the call allocates beyond its inputs)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), peak


@pytest.mark.parametrize("tokens", TIMED_TOKENS)
def test_time_and_memory_of_one_layers_prefill(tokens):
    """One sequence of `tokens` tokens, one Ling-3.0-flash layer's 32 heads, with an initial state. FlashKDA's
    workspace is allocated per call here (no vLLM worker), so its peak includes it."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, f = (torch.randn(1, tokens, TIMED_HEADS, D, generator=gen, device="cuda").bfloat16() for _ in range(4))
    d = dict(q=q, k=k, v=v, f=f, b=torch.randn(1, tokens, TIMED_HEADS, generator=gen, device="cuda").bfloat16(),
             A_log=torch.randn(TIMED_HEADS, generator=gen, device="cuda") * 0.5,
             dt_bias=torch.randn(TIMED_HEADS * D, generator=gen, device="cuda"),
             h0=torch.randn(1, TIMED_HEADS, D, D, generator=gen, device="cuda") * 0.1,
             cu=torch.tensor([0, tokens], dtype=torch.int32, device="cuda"))
    flash_ms, flash_peak = _timed(lambda: run_flashkda(d))
    triton_ms, triton_peak = _timed(lambda: run_triton(d))
    RESULTS["timing"][str(tokens)] = {
        "heads": TIMED_HEADS, "flashkda_ms": flash_ms, "triton_chunk_kda_ms": triton_ms,
        "speedup": triton_ms / flash_ms, "flashkda_peak_bytes": flash_peak, "triton_peak_bytes": triton_peak,
        "flashkda_workspace_bytes": flashkda.workspace_bytes(tokens, TIMED_HEADS, 1)}
    del d, q, k, v, f
    torch.cuda.empty_cache()
