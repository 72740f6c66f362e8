"""`kda_core.run_cuda` (vLLM's conv and FLA kernels, called as the model calls them) equals `run_torch` (the CPU
path, which tests/model/test_kda_core.py holds to plain token-by-token decoding) on whole batches: plain decode,
MTP verification of several sequences at once (accepted and rejected drafts mixed), and both in one batch;
q|k|v a strided view of the fused projection as in the model.

The kernel tests (test_kda_kernels_gpu.py) feed the kernels dense tensors; this checks our glue. It catches
the bug found on the H200 (FINDINGS.md §1): q, k, v handed to `fused_recurrent_kda_fwd` as strided views of
the conv output, which the kernel indexes as dense [T, H, d], so in a verify batch every sequence but the
first read another token's channels. Every case runs twice: our gate computed before the op (`run_cuda`), and
the raw f and β logits handed to vLLM's raw-gate KDA kernels (`run_cuda_gate_in_kernel`, VLLM_LING_KDA_GATE=kernel;
vLLM >= 0.32), whose q, k, v stay strided views. Run: pytest tests/gpu/test_kda_core_gpu.py -q
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (vLLM's conv and KDA kernels are Triton GPU kernels)", allow_module_level=True)
pytest.importorskip("vllm.third_party.flash_linear_attention.ops.kda")
try:
    import vllm_ling  # noqa: F401
except ImportError:  # a bare checkout on the GPU host
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first  # noqa: E402

from vllm_ling.kda_core import Gate, gate_torch, run_cuda, run_cuda_gate_in_kernel, run_torch  # noqa: E402

H, D, K_CONV, NUM_SPEC, N = 4, 128, 4, 1, 3  # Ling's head_dim; 3 sequences per batch
CH = 3 * H * D
SPEC_SLOTS = [[1, 2], [3, 4], [5, 6]]  # per sequence: the slot of each verified position (0 is the null block)
REL_TOL = 2e-2  # bf16 inputs and conv state on the GPU against fp32 on the CPU; the glue bug gave ~1


_gen = torch.Generator().manual_seed(1)
GATE = Gate(torch.randn(H, generator=_gen), torch.randn(H * D, generator=_gen), -5.0)  # fp32, as the layer's
MODES = ["ours", "kernel"]


def _step(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """As the model has them: q|k|v, β logits and f, strided slices of one fused bf16 projection row."""
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(n, CH + H + H * D + 8, generator=gen).bfloat16()
    return row[:, :CH], row[:, CH:CH + H], row[:, CH + H:CH + H + H * D]


class Caches:
    """The same cache contents on the CPU (fp32, run_torch) and on the GPU (bf16 conv as in the model)."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.conv_w = torch.randn(CH, K_CONV, generator=gen) * 0.5
        conv = torch.randn(7, CH, K_CONV - 1 + NUM_SPEC, generator=gen).bfloat16()
        rec = torch.randn(7, H, D, D, generator=gen) * 0.1
        self.cpu = conv.float(), rec.clone()
        storage = conv.cuda() if is_conv_state_dim_first() else conv.transpose(1, 2).contiguous().cuda()
        view = storage if is_conv_state_dim_first() else storage.transpose(1, 2)  # [slots, CH, width], as kda.py
        self.gpu = view, rec.cuda()

    def run(self, step, meta_cpu: SimpleNamespace, meta_gpu: SimpleNamespace,
            mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, b, f = step
        ref = run_torch(qkv.float(), *gate_torch(f, b, GATE), self.conv_w, *self.cpu, meta_cpu, D)
        conv_w, (conv, rec) = self.conv_w.cuda(), self.gpu
        gpu_gate = Gate(GATE.A_log.cuda(), GATE.dt_bias.cuda(), GATE.lower_bound)
        if mode == "ours":
            g, beta = gate_torch(f.cuda(), b.cuda(), gpu_gate)
            got = run_cuda(qkv.cuda(), g, beta, conv_w, conv, rec, meta_gpu, D)
        else:
            row = torch.cat([qkv, b, f], dim=1).cuda()  # one fused row again, so the views keep its stride
            qkv_v, b_v, f_v = row[:, :CH], row[:, CH:CH + H], row[:, CH + H:]
            got = run_cuda_gate_in_kernel(qkv_v, f_v, b_v, gpu_gate, conv_w, conv, rec, meta_gpu, D)
        return ref, got.float().cpu()

    def assert_same_state(self, slots: list[int]) -> None:
        for name, ref, got in zip(("conv", "recurrent"), self.cpu, self.gpu):
            _close(f"{name} state", ref[slots], got[slots].float().cpu())


def _close(what: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    rel = float((got - ref).norm() / ref.norm())
    assert rel < REL_TOL, f"{what}: run_cuda differs from run_torch, relative error {rel:.3g}"


def _verify_meta(accepted: list[int], device: str) -> SimpleNamespace:
    i32 = dict(dtype=torch.int32, device=device)
    return SimpleNamespace(
        spec_sequence_masks=torch.ones(N, dtype=torch.bool, device=device), num_prefills=0, num_decodes=0,
        num_spec_decodes=N, spec_state_indices_tensor=torch.tensor(SPEC_SLOTS, **i32),
        spec_query_start_loc=torch.arange(0, 2 * N + 1, 2, **i32), num_accepted_tokens=torch.tensor(accepted, **i32))


def _decode_meta(slots: list[int], device: str) -> SimpleNamespace:
    i32 = dict(dtype=torch.int32, device=device)
    return SimpleNamespace(
        spec_sequence_masks=None, num_prefills=0, num_decodes=len(slots), num_spec_decodes=0,
        non_spec_state_indices_tensor=torch.tensor(slots, **i32),
        non_spec_query_start_loc=torch.arange(len(slots) + 1, **i32),
        has_initial_state=torch.ones(len(slots), dtype=torch.bool, device=device))


@pytest.mark.parametrize("mode", MODES)
def test_verify_batch_matches_torch_path_for_accepted_and_rejected_drafts(mode):
    caches = Caches()
    every_slot = [s for pair in SPEC_SLOTS for s in pair]
    for round_, accepted in enumerate([[1, 1, 1], [2, 1, 2], [1, 2, 1]]):
        ref, got = caches.run(_step(2 * N, seed=10 + round_), _verify_meta(accepted, "cpu"),
                              _verify_meta(accepted, "cuda"), mode)
        _close(f"verify round {round_} outputs (accepted {accepted})", ref, got)
        caches.assert_same_state(every_slot)


def _mixed_meta(device: str) -> SimpleNamespace:
    """Two verifying sequences and one plain decode in one batch, rows interleaved: [s0 s0 p s1 s1]."""
    i32 = dict(dtype=torch.int32, device=device)
    return SimpleNamespace(
        spec_sequence_masks=torch.tensor([True, False, True], device=device), num_prefills=0, num_decodes=1,
        num_spec_decodes=2, spec_state_indices_tensor=torch.tensor(SPEC_SLOTS[:2], **i32),
        spec_query_start_loc=torch.tensor([0, 2, 4], **i32), num_accepted_tokens=torch.tensor([2, 1], **i32),
        spec_token_indx=torch.tensor([0, 1, 3, 4], device=device), non_spec_token_indx=torch.tensor([2], device=device),
        non_spec_state_indices_tensor=torch.tensor([5], **i32), non_spec_query_start_loc=torch.tensor([0, 1], **i32),
        has_initial_state=torch.ones(1, dtype=torch.bool, device=device))


@pytest.mark.parametrize("mode", MODES)
def test_mixed_verify_and_plain_decode_batch_matches_torch_path(mode):
    """Spec and non-spec rows of one batch are gathered, run and scattered back to their own rows."""
    caches = Caches()
    ref, got = caches.run(_step(5, seed=30), _mixed_meta("cpu"), _mixed_meta("cuda"), mode)
    _close("mixed batch outputs", ref, got)
    caches.assert_same_state([1, 2, 3, 4, 5])


@pytest.mark.parametrize("mode", MODES)
def test_plain_decode_batch_matches_torch_path(mode):
    caches = Caches()
    slots = [1, 3, 5]
    for step in range(3):
        ref, got = caches.run(_step(N, seed=20 + step), _decode_meta(slots, "cpu"), _decode_meta(slots, "cuda"), mode)
        _close(f"decode step {step} outputs", ref, got)
        caches.assert_same_state(slots)
