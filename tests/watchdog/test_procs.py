"""CPU sampling of a process tree: a spinning grandchild reads busy, a sleeping one does not."""
import subprocess
import sys
import time

import pytest
from ling_watchdog.procs import CpuSampler, tree

SPAWN = "import subprocess, sys; subprocess.run([sys.executable, '-c', {!r}])"


@pytest.fixture
def spawn(tmp_path):
    """Launcher -> grandchild running `grandchild_code`, returned once the grandchild has started up and reached its
    code (it touches a file first): an interpreter still starting on a loaded box would read busy for a second."""
    procs = []

    def start(grandchild_code):
        ready = tmp_path / f"ready{len(procs)}"
        code = f"open({str(ready)!r}, 'w').close()\n{grandchild_code}"
        p = subprocess.Popen([sys.executable, "-c", SPAWN.format(code)])
        procs.append(p)
        deadline = time.time() + 30
        while not (ready.exists() and len(tree(p.pid)) >= 2) and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the grandchild did not start within 30 s"
        return p

    yield start
    for p in procs:
        for q in tree(p.pid):
            q.kill()
        p.wait()


def sample(pid, n=6, dt=0.25):
    s, out = CpuSampler(), []
    for _ in range(n):
        out.append(s.busiest(pid))
        time.sleep(dt)
    return out[2:]  # the first samples only set the baseline


def test_a_spinning_grandchild_reads_near_one_full_cpu_even_on_a_loaded_box(spawn):
    p = spawn("while True: pass")
    busy = sample(p.pid)
    assert all(b.cpu_percent >= 80 for b in busy)
    assert {b.pid for b in busy} == {tree(p.pid)[1].pid}  # the grandchild, not the launcher


def test_a_sleeping_tree_reads_idle(spawn):
    p = spawn("import time; time.sleep(60)")
    assert all(b.cpu_percent < 20 for b in sample(p.pid))
