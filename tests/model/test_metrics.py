"""ling_common.metrics: the one reader of vLLM's /metrics text (prometheus_client's parser)."""

from ling_common.metrics import SpecCounters, spec_counters, tokens_total

METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="ling"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="ling"} 1.7e+09
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="ling"} 5.5e+03
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="ling"} 2.0
"""
SPEC = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="ling"} 50.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="ling"} 1.7e+09
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="ling"} 50.0
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="ling"} 45.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="ling",position="0"} 45.0
"""


def test_progress_is_prompt_plus_generated_tokens_and_ignores_created_and_gauges():
    assert tokens_total(METRICS) == 1234.0 + 5500.0


def test_no_token_series_reads_zero():
    assert tokens_total("vllm:num_requests_running 1.0\n") == 0.0


def test_spec_counters_and_their_difference():
    now = spec_counters(METRICS + SPEC)
    assert now == SpecCounters(draft_tokens=50, accepted=45, drafts=50, per_pos=(45,))
    delta = now - SpecCounters(10, 5, 10, (5,))
    assert (delta.acceptance_rate, delta.mean_acceptance_length, delta.per_pos_rate) == (1.0, 2.0, [1.0])


def test_no_spec_counters_means_no_speculation():
    assert spec_counters(METRICS) is None
