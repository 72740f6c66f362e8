"""One streamed request against an OpenAI-compatible server (vLLM), timed from the client side.

Tokens are counted from `usage.completion_tokens` (asked for with `stream_options.include_usage`),
never from stream chunks: with speculative decoding one SSE chunk carries every token accepted in
a step, so chunk counts undercount decode speed by the mean acceptance length.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterator

import requests

from ling_bench.prompts import TokenCount, estimate_tokens


class BenchError(RuntimeError):
    """The server answered something a measurement cannot be built on."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    chat: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class Sampling:
    """Greedy, fixed-length decoding by default, so every repetition decodes the same tokens."""

    max_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM extension: decode exactly max_tokens


@dataclass(frozen=True)
class RequestResult:
    prompt_tokens: int
    completion_tokens: int
    chunks: int  # SSE events that carried tokens; < completion_tokens under spec decode
    start: float  # time.perf_counter() just before sending
    first_token: float  # arrival of the first text/content delta (see _carries_tokens)
    end: float  # arrival of the last one

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.start

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens / TTFT: the prompt is processed before the first token can exist."""
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float | None:
        """(completion_tokens - 1) / (end - first token): the first token belongs to prefill."""
        span = self.end - self.first_token
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None


def _post(session: requests.Session, ep: Endpoint, path: str, body: dict, stream: bool = False):
    resp = session.post(ep.url(path), json=body, headers=ep.headers, timeout=ep.timeout_s, stream=stream)
    if resp.status_code != 200:
        raise BenchError(f"POST {path} -> HTTP {resp.status_code}: {resp.text[:500]}")
    return resp


def served_models(
    session: requests.Session, base_url: str, api_key: str | None = None
) -> dict[str, int | None]:
    """Served model ids -> max_model_len (a vLLM field), from GET /v1/models; {} if it does not answer."""
    try:
        resp = session.get(base_url.rstrip("/") + "/v1/models", timeout=30,
                           headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        return {m["id"]: m.get("max_model_len") for m in resp.json()["data"]} if resp.ok else {}
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return {}


def _message(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def token_counter(session: requests.Session, ep: Endpoint) -> tuple[TokenCount, str]:
    """The server's own tokenizer via vLLM's POST /tokenize if it answers, else ~4 chars/token.

    In chat mode the server counts the chat template too, so sizes match what is sent.
    Returns (count function, "server" | "estimate").
    """

    def count(text: str) -> int:
        body = {"model": ep.model, **({"messages": _message(text)} if ep.chat else {"prompt": text})}
        return int(_post(session, ep, "/tokenize", body).json()["count"])

    try:
        count("probe")
    except (requests.RequestException, BenchError, KeyError, ValueError):
        return estimate_tokens, "estimate"
    return count, "server"


def _payload(ep: Endpoint, text: str, sampling: Sampling, cache_salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": ep.model,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "ignore_eos": sampling.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"messages": _message(text)} if ep.chat else {"prompt": text}),
    }
    if cache_salt:  # vLLM: a fresh salt per request keeps the prefix cache from hiding prefill
        body["cache_salt"] = cache_salt
    return body


def _events(resp: requests.Response) -> Iterator[dict[str, Any]]:
    """JSON payloads of the SSE `data:` lines (relies on chunked transfer to arrive promptly).

    Reads past `data: [DONE]` to the end of the body so the keep-alive connection is reused.
    """
    for raw in resp.iter_lines():
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, `:` keep-alive comments, event/id fields
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            continue
        event = json.loads(data)
        if "error" in event:
            raise BenchError(f"server error mid-stream: {event['error']}")
        yield event


def _carries_tokens(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice reports generated tokens.

    vLLM sends one such chunk per engine step, with empty text when the step's tokens decode to
    nothing yet (a special token, half a UTF-8 character), so an empty `text`/`content` still
    marks a token's arrival. The chat stream's opening role-only delta carries none.
    """
    if "text" in choice:
        return True
    delta = choice.get("delta") or {}
    payload = ("content", "reasoning_content", "reasoning", "tool_calls")
    return not delta.get("role") or any(delta.get(k) for k in payload)


def stream_request(
    session: requests.Session, ep: Endpoint, text: str, sampling: Sampling, cache_salt: str | None = None
) -> RequestResult:
    """Send one streaming request; timestamps are taken as each SSE event arrives."""
    path = "/v1/chat/completions" if ep.chat else "/v1/completions"
    start = time.perf_counter()
    first = end = None
    chunks, usage = 0, None
    with _post(session, ep, path, _payload(ep, text, sampling, cache_salt), stream=True) as resp:
        for event in _events(resp):
            now = time.perf_counter()
            if any(_carries_tokens(c) for c in event.get("choices") or ()):
                first, end, chunks = (now if first is None else first), now, chunks + 1
            usage = event.get("usage") or usage
    if usage is None:
        raise BenchError(f"{path} streamed no usage; the server must honour stream_options.include_usage")
    if first is None:
        raise BenchError(f"{path} streamed no text delta (usage: {usage}); cannot time the first token")
    return RequestResult(usage["prompt_tokens"], usage["completion_tokens"], chunks, start, first, end)
