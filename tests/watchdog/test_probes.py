"""The probes against a small HTTP server: engine progress from /metrics, the server's key on every request,
a refusal that is an answer (not a failure), /health 503 as vLLM's word that its engine died, and the traffic line
from the counters the liveness probe reads."""
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ling_watchdog.config import load_config
from ling_common.metrics import tokens_total
from ling_watchdog.probes import BREAK_EVEN_MIN_DRAFTS, Prober, Traffic, auth_headers

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
                return self._send(200, state.get("metrics", 'vllm:generation_tokens_total{model_name="m"} 3.0\n'))
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


def _metrics(tokens: int, queries: int, hits: int, drafts: int, drafted: int, accepted: int, finished: int = 0) -> str:
    """vLLM's counter names (0.32-0.34), as two engines would export them: every sample is summed; finished
    requests one sample per finish reason."""
    m = 'model_name="m",engine="{}"'
    return "".join(
        f'vllm:request_success_total{{{m.format(e)},finished_reason="{why}"}} {finished / 4}\n'
        for e in (0, 1) for why in ("stop", "length")) + "".join(
        f"vllm:prompt_tokens_total{{{m.format(e)}}} {tokens / 2}\n"
        f"vllm:prefix_cache_queries_total{{{m.format(e)}}} {queries / 2}\n"
        f"vllm:prefix_cache_hits_total{{{m.format(e)}}} {hits / 2}\n"
        f"vllm:spec_decode_num_drafts_total{{{m.format(e)}}} {drafts / 2}\n"
        f"vllm:spec_decode_num_draft_tokens_total{{{m.format(e)}}} {drafted / 2}\n"
        f"vllm:spec_decode_num_accepted_tokens_total{{{m.format(e)}}} {accepted / 2}\n" for e in (0, 1))


def test_a_traffic_line_each_window_from_the_counters_the_liveness_probe_reads(server):
    """The first liveness probe opens a window; one traffic_log_s later the next probe closes it with the counters'
    difference (since the window, not since start-up) and opens the next; traffic_log_s 0 says nothing."""
    url, state = server
    clock = [0.0]
    inbox: queue.Queue = queue.Queue()
    p = Prober(url, load_config(overrides=dict(health_timeout_s=2, traffic_log_s=600)), inbox, "m",
               clock=lambda: clock[0], api_key=KEY)
    state["metrics"] = _metrics(1000, 800, 100, 10, 10, 9, finished=4)
    assert p._liveness().ok and inbox.empty()
    clock[0], state["metrics"] = 300.0, _metrics(5000, 4000, 3000, 50, 50, 40, finished=8)
    assert p._liveness().ok and inbox.empty()  # inside the window
    clock[0], state["metrics"] = 660.0, _metrics(9000, 8800, 6100, 110, 110, 100, finished=16)
    assert p._liveness().ok
    t = inbox.get_nowait()
    assert isinstance(t, Traffic) and t.seconds == 660.0 and inbox.empty()
    assert (t.delta.tokens, t.delta.cache.queries, t.delta.cache.hits, t.delta.requests) == (8000, 8000, 6000, 12)
    # the window's two probes (the liveness completions after its first read and inside it) are counted apart
    assert t.probes == 2 and t.fields()["requests"] == 10
    assert t.message() == ("traffic: 10 requests (+2 probes), 8,000 tokens in 11.0 min; prefix cache 75.0% of 8,000 "
                           "prompt tokens hit; drafts 91.0% accepted, mean accepted length 1.91")
    assert t.fields()["prefix_cache"]["hit_rate"] == 0.75 and t.fields()["spec_decode"]["num_drafts"] == 100
    clock[0], state["metrics"] = 1200.0, _metrics(9500, 9300, 6100, 110, 110, 100, finished=20)
    assert p._liveness().ok and inbox.empty()  # the next window began at 660 s
    clock[0] = 1300.0
    assert p._liveness().ok and inbox.get_nowait().seconds == 640.0
    quiet = Prober(url, load_config(overrides=dict(health_timeout_s=2, traffic_log_s=0)), inbox, "m",
                   clock=lambda: clock[0], api_key=KEY)
    for clock[0] in (0.0, 1e6):
        assert quiet._liveness().ok
    assert inbox.empty()


def test_a_traffic_line_names_only_what_the_server_exports():
    """No prefix-cache or spec-decode counters (caching off, no drafter): tokens only; no queries: no rate."""
    from ling_common.metrics import counters

    bare = counters('vllm:prompt_tokens_total{model_name="m"} 120\n')
    assert bare.requests is None and Traffic(60.0, 60.0, bare, 4).message() == "traffic: 120 tokens in 1.0 min"
    idle = counters(_metrics(0, 0, 0, 0, 0, 0))
    assert Traffic(60.0, 60.0, idle, 4).message() == ("traffic: 0 requests (+4 probes), 0 tokens in 1.0 min; prefix "
                                                      "cache - of 0 prompt tokens hit; drafts - accepted")


def test_a_window_below_the_break_even_warns_with_the_numbers_and_one_too_thin_to_judge_does_not():
    """Traffic.below_break_even: the window's mean accepted length (1 + accepted / drafts) against the length at
    which the served speculation and plain steps decode equally fast; judged from BREAK_EVEN_MIN_DRAFTS verify
    steps on."""
    from ling_common.metrics import counters

    def window(drafts: int, accepted: int) -> Traffic:
        return Traffic(600.0, 600.0, counters(_metrics(1000, 0, 0, drafts, drafts, accepted)), 40)

    slow = window(BREAK_EVEN_MIN_DRAFTS, BREAK_EVEN_MIN_DRAFTS // 4)  # 1.25 tokens a verify step
    warning = slow.below_break_even(1.33)
    assert warning.startswith(f"speculation below its break-even: {BREAK_EVEN_MIN_DRAFTS} verify steps in 10.0 min "
                              "yielded 1.25 tokens each, and plain decode matches the served speculation at 1.33")
    assert "SPEC=mtp" in warning and "SPEC=off" in warning
    assert slow.below_break_even(1.25) is None and slow.below_break_even(None) is None  # at it: no loss
    assert window(BREAK_EVEN_MIN_DRAFTS - 1, 0).below_break_even(1.33) is None  # too few to say
    assert Traffic(60.0, 60.0, counters('vllm:prompt_tokens_total{model_name="m"} 120\n')).below_break_even(
        1.33) is None  # no speculation served


def test_the_first_traffic_window_opens_once_the_server_has_answered(server):
    """Not at the first liveness probe, one probe interval later: what an agent sends in between is counted."""
    import time

    url, state = server
    state["metrics"] = _metrics(100, 80, 0, 0, 0, 0, finished=1)
    p = Prober(url, load_config(overrides=dict(health_timeout_s=2, traffic_log_s=600, probe_interval_s=3600)),
               queue.Queue(), "m", api_key=KEY)
    p.start()
    try:
        deadline = time.monotonic() + 10
        while p._window is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p._window is not None and p._window[1].tokens == 100 and p._window[2] == 1  # after the first probe
    finally:
        p.stop()
        p.join(5)
