"""One case through vLLM's benchmark against the fake server: what ling-bench sends and how it reads
vLLM's per-request results (tokens from usage, rates, spec deltas, failures)."""

from __future__ import annotations

import math

import pytest
from bench_fake_server import fake_count

from ling_bench.client import BenchError, Endpoint
from ling_bench.vllm_bench import RequestResult, Sampling, SpecCounters, run_case

pytest.importorskip("vllm.benchmarks.serve")

PROMPT = "Write a Go function that merges overlapping integer intervals."
GENEROUS_S = 5.0  # upper-bound slack for a loaded 2-core CI box; never a speed claim


def _ep(server, chat: bool = False) -> Endpoint:
    return Endpoint(server.url, server.config.model, chat=chat)


def _case(server, chat: bool = False, max_tokens: int = 8, warmup: list | None = None,
          salts: list | None = None, concurrency: int = 1):
    return run_case(_ep(server, chat), PROMPT, Sampling(max_tokens=max_tokens), warmup or [],
                    salts or ["s-0"], concurrency)


def test_completion_tokens_come_from_usage_not_from_chunk_count(fake):
    server = fake(tokens_per_chunk=4)
    (r,) = _case(server, max_tokens=16).requests
    assert r.completion_tokens == 16
    assert r.chunks == server.state.chunks_sent[0] == 1 + math.ceil(15 / 4)


def test_prompt_tokens_come_from_usage_and_prefill_rate_is_them_over_ttft(fake):
    (r,) = _case(fake()).requests
    assert r.prompt_tokens == fake_count(PROMPT)
    assert r.prefill_tok_s == pytest.approx(r.prompt_tokens / r.ttft_s)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_ttft_covers_the_configured_first_token_delay(fake, chat):
    (r,) = _case(fake(first_token_delay_s=0.2), chat=chat, max_tokens=4).requests
    assert 0.2 <= r.ttft_s < 0.2 + GENEROUS_S and r.completion_tokens == 4


def test_decode_rate_excludes_the_first_token():
    r = RequestResult(prompt_tokens=10, completion_tokens=13, chunks=5, ttft_s=0.5, latency_s=1.7)
    assert r.decode_tok_s == pytest.approx(12 / 1.2)
    assert RequestResult(10, 1, 1, 0.5, 0.5).decode_tok_s is None


def test_requests_are_greedy_fixed_length_streamed_with_usage_and_salted(fake):
    server = fake()
    _case(server, salts=["salt-1"])
    (body,) = server.state.bodies
    assert body["prompt"] == PROMPT and body["model"] == "fake-ling" and body["max_tokens"] == 8
    assert body["temperature"] == 0.0 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["cache_salt"] == "salt-1"


def test_chat_requests_send_one_user_message_as_text(fake):
    server = fake()
    _case(server, chat=True, max_tokens=2)
    assert server.state.bodies[0]["messages"] == [{"role": "user", "content": PROMPT}]


def test_warmup_requests_are_sent_with_their_own_salts_but_not_returned(fake):
    server = fake()
    run = _case(server, warmup=["w-0", "w-1"], salts=["m-0", "m-1", "m-2"])
    assert [b["cache_salt"] for b in server.state.bodies] == ["w-0", "w-1", "m-0", "m-1", "m-2"]
    assert len(run.requests) == 3
    assert run.spec.draft_tokens == 3 * server.config.draft_tokens_per_request  # measured requests only


def test_no_salt_sends_no_cache_salt(fake):
    server = fake()
    _case(server, salts=[None, None])
    assert all("cache_salt" not in b for b in server.state.bodies)


def test_concurrency_bounds_the_requests_in_flight(fake):
    server = fake(first_token_delay_s=0.2)
    run = _case(server, salts=[f"s-{i}" for i in range(6)], concurrency=3)
    assert server.state.max_in_flight == 3 and len(run.requests) == 6 and run.output_tok_s > 0


def test_spec_deltas_follow_the_configured_counters(fake):
    server = fake(drafts_per_request=8, draft_tokens_per_request=24, accepted_per_request=15,
                  accepted_per_pos_per_request=(7, 5, 3))
    spec = _case(server, salts=["a", "b"]).spec
    assert spec == SpecCounters(drafts=16, draft_tokens=48, accepted=30, per_pos=(14, 10, 6))
    assert spec.acceptance_rate == pytest.approx(15 / 24)
    assert spec.mean_acceptance_length == pytest.approx(1 + 15 / 8)
    assert spec.to_json()["acceptance_rate_per_pos"] == pytest.approx([7 / 8, 5 / 8, 3 / 8])


def test_without_spec_counters_there_is_no_spec(fake):
    assert _case(fake(spec=False)).spec is None


def test_spec_counters_add_position_by_position():
    a = SpecCounters(drafts=10, draft_tokens=30, accepted=17, per_pos=(9, 5, 3))
    b = SpecCounters(drafts=2, draft_tokens=6, accepted=1, per_pos=(1,))
    assert a + b == SpecCounters(drafts=12, draft_tokens=36, accepted=18, per_pos=(10, 5, 3))
    none = SpecCounters(drafts=0, draft_tokens=0, accepted=0)
    assert none.acceptance_rate is None and none.mean_acceptance_length is None


def test_a_stream_without_usage_is_an_error_not_a_guess(fake):
    with pytest.raises(BenchError, match="include_usage"):
        _case(fake(usage=False))


def test_a_refused_request_fails_the_case(fake):
    with pytest.raises(BenchError, match="1 of 1 requests failed"):
        _case(fake(reject_with="maximum context length is 2048 tokens"))
