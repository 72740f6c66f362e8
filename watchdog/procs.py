"""The serve command's process tree: who is burning CPU, and killing all of it.

vLLM loads weights in the EngineCore child process, so the "one CPU at 100%" of a shard freeze
(W7, docs/ops-walls.md) belongs to a child of the command, not to the command itself: the whole
tree is sampled.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


# Looked up once, here: die_with_parent runs between fork and exec, where a dlopen/dlsym could
# deadlock on a loader lock that another thread held at fork time.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None
_SIGTERM = int(signal.SIGTERM)


def _prctl(option: int, arg: int) -> None:
    if _PRCTL is not None:
        _PRCTL(option, arg, 0, 0, 0)


_subreaper = False


def become_subreaper() -> None:
    """Orphans of the serve tree re-parent to us instead of init, so none escapes the sweep, not
    even one that left the session with setsid(). Only for a process that runs nothing else."""
    global _subreaper
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _subreaper = True


def ours(p: psutil.Process, pids: set[int], session: int, foreign: frozenset[int] = frozenset()) -> bool:
    """Whether a descendant of ours belongs to the serve tree. `foreign`: processes the watchdog runs beside
    the server (the after-serving check), which are not the server's, nor are their children."""
    if foreign and (p.pid in foreign or any(a.pid in foreign for a in p.parents())):
        return False
    return _subreaper or p.pid in pids or os.getsid(p.pid) == session


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the watchdog dies, even by SIGKILL. Several, in fact: Linux sends it
    each time the thread the child belongs to exits and hands it to the next live thread of ours, so a server's
    handler must cope with a second one arriving while it runs the first."""
    _prctl(PR_SET_PDEATHSIG, _SIGTERM)


def tree(pid: int) -> list[psutil.Process]:
    """pid and all its descendants that are alive now."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@dataclass(slots=True)
class Busiest:
    pid: int
    name: str
    cpu_percent: float  # of one CPU, by the hungriest thread


def _thread_ns(pid: int) -> dict[int, int] | None:
    """Per thread: nanoseconds on a CPU + waiting for one (/proc/<pid>/task/<tid>/schedstat)."""
    out = {}
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
            out[int(tid)] = int(run) + int(wait)
    except (OSError, ValueError):
        return None
    return out


class CpuSampler:
    """How much of one CPU the hungriest thread of the tree wanted since the previous sample.

    "Wanted" = time on a CPU + time runnable but waiting (schedstat). On an idle box that is the CPU
    use; on a loaded box a spinning thread still reads ~100% because it is never asleep, where its
    share of the CPU (psutil's cpu_percent) would fall with the load. Without schedstat: psutil.
    """

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._last: dict[tuple[int, int], tuple[float, int]] = {}
        self._procs: dict[int, psutil.Process] = {}

    @property
    def pids(self) -> set[int]:
        """The tree as of the last sample."""
        return set(self._procs)

    def busiest(self, pid: int) -> Busiest | None:
        now, best = self._clock(), None
        self._procs = {p.pid: self._procs.get(p.pid, p) for p in tree(pid)}
        sampled: dict[tuple[int, int], tuple[float, int]] = {}
        for p in self._procs.values():
            try:
                pct = self._thread_percent(p, now, sampled)
                if best is None or pct > best.cpu_percent:
                    best = Busiest(p.pid, p.name(), pct)
            except psutil.NoSuchProcess:
                continue
        self._last = sampled
        return best

    def _thread_percent(self, p: psutil.Process, now: float, sampled: dict) -> float:
        threads = _thread_ns(p.pid)
        if threads is None:
            return p.cpu_percent(None)  # 0.0 on the first call for a process
        pct = 0.0
        for tid, ns in threads.items():
            sampled[(p.pid, tid)] = (now, ns)
            if (prev := self._last.get((p.pid, tid))) and now > prev[0]:
                pct = max(pct, min(100.0, (ns - prev[1]) / 1e7 / (now - prev[0])))
        return pct


def sweep(pids: set[int], session: int, foreign: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """SIGKILL every process we saw in the tree or that still belongs to the child's session,
    among our descendants (orphans come to us as the subreaper). Returns those still alive."""
    me = psutil.Process()
    doomed = []
    for p in me.children(recursive=True):
        try:
            if ours(p, pids, session, foreign):
                p.kill()
                doomed.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    _, alive = psutil.wait_procs(doomed, timeout=2)
    return alive
