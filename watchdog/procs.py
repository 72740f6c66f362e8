"""The serve command's process tree: who is burning CPU, and killing all of it.

vLLM loads weights in the EngineCore child process, so the "one CPU at 100%" of a shard freeze
(W7) belongs to a child of the command, not to the command itself: the whole tree is sampled.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
from dataclasses import dataclass

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, arg: int) -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


_subreaper = False


def become_subreaper() -> None:
    """Orphans of the serve tree re-parent to us instead of init, so none escapes the sweep, not
    even one that left the session with setsid(). Only for a process that runs nothing else."""
    global _subreaper
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _subreaper = True


def ours(p: psutil.Process, pids: set[int], session: int) -> bool:
    """Whether a descendant of ours belongs to the serve tree."""
    return _subreaper or p.pid in pids or os.getsid(p.pid) == session


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM if the watchdog dies, even by SIGKILL."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


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
    cpu_percent: float  # of one CPU


class CpuSampler:
    """cpu_percent of each process in the tree since the previous call (psutil keeps the last
    reading per Process object, so the objects are cached by pid)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    @property
    def pids(self) -> set[int]:
        """The tree as of the last sample."""
        return set(self._procs)

    def busiest(self, pid: int) -> Busiest | None:
        live = {p.pid: self._procs.get(p.pid, p) for p in tree(pid)}
        self._procs = live
        best = None
        for p in live.values():
            try:
                pct = p.cpu_percent(None)  # 0.0 on the first call for a new process
                if best is None or pct > best.cpu_percent:
                    best = Busiest(p.pid, p.name(), pct)
            except psutil.NoSuchProcess:
                continue
        return best


def sweep(pids: set[int], session: int) -> list[psutil.Process]:
    """SIGKILL every process we saw in the tree or that still belongs to the child's session,
    among our descendants (orphans come to us as the subreaper). Returns those still alive."""
    me = psutil.Process()
    doomed = []
    for p in me.children(recursive=True):
        try:
            if ours(p, pids, session):
                p.kill()
                doomed.append(p)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    _, alive = psutil.wait_procs(doomed, timeout=2)
    return alive
