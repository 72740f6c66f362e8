"""The probes against a small HTTP server: engine progress from /metrics, the server's key on every request,
a refusal that is an answer (not a failure), and /health 503 as vLLM's word that its engine died."""
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ling_watchdog.config import load_config
from ling_watchdog.probes import Prober, auth_headers, tokens_total

KEY = "sk-probe-1"


@pytest.fixture
def server():
    """A server like vLLM's: /v1 wants `Bearer KEY`, /health and /metrics answer anyone; `state` drives it."""
    state = {"health": 200, "seen": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body=""):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(state["health"])
            if self.path == "/metrics":
                return self._send(200, 'vllm:generation_tokens_total{model_name="m"} 3.0\n')
            return self._send(401 if self.headers.get("Authorization") != f"Bearer {KEY}" else 200,
                              json.dumps({"data": [{"id": "m"}]}))

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            state["seen"].append(self.headers.get("Authorization"))
            if self.headers.get("Authorization") != f"Bearer {KEY}":
                return self._send(401, json.dumps({"error": "Unauthorized"}))
            return self._send(200, json.dumps({"choices": [{"text": " x"}]}))

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()
    httpd.server_close()


def prober(url, key=None):
    return Prober(url, load_config(overrides=dict(health_timeout_s=2)), queue.Queue(), "m", api_key=key)


def test_progress_is_read_by_the_one_metrics_reader():
    assert tokens_total('vllm:prompt_tokens_total{a="b"} 2.0\nvllm:generation_tokens_total 3.0\n') == 5.0


def test_every_probe_presents_the_servers_key(server):
    url, state = server
    r = prober(url, KEY)._complete("live", 2)
    assert r.ok and not r.refused and state["seen"] == [f"Bearer {KEY}"] and auth_headers(None) == {}


def test_a_refusal_is_an_answer_the_server_is_up_and_no_failure_is_counted(server):
    url, _ = server
    r = prober(url)._complete("live", 2)
    assert r.ok and r.refused and "HTTP 401" in r.detail


def test_health_503_says_the_engine_is_dead(server):
    url, state = server
    state["health"] = 503
    r = prober(url, KEY)._health("live")
    assert not r.ok and r.dead and "vLLM reports its engine dead" in r.detail
    state["health"] = 200
    assert not prober(url, KEY)._health("live").dead
