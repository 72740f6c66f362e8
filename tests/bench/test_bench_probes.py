from __future__ import annotations

import time
from pathlib import Path

import pytest
from bench_fake_server import write_fake_nvidia_smi

from ling_bench.probes import GpuMemSampler, SpecCounters, parse_spec

TWO_ENGINES = """\
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 30.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 60.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 35.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 10.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="0"} 25.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="m",position="1"} 10.0
"""


def test_parse_spec_sums_engines_orders_positions_and_ignores_created_samples():
    assert parse_spec(TWO_ENGINES) == SpecCounters(draft_tokens=80, accepted=50, drafts=40, per_pos=(35, 15))


def test_parse_spec_without_spec_counters_is_none():
    assert parse_spec("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None


def test_spec_rates_follow_vllm_definitions():
    spec = SpecCounters(draft_tokens=80, accepted=50, drafts=40, per_pos=(35, 15))
    assert spec.acceptance_rate == 50 / 80
    assert spec.mean_acceptance_length == 1 + 50 / 40
    assert spec.per_pos_rate == [35 / 40, 15 / 40]


def test_spec_difference_is_the_run_delta():
    before = SpecCounters(draft_tokens=100, accepted=60, drafts=50, per_pos=(40, 20))
    after = SpecCounters(draft_tokens=130, accepted=77, drafts=60, per_pos=(49, 28))
    assert after - before == SpecCounters(draft_tokens=30, accepted=17, drafts=10, per_pos=(9, 8))
    assert (after - before) + before == after


def test_mean_acceptance_length_is_none_without_the_drafts_counter():
    spec = SpecCounters(draft_tokens=30, accepted=17)
    assert spec.acceptance_rate == pytest.approx(17 / 30)
    assert spec.mean_acceptance_length is None and spec.per_pos_rate is None


def test_no_drafts_in_the_window_gives_no_rates():
    spec = SpecCounters(draft_tokens=0, accepted=0, drafts=0)
    assert spec.acceptance_rate is None and spec.mean_acceptance_length is None


def test_gpu_sampler_is_silent_without_nvidia_smi():
    with GpuMemSampler(command="ling-bench-no-such-nvidia-smi") as gpu:
        pass
    assert gpu.peak_mib is None


def _run_until_called(tmp_path: Path, state: Path, calls: int) -> GpuMemSampler:
    with GpuMemSampler(interval_s=0.01, command=str(tmp_path / "nvidia-smi")) as gpu:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not state.exists() or int(state.read_text() or 0) < calls):
            time.sleep(0.01)
    return gpu


def test_gpu_sampler_keeps_the_peak_of_each_gpu(tmp_path):
    state = write_fake_nvidia_smi(tmp_path, ["100\n5\n", "300\n2\n", "200\n9\n"])
    assert _run_until_called(tmp_path, state, 3).peak_mib == [300, 9]


def test_gpu_sampler_ignores_not_supported_readings(tmp_path):
    state = write_fake_nvidia_smi(tmp_path, ["[N/A]\n"])
    assert _run_until_called(tmp_path, state, 2).peak_mib is None
