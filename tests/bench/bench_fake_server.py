"""A fake OpenAI-compatible vLLM server on 127.0.0.1 for the bench tests.

It streams over real HTTP/1.1 chunked SSE like uvicorn does, at configured delays: the first token
alone after `first_token_delay_s` (prefill; in chat, right after vLLM's role-only opener), then
`tokens_per_chunk` tokens per event every `chunk_delay_s` (one spec-decode step each). It exposes
vLLM's spec-decode counters on /metrics, starting from non-zero values and advancing per finished
request, and a word-level /tokenize. Its prefix cache is a model of vLLM's: a request hits the longest
token prefix it shares with an earlier prompt of the same `cache_salt`, in whole blocks, never the
last token; `vllm:prefix_cache_queries/hits` count it. A chat prompt is all its messages' contents
(plus the template's tokens).
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHAT_TEMPLATE_TOKENS = 7


@dataclass
class FakeConfig:
    model: str = "fake-ling"
    max_model_len: int = 32768
    first_token_delay_s: float = 0.05
    chunk_delay_s: float = 0.005
    tokens_per_chunk: int = 3
    stall_s: float = 0.0  # one extra pause before the last chunk (a step held up mid-decode)
    first_text: str = " tok"  # "": like vLLM when the first token is special or half a character
    tokenize: bool = True  # False: /tokenize answers 404
    usage: bool = True  # False: ignore stream_options.include_usage
    spec: bool = True  # False: /metrics without spec counters
    drafts_per_request: int = 10
    draft_tokens_per_request: int = 30
    accepted_per_request: int = 17
    accepted_per_pos_per_request: tuple[int, ...] = (9, 5, 3)
    reject_with: str | None = None  # answer generation requests with HTTP 400 and this message...
    reject_over_tokens: int = 0  # ...when their prompt is longer than this
    prefix_cache: bool = True  # False: /metrics without prefix-cache counters
    block_size: int = 16


def fake_tokens(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def fake_count(text: str, chat: bool = False) -> int:
    """Word-and-punctuation tokens: deliberately not ~4 chars/token, so the source is visible."""
    return len(fake_tokens(text)) + (CHAT_TEMPLATE_TOKENS if chat else 0)


def prompt_text(body: dict) -> str:
    """A request's prompt text: every message's content in chat (one message: just its content)."""
    return "\n".join(m["content"] for m in body["messages"]) if "messages" in body else body.get("prompt", "")


@dataclass
class FakeState:
    bodies: list[dict] = field(default_factory=list)  # generation requests, in arrival order
    chunks_sent: list[int] = field(default_factory=list)  # token-carrying events per request, in arrival order
    in_flight: int = 0
    max_in_flight: int = 0
    drafts: int = 1000  # as if the server had served traffic before the bench
    draft_tokens: int = 3000
    accepted: int = 2000
    accepted_per_pos: list[int] = field(default_factory=lambda: [900, 700, 400])
    prefix_queries: int = 50000  # also as if the server had served traffic
    prefix_hits: int = 20000
    prefix_log: list[tuple[int, int]] = field(default_factory=list)  # (queries, hits) per request, in arrival order
    cached: dict[str | None, list[list[str]]] = field(default_factory=dict)  # salt -> earlier prompts' tokens
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeServer:
    def __init__(self, config: FakeConfig | None = None):
        self.config, self.state = config or FakeConfig(), FakeState()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()

    def metrics_text(self) -> str:
        s, labels = self.state, 'engine="0",model_name="fake-ling"'
        lines = ["# HELP vllm:num_requests_running Running requests.",
                 "# TYPE vllm:num_requests_running gauge",
                 f"vllm:num_requests_running{{{labels}}} {s.in_flight}.0"]
        if self.config.spec:
            for name, value in (("drafts", s.drafts), ("draft_tokens", s.draft_tokens),
                                ("accepted_tokens", s.accepted)):
                lines += [f"# TYPE vllm:spec_decode_num_{name} counter",
                          f"vllm:spec_decode_num_{name}_total{{{labels}}} {float(value)}",
                          f"vllm:spec_decode_num_{name}_created{{{labels}}} 1.7e+09"]
            lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
            per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f'{per_pos}{{{labels},position="{i}"}} {float(v)}'
                      for i, v in enumerate(s.accepted_per_pos)]
        if self.config.prefix_cache:
            for name, value in (("queries", s.prefix_queries), ("hits", s.prefix_hits)):
                lines += [f"# TYPE vllm:prefix_cache_{name} counter",
                          f"vllm:prefix_cache_{name}_total{{{labels}}} {float(value)}",
                          f"vllm:prefix_cache_{name}_created{{{labels}}} 1.7e+09"]
        return "\n".join(lines) + "\n"

    def count_prefix_cache(self, body: dict) -> None:
        """Look the prompt up like vLLM's scheduler does when it admits a request, then cache it."""
        s, block = self.state, self.config.block_size
        tokens = fake_tokens(prompt_text(body))
        with s.lock:
            earlier = s.cached.setdefault(body.get("cache_salt"), [])
            common = max((next((i for i, (a, b) in enumerate(zip(tokens, e)) if a != b), min(len(tokens), len(e)))
                          for e in earlier), default=0)
            hits = min(common, len(tokens) - 1) // block * block
            s.prefix_queries += len(tokens)
            s.prefix_hits += hits
            s.prefix_log.append((len(tokens), hits))
            earlier.append(tokens)

    def count_spec(self) -> None:
        c, s = self.config, self.state
        with s.lock:
            s.drafts += c.drafts_per_request
            s.draft_tokens += c.draft_tokens_per_request
            s.accepted += c.accepted_per_request
            s.accepted_per_pos = [a + b for a, b in zip(s.accepted_per_pos, c.accepted_per_pos_per_request)]


def _handler(server: FakeServer) -> type[BaseHTTPRequestHandler]:
    cfg, state = server.config, server.state

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _json(self, obj: dict, status: int = 200) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _event(self, obj: dict | str) -> None:
            self._chunk(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": cfg.model, "object": "model",
                                                        "max_model_len": cfg.max_model_len}]})
            elif self.path == "/metrics":
                data = server.metrics_text().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            chat = "messages" in body
            text = prompt_text(body)
            if self.path == "/tokenize" and cfg.tokenize:
                n = fake_count(text, chat)
                self._json({"count": n, "max_model_len": cfg.max_model_len, "tokens": list(range(n))})
            elif (self.path in ("/v1/completions", "/v1/chat/completions") and cfg.reject_with
                  and fake_count(text, chat) > cfg.reject_over_tokens):
                self._json({"error": {"message": cfg.reject_with, "code": 400}}, 400)
            elif self.path in ("/v1/completions", "/v1/chat/completions"):
                self._stream(body, chat, fake_count(text, chat))
            else:
                self._json({"error": "not found"}, 404)

        def _stream(self, body: dict, chat: bool, prompt_tokens: int) -> None:
            limit = body.get("max_completion_tokens") or body["max_tokens"]  # vLLM's chat client sends the former
            n = limit if body.get("ignore_eos") else min(limit, 4)
            sizes = [1] + [min(cfg.tokens_per_chunk, n - i) for i in range(1, n, cfg.tokens_per_chunk)]
            if cfg.prefix_cache:
                server.count_prefix_cache(body)
            with state.lock:  # recorded before anything is sent: the client may finish before we return
                state.bodies.append(body)
                state.chunks_sent.append(len(sizes))
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def choice(text: str) -> dict:
                return {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}

            self.wfile.flush()  # headers out; vLLM sends no SSE comments (0.32's client would choke on one)
            time.sleep(cfg.first_token_delay_s)
            if chat:  # vLLM opens a chat stream with an empty role-only delta once the first token exists
                opener = {"index": 0, "delta": {"role": "assistant", "content": ""}}
                self._event({"choices": [opener], "usage": None})
            for i, size in enumerate(sizes):
                if i:
                    time.sleep(cfg.chunk_delay_s + (cfg.stall_s if i == len(sizes) - 1 else 0.0))
                self._event({"choices": [choice(cfg.first_text if i == 0 else " tok" * size)], "usage": None})
            server.count_spec()
            with state.lock:  # before the closing events, for the same reason
                state.in_flight -= 1
            if cfg.usage and (body.get("stream_options") or {}).get("include_usage"):
                self._event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                      "total_tokens": prompt_tokens + n}})
            self._event("[DONE]")
            self._chunk(b"")

    return Handler


def write_fake_nvidia_smi(folder: Path, readings: list[str]) -> Path:
    """An executable `folder/nvidia-smi` printing the next reading per call (the last one forever).

    Returns the file that counts its calls.
    """
    state, script = folder / "nvidia-smi.calls", folder / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\n"
        "import pathlib\n"
        f"state = pathlib.Path({str(state)!r})\n"
        "n = int(state.read_text()) if state.exists() else 0\n"
        f"readings = {readings!r}\n"
        "print(readings[min(n, len(readings) - 1)], end='')\n"
        "state.write_text(str(n + 1))\n"
    )
    script.chmod(0o755)
    return state
