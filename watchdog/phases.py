"""Phases of one launch and the rule of each: what counts as stuck, and when to say so.

loading  launch -> "Application startup complete."  Judged by shard progress: a freeze is no new
         shard for load_stall_s while one process sits at ~100% of a CPU (W7); plain silence is
         allowed longer (slow disks); the whole start-up is capped by load_timeout_s.
warmup   -> first 1-token completion answered.  The first request spends ~30 s in kernel JIT
         (W8): it gets warmup_grace_s and is never judged by the liveness timeout.
serving  /health answers 200 even when the engine is wedged, so liveness is decode progress:
         fail_threshold consecutive failed probes = wedged.
A headless worker node (multi-node TP) has no HTTP: it is loading until it holds a connection to the head
(then serving), waits for its head without a time limit, and fail_threshold checks without that connection
mean the head is gone (headlink.py).

The Monitor is pure bookkeeping over observations with explicit times; the supervisor feeds it.
The walls W7, W8 and the /health fact: docs/ops-walls.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ling_watchdog.config import Config
from ling_watchdog.headlink import LinkResult
from ling_watchdog.memory import GiB, gib
from ling_watchdog.probes import ProbeResult
from ling_watchdog.procs import Busiest
from ling_common.vllm_log import LogEvent


class Phase(str, Enum):
    LOADING = "loading"
    WARMUP = "warmup"
    SERVING = "serving"


@dataclass(frozen=True, slots=True)
class Fault:
    event: str  # "stall" | "wedge" | "crash"
    cause: str
    message: str
    held_s: float  # how long the faulty condition lasted before this verdict
    data: dict[str, Any] = field(default_factory=dict)


Emit = Callable[..., Any]


class Monitor:
    def __init__(self, cfg: Config, now: float, emit: Emit, worker: bool = False):
        """worker: a headless worker node, judged by its link to the head instead of by HTTP (headlink.py)."""
        self.cfg, self.emit, self.worker = cfg, emit, worker
        self.phase, self.phase_t, self.t0 = Phase.LOADING, now, now
        self.last_output = self.last_progress = now
        self.shard: tuple[int, int] | None = None
        self.busiest: Busiest | None = None
        self.busy_since: float | None = None
        self.ready_t: float | None = None
        self.failures, self.first_failure_t = 0, None
        self.last_probe = ""
        self.fatal: LogEvent | None = None
        self.root_cause: str | None = None  # the first exception line of this launch
        self.http_up = False  # "Starting vLLM server on" seen: time to poll /health
        self.stop_requested = False  # vLLM's signal handler ran: someone asked the server to stop
        self.refused = False  # a probe got 401/403: reported once
        self._edge_phases: set[Phase] = set()  # the phases whose first such retry was reported
        self._pending: Fault | None = None

    # observations -----------------------------------------------------------------------------
    def output(self, t: float) -> None:
        self.last_output = t

    def line(self, ev: LogEvent, t: float) -> None:
        if ev.kind == "shard":
            if self.shard is None or ev.shard != self.shard[0]:
                self.shard, self.last_progress = (ev.shard, ev.total), t
                self.emit("progress", f"shard {ev.shard}/{ev.total}", quiet=True, shard=ev.shard,
                          total=ev.total)
        elif ev.kind == "fatal":
            if ev.outranks(self.fatal):
                self.fatal = ev
            self.root_cause = self.root_cause or ev.exception
            self.emit("fatal_line", f"vLLM reported: {ev.text}", level="error", retry=ev.retry)
        elif ev.kind == "error":
            self.root_cause = self.root_cause or ev.text
        elif ev.kind == "alert":
            self.emit("alert", f"vLLM reported: {ev.text}", level="warning")
        elif ev.kind == "memory_edge":
            self._memory_edge(ev)
        elif ev.kind == "stop_requested":
            self.stop_requested = True
        else:
            self.last_progress = t
            self.emit("milestone", ev.text, quiet=True, milestone=ev.kind)
            self.http_up |= ev.kind in ("server_starting", "startup_complete")
            if ev.kind == "startup_complete" and self.phase is Phase.LOADING:
                self._enter(Phase.WARMUP, t, f"start-up took {t - self.t0:.1f}s; probing /health")

    def _memory_edge(self, ev: LogEvent) -> None:
        """The first time in each phase of this launch that the allocator hit the device's memory limit, as a
        warning: vLLM goes on when the retry finds memory, but on unified memory (a Spark) that limit is the whole
        box's, and one while serving means the reservation leaves too little."""
        if self.phase not in self._edge_phases:
            self._edge_phases.add(self.phase)
            self.emit("memory_edge", f"the device ran out of memory during {self.phase.value}: PyTorch's allocator "
                      f"asked {ev.asked / GiB:.2f} GiB with {ev.free / GiB:.2f} of {gib(ev.total)} free, "
                      f"freed its cache and retried (vLLM goes on if that found memory; reported once a phase). "
                      f"On a Spark the device's memory is the box's: if this comes while serving, leave more room "
                      f"(a lower UTIL or KV_CACHE_GIB, docs/ops-walls.md W4)", level="warning", asked=ev.asked,
                      free=ev.free, total=ev.total, phase=self.phase.value)

    def cpu(self, busiest: Busiest | None, t: float) -> None:
        self.busiest = busiest
        busy = busiest is not None and busiest.cpu_percent >= self.cfg.busy_cpu_percent
        self.busy_since = (t if self.busy_since is None else self.busy_since) if busy else None

    def probe(self, r: ProbeResult) -> None:
        self.last_probe = r.detail
        if r.dead:  # the API server exits 0 a few seconds later; no need to wait for it or for K probes
            self._pending = self._pending or Fault("crash", "engine_dead", f"{r.detail} during "
                                                   f"{self.phase.value}", 0.0)
            return
        if r.refused and not self.refused:
            self.refused = True
            self.emit("probe_refused", f"{r.detail}. The server is up; decode progress cannot be judged until "
                      f"the watchdog has its key: pass it as --api-key or VLLM_API_KEY in the serve command's "
                      f"environment", level="error")
        if r.kind == "ready" and r.ok and self.ready_t is None:
            if self.phase is Phase.LOADING:  # uvicorn's own line can be silenced (--uvicorn-log-level)
                self._enter(Phase.WARMUP, r.t, "/health 200 without an 'Application startup complete.' line")
            self.ready_t = r.t
            self.emit("ready", f"/health 200 after {r.t - self.phase_t:.1f}s; first request (JIT grace "
                      f"{self.cfg.warmup_grace_s:g}s)")
        elif r.kind == "first":
            if r.ok:
                self._enter(Phase.SERVING, r.t, f"first request answered: {r.detail}")
            else:
                self._pending = Fault("wedge", "first_request", f"first request failed: {r.detail} (JIT grace "
                                      f"{self.cfg.warmup_grace_s:g}s)", r.t - (self.ready_t or r.t))
        elif r.kind == "live":
            self._live(r)

    def link(self, r: LinkResult) -> None:
        """A worker node's link to the head. Before the first connection the worker waits for its head, which
        may itself be loading or relaunching: no fault. Once joined, fail_threshold checks in a row without
        the connection mean the head is gone, and a worker does not exit on its own when it is."""
        if r.up:
            if self.phase is Phase.LOADING:
                self._enter(Phase.SERVING, r.t, f"joined the engine: {r.detail}")
            elif self.failures:
                self.emit("probe_ok", f"head link back after {self.failures} failed check(s): {r.detail}")
            self.failures, self.first_failure_t = 0, None
            return
        if self.phase is Phase.LOADING:
            return
        self._failed(r.t, "head link check", r.detail, "head_lost", f"{self.cfg.fail_threshold} consecutive checks "
                     f"found no connection to the head ({r.detail}); a headless worker stays up when its head "
                     f"dies, and the head's next launch needs a fresh one")

    def _live(self, r: ProbeResult) -> None:
        if r.ok:
            if self.failures:
                self.emit("probe_ok", f"liveness recovered after {self.failures} failed probe(s): {r.detail}")
            elif r.busy:
                self.emit("probe_busy", r.detail, quiet=True)
            self.failures, self.first_failure_t = 0, None
            return
        self._failed(r.t, "liveness probe", r.detail, "liveness", f"{self.cfg.fail_threshold} consecutive liveness "
                     f"probes failed (last: {r.detail}); /health alone would not show this")

    def _failed(self, t: float, what: str, detail: str, cause: str, message: str) -> None:
        """One more failed check in a row (a liveness probe, a worker's head link): fail_threshold of them is a
        wedge, `cause`, said with `message`."""
        self.failures += 1
        if self.first_failure_t is None:
            self.first_failure_t = t
        k = self.cfg.fail_threshold
        self.emit("probe_fail", f"{what} failed ({self.failures}/{k}): {detail}", level="warning",
                  failures=self.failures)
        if self.failures >= k:
            self._pending = Fault("wedge", cause, message, t - self.first_failure_t, dict(failures=self.failures))

    def _enter(self, phase: Phase, t: float, why: str) -> None:
        self.emit("phase", f"phase {self.phase.value} -> {phase.value}: {why}", **{"from": self.phase.value},
                  to=phase.value)
        self.phase, self.phase_t = phase, t

    # verdict ----------------------------------------------------------------------------------
    def serving_for(self, t: float) -> float:
        return t - self.phase_t if self.phase is Phase.SERVING else 0.0

    def check(self, t: float) -> Fault | None:
        """The fault that holds at time t, if any."""
        if self._pending:
            return self._pending
        if self.phase is Phase.LOADING:
            return self._check_loading(t)
        if self.phase is Phase.WARMUP:
            return self._check_warmup(t)
        return None

    def _check_loading(self, t: float) -> Fault | None:
        cfg, stalled = self.cfg, t - self.last_progress
        if t - self.t0 >= cfg.load_timeout_s and not self.worker:  # a worker may wait long for its head
            return Fault("stall", "load_timeout", f"start-up not complete after {t - self.t0:.0f}s "
                         f"(load_timeout_s {cfg.load_timeout_s:g})", t - self.t0)
        mid_load = self.shard is not None and self.shard[0] < self.shard[1]
        busy_s = t - self.busy_since if self.busy_since is not None else 0.0
        if mid_load and stalled >= cfg.load_stall_s and busy_s >= cfg.cpu_busy_s:
            b = self.busiest
            return Fault("stall", "shard_freeze", f"no shard progress for {stalled:.1f}s at shard "
                         f"{self.shard[0]}/{self.shard[1]} while pid {b.pid} ({b.name}) sits at "
                         f"{b.cpu_percent:.0f}% of a CPU (W7 cold-start freeze)", stalled,
                         dict(shard=self.shard[0], total=self.shard[1], pid=b.pid, cpu_percent=b.cpu_percent))
        silent = t - self.last_output
        if silent >= cfg.load_silent_s and not self.worker:  # a worker waiting for its head prints nothing
            where = f" at shard {self.shard[0]}/{self.shard[1]}" if self.shard else ""
            return Fault("stall", "silent", f"no output for {silent:.1f}s while loading{where} "
                         f"(load_silent_s {cfg.load_silent_s:g})", silent)
        return None

    def _check_warmup(self, t: float) -> Fault | None:
        cfg = self.cfg
        if self.ready_t is None and t - self.phase_t >= cfg.ready_timeout_s:
            return Fault("wedge", "not_ready", f"/health not 200 {t - self.phase_t:.1f}s after start-up "
                         f"complete (last: {self.last_probe})", t - self.phase_t)
        limit = cfg.warmup_grace_s + cfg.health_timeout_s  # the probe's own timeout normally fires first
        if self.ready_t is not None and t - self.ready_t >= limit:
            return Fault("wedge", "first_request", f"first request unanswered after {t - self.ready_t:.1f}s "
                         f"(JIT grace {cfg.warmup_grace_s:g}s)", t - self.ready_t)
        return None
