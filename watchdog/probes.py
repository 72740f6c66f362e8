"""HTTP probes of a running vLLM server, posted from a thread so the supervisor loop never blocks.

Readiness is `GET /health` with a short timeout: the port binds before the engine is up, so a
timeout means "not ready", not "dead". /health says 200 while the engine is wedged, so liveness is a
real 1-token completion; when it times out, /metrics token counters that moved in the meantime mark
the server as busy (e.g. both lanes of W5 decoding long answers), not wedged. A 503 from /health is
vLLM's own word that its engine died: that is a crash at once, not one failed probe of K.

Probes carry the server's credentials (`--api-key` / VLLM_API_KEY: vLLM guards /v1/*). A refusal (401/403)
is an answer, not a wedge: the server is up and the watchdog lacks the key, which a relaunch cannot fix;
it is reported as such and never counted towards the wedge threshold (docs/ops-walls.md).

Every traffic_log_s while serving, the /metrics counters the liveness probe reads anyway also give a traffic line:
requests finished (the probes' own counted apart), tokens processed, the prefix cache's hit rate and the drafts'
acceptance over that window (what an agent's turns and the speculation are getting now, not at start-up; the
probes' few tokens are in the token and cache counts).
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import requests
from ling_watchdog.config import Config
from ling_common.metrics import Counters, counters

READY_POLL_S = 0.5
REFUSED = (401, 403)
DEAD = 503  # vLLM 0.32-0.34 answer /health with 503 only on EngineDeadError (docs/ops-walls.md)
# Verify steps a traffic window needs before its mean accepted length is held against the break-even: fewer are a
# few requests' worth, whose acceptance says more about those prompts than about the deployment's traffic
BREAK_EVEN_MIN_DRAFTS = 200


@dataclass(frozen=True, slots=True)
class ProbeResult:
    kind: str  # "ready": /health poll before the first 200 | "first": first request | "live": serving
    ok: bool
    detail: str
    t: float
    elapsed: float = 0.0
    busy: bool = False
    refused: bool = False  # the server answered 401/403: up, but the probe lacks its credentials
    dead: bool = False  # /health 503: vLLM says its engine is dead (EngineDeadError)


@dataclass(frozen=True, slots=True)
class Traffic:
    """What the server did over one window of traffic_log_s (a difference of two /metrics reads)."""

    t: float
    seconds: float
    delta: Counters
    probes: int = 0  # the watchdog's own completions in the window

    @property
    def requests(self) -> int | None:
        """Requests finished in the window besides the probes (None where the server does not count them)."""
        return None if self.delta.requests is None else max(round(self.delta.requests) - self.probes, 0)

    def message(self) -> str:
        d, served = self.delta, self.requests
        asked = "" if served is None else f"{served:,} requests (+{self.probes} probes), "
        parts = [f"{asked}{d.tokens:,.0f} tokens in {self.seconds / 60:.1f} min"]
        if d.cache is not None:
            rate = d.cache.hit_rate
            parts.append(f"prefix cache {'-' if rate is None else f'{rate:.1%}'} of {d.cache.queries:,} prompt "
                         f"tokens hit")
        if d.spec is not None:
            acc, length = d.spec.acceptance_rate, d.spec.mean_acceptance_length
            parts.append(f"drafts {'-' if acc is None else f'{acc:.1%}'} accepted" +
                         ("" if length is None else f", mean accepted length {length:.2f}"))
        return "traffic: " + "; ".join(parts)

    def below_break_even(self, break_even: float | None) -> str | None:
        """A warning when this window's drafts yielded fewer tokens a verify step than `break_even`, the mean accepted
        length at which the served speculation and plain steps decode equally fast (Config.spec_break_even): below
        it the drafts cost more than they yield. None when not asked, without speculation or with too few drafts."""
        spec = self.delta.spec
        drafts = None if spec is None else spec.drafts
        if break_even is None or not drafts or drafts < BREAK_EVEN_MIN_DRAFTS:
            return None
        length = spec.mean_acceptance_length
        if length >= break_even:
            return None
        return (f"speculation below its break-even: {drafts:,} verify steps in {self.seconds / 60:.1f} min yielded "
                f"{length:.2f} tokens each, and plain decode matches the served speculation at {break_even:.2f} "
                f"(its round reads {break_even:.2f}x a plain step's bytes, projected: ling_bench.projection "
                f"--break-even); this traffic decodes faster without it. If it persists, serve with less: SPEC=mtp "
                f"in place of SPEC=dspark, a smaller DSPARK_K or MTP_K, or SPEC=off (docs/dspark.md §Recipe)")

    def fields(self) -> dict:
        d = self.delta
        return {"seconds": round(self.seconds, 1), "probes": self.probes, "requests": self.requests,
                "tokens": round(d.tokens),
                "prefix_cache": d.cache.to_json() if d.cache else None,
                "spec_decode": d.spec.to_json() if d.spec else None}


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What vLLM's AuthenticationMiddleware wants: `Authorization: Bearer <key>`."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Prober(threading.Thread):
    """ready polls until /health is 200, then the first request (JIT grace), then a liveness probe
    every probe_interval_s, each result put on `inbox`."""

    def __init__(self, url: str, cfg: Config, inbox: queue.Queue, model: str | None = None,
                 clock: Callable[[], float] = time.monotonic, api_key: str | None = None):
        super().__init__(name="ling-watchdog-prober", daemon=True)
        self.url, self.cfg, self.inbox, self.model = url.rstrip("/"), cfg, inbox, model
        self._clock = clock
        self._halt = threading.Event()
        self._http = requests.Session()
        self._http.headers.update(auth_headers(api_key))
        self._served: str | None = None
        self._tokens_seen: float | None = None
        self._window: tuple[float, Counters, int] | None = None  # the traffic window's start, counters, probes
        self._probes = 0  # 1-token completions sent

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                result = self._health("ready")
                self.inbox.put(result)
                if result.ok or self._halt.wait(READY_POLL_S):
                    break
            if not self._halt.is_set():
                self.inbox.put(self._complete("first", self.cfg.warmup_grace_s))
                self._traffic(self._counters())  # the first traffic window opens once the server has answered
            while not self._halt.wait(self.cfg.probe_interval_s):
                self.inbox.put(self._liveness())
        except Exception as e:  # a prober that dies silently would hide a wedge
            self.inbox.put(ProbeResult("live", False, f"prober crashed: {e!r}", self._clock()))
        finally:
            self._http.close()

    def _get(self, path: str, timeout: float) -> requests.Response:
        return self._http.get(self.url + path, timeout=timeout)

    def _health(self, kind: str) -> ProbeResult:
        t0 = self._clock()
        try:
            r = self._get("/health", self.cfg.health_timeout_s)
            ok, detail = r.status_code == 200, f"/health {r.status_code}"
        except requests.RequestException as e:
            ok, detail = False, f"/health: {type(e).__name__}"
            r = None
        dead = r is not None and r.status_code == DEAD
        if dead:
            detail += ": vLLM reports its engine dead (EngineDeadError)"
        return ProbeResult(kind, ok, detail, self._clock(), self._clock() - t0, dead=dead)

    def _model(self) -> str:
        """The served name from /v1/models, else the one the serve command gave."""
        if self._served is None:
            try:
                self._served = self._get("/v1/models", self.cfg.health_timeout_s).json()["data"][0]["id"]
            except (requests.RequestException, ValueError, KeyError, IndexError):
                if self.model is None:
                    raise
                return self.model
        return self._served

    def _complete(self, kind: str, timeout: float) -> ProbeResult:
        t0 = self._clock()
        self._probes += 1
        try:
            body = {"model": self._model(), "prompt": "ping", "max_tokens": 1, "temperature": 0}
            r = self._http.post(self.url + "/v1/completions", json=body, timeout=timeout)
            if r.status_code in REFUSED:
                return self._refused(kind, r, t0)
            ok = r.status_code == 200 and bool(r.json().get("choices"))
            detail = f"1-token completion {r.status_code}"
        except (requests.RequestException, ValueError, KeyError, IndexError) as e:
            ok, detail = False, f"1-token completion: {type(e).__name__}"
        elapsed = self._clock() - t0
        return ProbeResult(kind, ok, f"{detail} in {elapsed:.1f}s", self._clock(), elapsed)

    def _refused(self, kind: str, r: requests.Response, t0: float) -> ProbeResult:
        detail = (f"1-token completion refused with HTTP {r.status_code}: the server wants credentials the "
                  f"watchdog does not have (it presents --api-key / VLLM_API_KEY of the serve command)")
        return ProbeResult(kind, True, detail, self._clock(), self._clock() - t0, refused=True)

    def _counters(self) -> Counters | None:
        try:
            r = self._get("/metrics", self.cfg.health_timeout_s)
            return counters(r.text) if r.status_code == 200 else None
        except (requests.RequestException, ValueError):  # ValueError: prometheus_client's parser
            return None

    def _tokens(self) -> float | None:
        read = self._counters()
        return None if read is None else read.tokens

    def _traffic(self, now: Counters | None) -> None:
        """Put a Traffic on the inbox once traffic_log_s has passed since the window began (0: never)."""
        if now is None or not self.cfg.traffic_log_s:
            return
        t = self._clock()
        if self._window is not None and t - self._window[0] < self.cfg.traffic_log_s:
            return
        if self._window is not None:
            start, before, probes = self._window
            self.inbox.put(Traffic(t, t - start, now - before, self._probes - probes))
        self._window = (t, now, self._probes)

    def _liveness(self) -> ProbeResult:
        health = self._health("live")
        if not health.ok:
            return health
        read = self._counters()
        self._traffic(read)
        self._note_tokens(None if read is None else read.tokens)
        since, result = self._tokens_seen, self._complete("live", self.cfg.liveness_timeout_s)
        if result.ok:
            return result
        after = self._tokens()
        self._note_tokens(after)
        if after is not None and since is not None and after > since:
            return ProbeResult("live", True, f"{result.detail}, but the engine processed "
                               f"{after - since:.0f} tokens meanwhile: busy, not wedged",
                               result.t, result.elapsed, busy=True)
        return result

    def _note_tokens(self, tokens: float | None) -> None:
        """Keep the last good reading, so that one failed /metrics read does not blind the check."""
        if tokens is not None:
            self._tokens_seen = tokens
