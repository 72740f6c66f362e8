"""The few HTTP calls ling-bench makes itself, around `vllm bench serve`'s measuring: the served model and
its max_model_len (GET /v1/models), prompt sizes in the server's tokens (POST /tokenize), and the
server's own message when a case fails (vLLM's benchmark keeps only the HTTP reason)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import requests
from ling_watchdog.probes import auth_headers

from ling_bench.prompts import TokenCount, estimate_tokens


class BenchError(RuntimeError):
    """The server answered something a measurement cannot be built on."""


@dataclass(frozen=True)
class Endpoint:
    base_url: str  # server root, e.g. http://127.0.0.1:8000 (no /v1)
    model: str
    chat: bool = False
    api_key: str | None = None
    timeout_s: float = 600.0  # our own calls; vLLM's benchmark has its own limits

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def body(self, text: str) -> dict:
        """The request's model and text: one user message in chat mode, else a completion prompt."""
        return {"model": self.model,
                **({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})}


def served_models(
    session: requests.Session, base_url: str, api_key: str | None = None
) -> dict[str, int | None]:
    """Served model ids -> max_model_len (a vLLM field), from GET /v1/models; {} if it does not answer."""
    try:
        resp = session.get(base_url.rstrip("/") + "/v1/models", timeout=30,
                           headers=auth_headers(api_key))
        return {m["id"]: m.get("max_model_len") for m in resp.json()["data"]} if resp.ok else {}
    except (requests.RequestException, ValueError, KeyError, TypeError):
        return {}


def token_counter(session: requests.Session, ep: Endpoint) -> tuple[TokenCount, str]:
    """The server's own tokenizer via vLLM's POST /tokenize if it answers, else ~4 chars/token.

    In chat mode the server counts the chat template too, so sizes match what is sent.
    Returns (count function, "server" | "estimate").
    """

    def count(text: str) -> int:
        resp = session.post(ep.url("/tokenize"), json=ep.body(text), headers=ep.headers, timeout=ep.timeout_s)
        if resp.status_code != 200:
            raise BenchError(f"POST /tokenize -> HTTP {resp.status_code}: {resp.text[:500]}")
        return int(resp.json()["count"])

    try:
        count("probe")
    except (requests.RequestException, BenchError, KeyError, ValueError):
        return estimate_tokens, "estimate"
    return count, "server"


def server_error(ep: Endpoint, text: str) -> str | None:
    """What the server says to a 1-token request of `text`, if it refuses it (HTTP status + message)."""
    path = "/v1/chat/completions" if ep.chat else "/v1/completions"
    try:
        resp = requests.post(ep.url(path), json=ep.body(text) | {"max_tokens": 1}, headers=ep.headers,
                             timeout=ep.timeout_s)
    except requests.RequestException as e:
        return f"POST {path}: {e}"
    return None if resp.ok else f"POST {path} -> HTTP {resp.status_code}: {resp.text[:500]}"


def resolve_endpoint(args: argparse.Namespace, session: requests.Session) -> tuple[Endpoint, int | None]:
    """The endpoint of `--model` (the only model served when not given) and its max_model_len, as every workload
    resolves it."""
    models = served_models(session, args.base_url, args.api_key)
    if args.model is None and not models:
        raise BenchError(f"{args.base_url}/v1/models listed no model; is the server up? Else pass --model")
    if args.model is not None and models and args.model not in models:
        raise BenchError(f"--model {args.model!r} is not served at {args.base_url}; "
                         f"it serves {sorted(models)}")
    model = args.model or next(iter(models))
    return Endpoint(args.base_url, model, args.chat, args.api_key), models.get(model)
