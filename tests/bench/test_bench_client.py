from __future__ import annotations

import math

import pytest
from bench_fake_server import CHAT_TEMPLATE_TOKENS, fake_count

from ling_bench.client import BenchError, Endpoint, Sampling, served_models, stream_request, token_counter

PROMPT = "Write a Go function that merges overlapping integer intervals."
GENEROUS_S = 5.0  # upper-bound slack for a loaded 2-core CI box; never a speed claim


def _ep(server, chat: bool = False) -> Endpoint:
    return Endpoint(server.url, server.config.model, chat=chat, timeout_s=30)


def test_completion_tokens_come_from_usage_not_from_chunk_count(fake, session):
    server = fake(tokens_per_chunk=4)
    r = stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=16))
    assert r.completion_tokens == 16
    assert r.chunks == server.state.chunks_sent[0] == 1 + math.ceil(15 / 4)
    assert r.chunks != r.completion_tokens


def test_ttft_covers_the_configured_first_token_delay(fake, session):
    server = fake(first_token_delay_s=0.2)
    r = stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=4))
    assert 0.2 <= r.ttft_s < 0.2 + GENEROUS_S


def test_chat_ttft_waits_for_content_not_the_empty_role_chunk(fake, session):
    server = fake(first_token_delay_s=0.2)
    r = stream_request(session, _ep(server, chat=True), PROMPT, Sampling(max_tokens=4))
    assert 0.2 <= r.ttft_s < 0.2 + GENEROUS_S
    assert r.completion_tokens == 4


def test_an_empty_text_delta_still_marks_the_first_token(fake, session):
    server = fake(first_text="", tokens_per_chunk=1, chunk_delay_s=1.0)
    r = stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=2))
    assert r.chunks == server.state.chunks_sent[0] == 2
    assert r.ttft_s < 1.0  # the empty first chunk, not the second one a second later


def test_chat_empty_content_delta_after_the_role_chunk_is_a_token(fake, session):
    server = fake(first_text="", tokens_per_chunk=1)
    r = stream_request(session, _ep(server, chat=True), PROMPT, Sampling(max_tokens=3))
    assert r.chunks == server.state.chunks_sent[0] == 3


def test_decode_rate_excludes_the_first_token_and_respects_chunk_delays(fake, session):
    server = fake(chunk_delay_s=0.02, tokens_per_chunk=3)
    r = stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=13))
    assert r.decode_tok_s == pytest.approx(12 / (r.end - r.first_token))
    # 13 tokens = 1 + 4 chunks of 3: at least 4 chunk delays separate the first and last token
    assert r.decode_tok_s <= 12 / (4 * 0.02)


def test_prefill_rate_is_server_prompt_tokens_over_ttft(fake, session):
    server = fake()
    r = stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=4))
    assert r.prompt_tokens == fake_count(PROMPT)
    assert r.prefill_tok_s == pytest.approx(r.prompt_tokens / r.ttft_s)


def test_single_token_request_has_no_decode_rate(fake, session):
    r = stream_request(session, _ep(fake()), PROMPT, Sampling(max_tokens=1))
    assert r.completion_tokens == 1 and r.decode_tok_s is None


def test_request_is_greedy_fixed_length_streamed_with_usage_and_salted(fake, session):
    server = fake()
    stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=8), cache_salt="salt-1")
    body = server.state.bodies[0]
    assert body["prompt"] == PROMPT and body["model"] == "fake-ling"
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True and body["max_tokens"] == 8
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "salt-1"


def test_chat_request_sends_one_user_message(fake, session):
    server = fake()
    stream_request(session, _ep(server, chat=True), PROMPT, Sampling(max_tokens=2))
    assert server.state.bodies[0]["messages"] == [{"role": "user", "content": PROMPT}]


def test_stream_without_usage_is_an_error_not_a_chunk_count(fake, session):
    with pytest.raises(BenchError, match="include_usage"):
        stream_request(session, _ep(fake(usage=False)), PROMPT, Sampling(max_tokens=4))


def test_http_error_names_the_status_and_the_server_message(fake, session):
    server = fake(reject_with="This model's maximum context length is 2048 tokens")
    with pytest.raises(BenchError, match="HTTP 400.*maximum context length is 2048"):
        stream_request(session, _ep(server), PROMPT, Sampling(max_tokens=4))


def test_token_counter_uses_server_tokenize_when_available(fake, session):
    count, source = token_counter(session, _ep(fake()))
    assert source == "server" and count(PROMPT) == fake_count(PROMPT) != -(-len(PROMPT) // 4)


def test_token_counter_counts_the_chat_template_in_chat_mode(fake, session):
    count, _ = token_counter(session, _ep(fake(), chat=True))
    assert count(PROMPT) == fake_count(PROMPT) + CHAT_TEMPLATE_TOKENS


def test_token_counter_falls_back_to_four_chars_per_token(fake, session):
    count, source = token_counter(session, _ep(fake(tokenize=False)))
    assert source == "estimate" and count(PROMPT) == -(-len(PROMPT) // 4)


def test_served_models_reports_max_model_len(fake, session):
    server = fake(max_model_len=4096)
    assert served_models(session, server.url) == {"fake-ling": 4096}


def test_served_models_is_empty_when_nothing_listens(session):
    assert served_models(session, "http://127.0.0.1:9") == {}
