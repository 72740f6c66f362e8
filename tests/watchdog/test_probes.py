"""Reading engine progress from vLLM's Prometheus text."""
from ling_watchdog.probes import tokens_total

METRICS = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="ling"} 1234.0
vllm:generation_tokens_created{engine="0",model_name="ling"} 1.7e+09
vllm:prompt_tokens_total{engine="0",model_name="ling"} 5.5e+03
vllm:num_requests_running{engine="0",model_name="ling"} 2.0
"""


def test_progress_is_prompt_plus_generated_tokens_and_ignores_other_series():
    assert tokens_total(METRICS) == 1234.0 + 5500.0


def test_no_token_series_reads_zero():
    assert tokens_total("vllm:num_requests_running 1.0\n") == 0.0
