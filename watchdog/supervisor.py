"""The supervisor loop: launch, watch (phases + memory guard), kill cleanly, wait for the memory to
come back, relaunch with backoff, and stop with one clear final line and exit code.

How a launch ended is judged by what the server said and by who asked it to stop, not by its exit code:
vLLM's API server exits 0 after EngineDeadError (its engine core or a worker died), which is a crash;
only a server that vLLM's own signal handler stopped, with no fatal line, was stopped on purpose
(docs/ops-walls.md, "A dead engine exits 0").
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from ling_watchdog import memory
from ling_watchdog.check import AfterServing, expand
from ling_watchdog.child import Child, Line, Output
from ling_watchdog.config import Config
from ling_watchdog.events import EventLog
from ling_watchdog.headlink import HeadLink, LinkResult
from ling_watchdog.memory import gib
from ling_watchdog.phases import Fault, Monitor, Phase
from ling_watchdog.policy import RelaunchPolicy
from ling_watchdog.probes import Prober, ProbeResult, Traffic
from ling_watchdog.procs import CpuSampler
from ling_common.vllm_log import parse

TICK_S = 0.25
EXIT_LINES_S = 1.0  # after the server exits, how long its last lines may take to arrive


class ExitCode(IntEnum):
    """1 is left to Python (an uncaught error in the watchdog itself: worth a restart)."""
    OK = 0              # stopped on purpose: a signal to the server (not from us), or preflight only
    PREFLIGHT = 2       # a safety rule refused the serve command (also the recipe's own setting checks)
    GAVE_UP = 3         # relaunch or burst limit reached
    MEMORY_GUARD = 4    # MemAvailable fell under the floor: stopped before the box wedged
    FATAL = 5           # vLLM printed an error that a relaunch would repeat (bad flag, model, port, memory)
    MEMORY_HELD = 6     # memory not released after a kill: relaunching would wedge the driver
    USAGE = 7           # the watchdog's own settings are invalid, or the serve command cannot be started


# What a restart by systemd cannot fix: the unit's RestartPreventExitStatus (serve/vllm-ling.service).
NO_RESTART = (ExitCode.PREFLIGHT, ExitCode.FATAL, ExitCode.USAGE)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one launch ended: a fault to relaunch after, or a final exit code."""
    fault: Fault | None = None
    code: int | None = None
    message: str = ""


class Supervisor:
    def __init__(self, cmd: list[str], cfg: Config, log: EventLog, url: str, model: str | None = None,
                 env: Mapping[str, str] | None = None, api_key: str | None = None, shown: list[str] | None = None,
                 run: str | None = None, head: tuple[str, int] | None = None):
        """shown: the command as logged (secrets masked); api_key: what probes and the check present; head: a
        headless worker node's --master-addr and --master-port, judged by its link to them (headlink.py)."""
        self.cmd, self.cfg, self.log, self.url, self.model, self.env = cmd, cfg, log, url, model, env
        self.head = head
        self.api_key, self.shown = api_key, shown or cmd
        self.run_id = run or uuid.uuid4().hex[:8]
        self.policy = RelaunchPolicy(cfg)
        self._clock = time.monotonic
        self._halt = threading.Event()
        self._signal: int | None = None
        self.launches = 0

    def request_stop(self, signum: int, _frame=None) -> None:
        """Signal handler: the loop stops the child cleanly and exits 128 + signum of the first signal.
        A second signal can run this handler again inside the first one's `_halt.set()`, which holds the Event's
        lock: it must return before reaching set() (a nested set() waits on that lock forever), so `_signal` is
        written first and a later signal only finds it set."""
        if self._signal is not None:
            return
        self._signal = signum
        self._halt.set()

    # the whole run ------------------------------------------------------------------------------
    def run(self) -> int:
        start_avail, total = memory.available(), memory.total()
        self.guard_floor = memory.guard_floor(self.cfg, start_avail, total)
        self.release_floor = memory.release_floor(self.cfg, start_avail)
        self.log.emit("memory", f"MemAvailable {gib(start_avail)} of {gib(total)}; guard floor "
                      f"{gib(self.guard_floor)}, relaunch waits for {gib(self.release_floor)}",
                      available=start_avail, total=total, guard_floor=self.guard_floor,
                      release_floor=self.release_floor)
        while True:
            out = self._run_once()
            if out.code is not None:
                return self._final(out.code, out.message)
            decision = self.policy.after_failure(self._clock())
            if not decision.relaunch:
                return self._final(ExitCode.GAVE_UP, f"giving up after {self.policy.total} relaunch(es): "
                                   f"{decision.reason}; last fault: {out.fault.message}")
            code = self._wait_for_memory()
            if code is not None:
                return self._final(code, "stopped while waiting for memory" if code != ExitCode.MEMORY_HELD
                                   else f"memory not released {self.cfg.release_timeout_s:g}s after the "
                                   f"kill (MemAvailable under {gib(self.release_floor)}): not relaunching "
                                   f"over it; check for leftover GPU processes")
            self.log.emit("relaunch", f"relaunch {self.policy.in_a_row}/{self.cfg.max_relaunches} in "
                          f"{decision.delay_s:.1f}s after {out.fault.cause}", n=self.policy.total,
                          in_a_row=self.policy.in_a_row, left=self.cfg.max_relaunches - self.policy.in_a_row,
                          backoff_s=decision.delay_s, cause=out.fault.cause)
            if self._halt.wait(decision.delay_s):
                return self._final(self._signal_code(), "stopped by signal during backoff")

    def _signal_code(self) -> int:
        return 128 + (self._signal or signal.SIGTERM)

    def _final(self, code: int, message: str) -> int:
        level = "info" if code in (ExitCode.OK, self._signal_code()) else "error"
        self.log.emit("final", f"exit {int(code)}: {message}", level=level, code=int(code),
                      launches=self.launches, relaunches=self.policy.total)
        return int(code)

    def _wait_for_memory(self) -> int | None:
        ok, now = memory.wait_for(self.release_floor, self.cfg.release_timeout_s, self._halt)
        self.log.emit("memory", f"MemAvailable {gib(now)} after the kill (relaunch needs "
                      f"{gib(self.release_floor)})", available=now, floor=self.release_floor, released=ok)
        if self._halt.is_set():
            return self._signal_code()
        return None if ok else ExitCode.MEMORY_HELD

    # one launch ---------------------------------------------------------------------------------
    def _run_once(self) -> Outcome:
        self.launches += 1
        inbox: queue.Queue = queue.Queue()
        try:
            child = Child(self.cmd, inbox, self.log.output, env=self.env, clock=self._clock)
        except OSError as e:
            return Outcome(code=ExitCode.USAGE, message=f"cannot start {self.cmd[0]!r}: {e.strerror} (check the "
                           f"serve command, VLLM_CMD or PATH)")
        launch = f"{self.run_id}-{self.launches}"
        # The line readers of this launch's serve.log start from (events.launch_mark), before its output.
        self.log.emit("launch", f"launch {launch}: pid {child.pid} (own process group): {' '.join(self.shown)}",
                      n=self.launches, pid=child.pid, launch=launch)
        child.read()
        return self._watch(child, Monitor(self.cfg, self._clock(), self.log.emit, worker=self.head is not None),
                           inbox, launch)

    def _after_serving(self, child: Child, launch: str) -> AfterServing:
        """Start `after_serving` for this launch (a thread: supervision goes on)."""
        values = dict(url=self.url, log=str(Path(self.cfg.log_dir) / "serve.log"), launch=launch, pid=str(child.pid))
        env = dict(os.environ if self.env is None else self.env)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        check = AfterServing(expand(self.cfg.after_serving, values, self.shown), env, self.log,
                             self.cfg.after_serving_timeout_s)
        check.start()
        if check.pid is not None:
            child.foreign.add(check.pid)  # beside the server, not of it: its kills leave the check alone
        return check

    def _watch(self, child: Child, monitor: Monitor, inbox: queue.Queue, launch: str = "") -> Outcome:
        sampler, prober, stable, check = CpuSampler(), None, False, None
        next_memory = next_log = self._clock()
        if self.head is not None:  # a worker node: its link to the head instead of HTTP probes
            prober = HeadLink(child.pid, *self.head, self.cfg, inbox, clock=self._clock)
            prober.start()
        try:
            while True:
                self._drain(inbox, monitor, TICK_S)
                now = self._clock()
                if self._halt.is_set():
                    self._kill(child, f"signal {signal.Signals(self._signal).name}")
                    return Outcome(code=self._signal_code(), message="stopped by signal; server stopped")
                if child.exited():
                    return self._exited(child, monitor, inbox)
                if monitor.phase is Phase.LOADING:
                    monitor.cpu(sampler.busiest(child.pid), now)
                    child.note_tree(sampler.pids)
                if prober is None and monitor.http_up:
                    prober = Prober(self.url, self.cfg, inbox, self.model, clock=self._clock, api_key=self.api_key)
                    prober.start()
                if check is None and self.cfg.after_serving and monitor.phase is Phase.SERVING and not self.head:
                    check = self._after_serving(child, launch)
                if not stable and monitor.serving_for(now) >= self.cfg.stable_after_s:
                    stable = True
                    self.policy.stable()
                    self.log.emit("stable", f"serving for {self.cfg.stable_after_s:g}s: relaunch count reset")
                if now >= next_memory:
                    next_memory, log_reading = now + self.cfg.memory_poll_s, now >= next_log
                    if log_reading:
                        next_log = now + self.cfg.memory_log_s
                    if out := self._guard(child, monitor, log_reading):
                        return out
                fault = monitor.check(now)
                if fault:
                    self.log.emit(fault.event, f"{fault.event} ({fault.cause}) during {monitor.phase.value}: "
                                  f"{fault.message}", level="error", cause=fault.cause,
                                  phase=monitor.phase.value, held_s=round(fault.held_s, 2), **fault.data)
                    self._kill(child, fault.cause)
                    return Outcome(fault=fault)
        finally:
            if prober is not None:
                prober.stop()
                prober.join(timeout=self.cfg.health_timeout_s + 1)  # a HeadLink returns at once
            if check is not None:
                check.stop()

    def _drain(self, inbox: queue.Queue, monitor: Monitor, timeout: float, lines_only: bool = False) -> None:
        """Feed what arrived to the monitor. lines_only: after the server exited, probes of a server that
        is gone say nothing new."""
        try:
            item = inbox.get(timeout=timeout)
            while True:
                if isinstance(item, Line):
                    monitor.output(item.t)
                    if ev := parse(item.text):
                        monitor.line(ev, item.t)
                elif isinstance(item, Output):
                    monitor.output(item.t)
                elif isinstance(item, ProbeResult) and not lines_only:
                    monitor.probe(item)
                elif isinstance(item, LinkResult) and not lines_only:
                    monitor.link(item)
                elif isinstance(item, Traffic) and not lines_only:
                    self.log.emit("traffic", item.message(), **item.fields())
                    if warning := item.below_break_even(self.cfg.spec_break_even):
                        self.log.emit("spec_break_even", warning, level="warning",
                                      break_even=self.cfg.spec_break_even,
                                      mean_accepted_length=item.delta.spec.mean_acceptance_length)
                item = inbox.get_nowait()
        except queue.Empty:
            return

    def _guard(self, child: Child, monitor: Monitor, log_reading: bool) -> Outcome | None:
        avail = memory.available()
        if avail >= self.guard_floor:
            if log_reading:
                self.log.emit("memory", f"MemAvailable {gib(avail)} (guard floor {gib(self.guard_floor)})",
                              available=avail, floor=self.guard_floor, phase=monitor.phase.value)
            return None
        message = (f"MemAvailable {gib(avail)} fell under the floor {gib(self.guard_floor)} during "
                   f"{monitor.phase.value}: stopping the server before the box wedges (W4). Lower "
                   f"--gpu-memory-utilization or --max-model-len, or size the KV cache with "
                   f"--kv-cache-memory-bytes")
        self.log.emit("memory_guard", message, level="error", cause="memory_floor", available=avail,
                      floor=self.guard_floor, phase=monitor.phase.value)
        self._kill(child, "memory_guard")
        return Outcome(code=ExitCode.MEMORY_GUARD, message=message)

    def _kill(self, child: Child, why: str) -> None:
        r = child.stop(self.cfg.kill_grace_s)
        how = {"none": "had already exited", "SIGTERM": "stopped by SIGTERM to its group",
               "SIGKILL": f"did not stop within {self.cfg.kill_grace_s:g}s of SIGTERM: SIGKILLed"}[r.signal]
        self.log.emit("kill", f"pid {child.pid} ({why}) {how}; rc {r.rc}; {r.seconds:.1f}s; "
                      f"{r.survivors} process(es) left", level="info" if r.survivors == 0 else "error",
                      pid=child.pid, signal=r.signal, rc=r.rc, seconds=round(r.seconds, 2),
                      survivors=r.survivors, why=why)

    def _exited(self, child: Child, monitor: Monitor, inbox: queue.Queue) -> Outcome:
        """Judged when the exit is seen (the last lines hold the reason), then the group is reaped."""
        rc = child.proc.returncode
        child.flush(EXIT_LINES_S)
        self._drain(inbox, monitor, 0.0, lines_only=True)
        outcome = self._judge_exit(rc, monitor)
        self._kill(child, f"exited with {_rc(rc)}")  # the leader is gone; its group may not be
        return outcome

    def _judge_exit(self, rc: int, monitor: Monitor) -> Outcome:
        phase, fatal = monitor.phase.value, monitor.fatal
        if fatal is not None and not fatal.retry:
            return Outcome(code=ExitCode.FATAL, message=f"the serve command failed during {phase} with an "
                           f"error a relaunch would repeat: {fatal.text}")
        if rc == 0 and fatal is None and monitor.stop_requested:
            return Outcome(code=ExitCode.OK, message=f"the serve command was stopped by a signal (not from the "
                           f"watchdog) during {phase} and exited with rc 0: stopped on purpose, not relaunching")
        reason = "".join([f"; first error: {monitor.root_cause}" if monitor.root_cause else "",
                          f"; vLLM said: {fatal.text}" if fatal else "",
                          "" if rc != 0 or fatal else "; nobody asked it to stop and it gave no reason"])
        dead = " (vLLM exits 0 once its engine is dead: a crash whatever the exit code)" if rc == 0 and fatal else ""
        fault = Fault("crash", f"exit_{phase}", f"the serve command exited with {_rc(rc)} during {phase}{dead}"
                      f"{reason}", 0.0, dict(rc=rc))
        self.log.emit("crash", f"crash during {phase}: {fault.message}", level="error", cause=fault.cause,
                      phase=phase, rc=rc, held_s=0.0)
        return Outcome(fault=fault)


def _rc(rc: int) -> str:
    """An exit status as words: `rc 1`, or `rc -9 (SIGKILL)` for a signal."""
    if rc < 0:
        try:
            return f"rc {rc} ({signal.Signals(-rc).name})"
        except ValueError:
            pass
    return f"rc {rc}"
