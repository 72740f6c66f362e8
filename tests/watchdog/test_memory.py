"""Memory floors and the wait for released memory, with a fake reader and clock."""
import threading

from ling_watchdog.config import load_config
from ling_watchdog.memory import GiB, MiB, guard_floor, release_floor, wait_for


def test_guard_floor_is_the_highest_of_fraction_absolute_and_relative():
    total, start = 120 * GiB, 110 * GiB
    assert guard_floor(load_config(), start, total) == int(0.10 * total)
    assert guard_floor(load_config(overrides={"guard_floor_gib": 20}), start, total) == 20 * GiB
    cfg = load_config(overrides={"guard_floor_below_start_mb": 300})
    assert guard_floor(cfg, start, total) == start - 300 * MiB


def test_release_floor_follows_the_start_reading_unless_an_absolute_floor_is_higher():
    assert release_floor(load_config(), 100 * GiB) == 90 * GiB
    assert release_floor(load_config(overrides={"release_floor_gib": 95}), 100 * GiB) == 95 * GiB


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_wait_for_returns_once_memory_is_back():
    readings = iter([10, 20, 30, 95, 99])
    clock = Clock()

    def read():
        clock.t += 1
        return next(readings) * GiB

    assert wait_for(90 * GiB, 60, threading.Event(), read, poll=0, clock=clock) == (True, 95 * GiB)


def test_wait_for_gives_up_at_the_timeout_with_the_last_reading():
    clock = Clock()

    def read():
        clock.t += 10
        return 40 * GiB

    assert wait_for(90 * GiB, 60, threading.Event(), read, poll=0, clock=clock) == (False, 40 * GiB)
    assert clock.t == 60  # read at 10, 20, ..., 60 s


def test_wait_for_stops_when_asked():
    stop = threading.Event()
    stop.set()
    ok, _ = wait_for(1 << 60, 3600, stop, lambda: 0, poll=10)
    assert not ok
