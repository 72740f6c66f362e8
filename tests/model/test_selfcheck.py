"""The start-up self-check turns vLLM's log and spec-decode counters into ON/OFF lines, and fails loudly
when an optimisation that was asked for is not active."""

import json

from vllm_ling.selfcheck import inspect_log, judge_acceptance, judge_batch_agreement, read_choice

GPU_LOG = """INFO [core.py:116] Initializing a V1 LLM engine (v0.26.0) with config: model='/m', speculative_config=SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1), device_config=cuda, ...
INFO [int_wna16.py:157] Using 'MARLIN' WNA16 MoE backend.
INFO [gpu_model_runner.py:6845] Graph capturing finished in 21 secs, took 0.55 GiB
"""
MTP_ARGS = ["vllm", "serve", "/m", "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}']


def _by_name(verdicts):
    return {v.name: v for v in verdicts}


def test_everything_requested_and_active_passes():
    v = _by_name(inspect_log(GPU_LOG, MTP_ARGS))
    assert v["CUDA graphs"].on and v["MTP"].on and v["INT4 experts"].on
    assert "MARLIN" in v["INT4 experts"].why
    assert not any(x.failed for x in v.values())


def test_requested_mtp_that_did_not_start_fails():
    log = GPU_LOG.replace("speculative_config=SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1)",
                          "speculative_config=None")
    v = _by_name(inspect_log(log, MTP_ARGS))
    assert v["MTP"].failed and "FAILED" in v["MTP"].line()


def test_missing_cuda_graphs_fail_unless_eager_was_asked_for():
    log = GPU_LOG.replace("Graph capturing finished in 21 secs", "")
    assert _by_name(inspect_log(log, MTP_ARGS))["CUDA graphs"].failed
    assert not _by_name(inspect_log(log, MTP_ARGS + ["--enforce-eager"]))["CUDA graphs"].failed


def test_cpu_engine_does_not_expect_cuda_graphs():
    v = _by_name(inspect_log("... device_config=cpu, ...", []))
    assert not v["CUDA graphs"].on and not v["CUDA graphs"].failed


def test_tuned_tiles_requested_but_default_used_fails():
    log = GPU_LOG + "WARNING Using default MoE config. Performance might be sub-optimal!\n"
    v = _by_name(inspect_log(log, MTP_ARGS + ["VLLM_TUNED_CONFIG_FOLDER=/t"]))
    assert v["tuned MoE tiles"].failed


def test_acceptance_probe_catches_a_broken_draft():
    before = {"num_draft_tokens": 100, "num_accepted_tokens": 90}
    good = judge_acceptance(before, {"num_draft_tokens": 164, "num_accepted_tokens": 150}, minimum=0.3)
    broken = judge_acceptance(before, {"num_draft_tokens": 164, "num_accepted_tokens": 91}, minimum=0.3)
    silent = judge_acceptance(before, before, minimum=0.3)
    assert good.on and not good.failed
    assert broken.failed and "1.6%" in broken.why
    assert silent.failed and "no draft tokens" in silent.why


def test_batch_agreement_catches_a_sequence_reading_another_ones_rows():
    text = "The fox runs over the hill and the dog sleeps in the sun. " * 3
    assert judge_batch_agreement([text, text]).on
    mixed_up = judge_batch_agreement([text, "zq" + text])  # the second sequence parts at its first token
    assert mixed_up.failed and "first 0 of" in mixed_up.why and "garbage" in mixed_up.why
    late_tie = judge_batch_agreement([text, text[:100] + "X" + text[101:]])  # parted after 100 characters
    assert late_tie.on and not late_tie.failed
    assert judge_batch_agreement(["ab", "ab"]).on  # short continuations are judged on what there is


CHOICE = {"device_name": "NVIDIA H200", "moe_backend": "marlin",
          "reason": "tuned Triton is 0.44x Marlin (geomean over M=[1, 2, 4, 8, 16, 64]; needs >= 1.05x to switch)"}


def test_int4_backend_matches_ling_tunes_measured_choice(tmp_path):
    (tmp_path / "backend_choice.json").write_text(json.dumps(CHOICE))
    v = _by_name(inspect_log(GPU_LOG, MTP_ARGS, read_choice(str(tmp_path), "NVIDIA H200")))["INT4 experts"]
    assert v.on and not v.failed and "as measured" in v.why and "0.44x" in v.why


def test_int4_backend_other_than_the_measured_one_fails():
    triton_log = GPU_LOG.replace("Using 'MARLIN' WNA16 MoE backend.", "Using CompressedTensorsWNA16MoEMethod")
    v = _by_name(inspect_log(triton_log, MTP_ARGS, CHOICE))["INT4 experts"]
    assert v.failed and "CompressedTensorsWNA16MoEMethod" in v.why
    wants_triton = {**CHOICE, "moe_backend": "triton"}
    assert _by_name(inspect_log(GPU_LOG, MTP_ARGS, wants_triton))["INT4 experts"].failed


def test_no_unreadable_or_other_gpus_choice_file_means_no_verdict(tmp_path):
    assert read_choice(None, "NVIDIA H200") is None and read_choice(str(tmp_path), "NVIDIA H200") is None
    (tmp_path / "backend_choice.json").write_text(json.dumps({**CHOICE, "moe_backend": "triton"}))
    assert read_choice(str(tmp_path), "NVIDIA GB10") is None  # measured on an H200: no verdict for a GB10
    assert read_choice(str(tmp_path), None) is None  # GPU unknown
    (tmp_path / "backend_choice.json").write_text("{not json")
    assert read_choice(str(tmp_path), "NVIDIA H200") is None
    assert _by_name(inspect_log(GPU_LOG, MTP_ARGS, None))["INT4 experts"].on
