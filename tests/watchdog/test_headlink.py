"""A worker node's link to its head, read from the kernel's TCP table (real sockets, a real child process)."""
import queue
import socket
import subprocess
import sys
import time

import pytest
from ling_watchdog.config import load_config
from ling_watchdog.headlink import UP, HeadLink, addresses, link_state

CLIENT = ("import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
          "print('connected', flush=True); time.sleep(60)")


def _until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (value := predicate()):
            return value
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def head():
    """A listening socket standing in for the head's torch.distributed store."""
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def test_the_link_is_established_while_the_head_holds_it_and_close_wait_once_the_head_is_gone(head):
    port = head.getsockname()[1]
    # a parent that only waits, the connection in its child: the link is read over the whole process tree
    child = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, "
                              f"'-c', {CLIENT!r}, '{port}'])"], stdout=subprocess.PIPE, text=True)
    try:
        conn, _ = head.accept()
        assert _until(lambda: UP in link_state(child.pid, "127.0.0.1", port))
        assert link_state(child.pid, "127.0.0.1", port + 1 if port < 65535 else port - 1) == []
        conn.close()
        head.close()  # the head's process died: the kernel closes its end
        states = _until(lambda: [s for s in link_state(child.pid, "127.0.0.1", port) if s != UP])
        assert states and UP not in link_state(child.pid, "127.0.0.1", port), states
    finally:
        child.kill()
        child.wait()


def test_the_thread_posts_each_check_with_what_it_saw():
    cfg, inbox = load_config(overrides=dict(probe_interval_s=0.05)), queue.Queue()
    seen = iter([["ESTABLISHED"], ["CLOSE_WAIT"], []])
    link = HeadLink(1, "h", 29501, cfg, inbox, clock=lambda: 7.0, state=lambda *a: next(seen, []))
    link.start()
    results = [inbox.get(timeout=5) for _ in range(3)]
    link.stop()
    link.join(timeout=5)
    assert [r.up for r in results] == [True, False, False]
    assert [r.detail for r in results] == ["connected to the head at h:29501",
                                           "connection to the head at h:29501 is CLOSE_WAIT",
                                           "no connection to the head at h:29501"]


def test_an_ipv4_head_also_matches_its_ipv6_mapped_form():
    """The kernel reported the worker's store connection as ::ffff:192.0.2.2 on a dual-stack socket."""
    assert {"127.0.0.1", "::ffff:127.0.0.1"} <= addresses("127.0.0.1")
    assert addresses("::1") >= {"::1"}
