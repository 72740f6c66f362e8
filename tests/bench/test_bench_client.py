"""ling-bench's own HTTP calls: /v1/models, /tokenize and the server's message on a refused case."""

from __future__ import annotations

from bench_fake_server import CHAT_TEMPLATE_TOKENS, fake_count

from ling_bench.client import Endpoint, served_models, server_error, token_counter

PROMPT = "Write a Go function that merges overlapping integer intervals."


def _ep(server, chat: bool = False) -> Endpoint:
    return Endpoint(server.url, server.config.model, chat=chat, timeout_s=30)


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


def test_server_error_names_the_status_and_the_server_message(fake):
    server = fake(reject_with="This model's maximum context length is 2048 tokens")
    message = server_error(_ep(server), PROMPT)
    assert "HTTP 400" in message and "maximum context length is 2048" in message


def test_server_error_is_none_when_the_server_accepts(fake):
    assert server_error(_ep(fake()), PROMPT) is None
