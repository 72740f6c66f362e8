"""Host memory readings and floors. On unified memory (GB10) this *is* the GPU's memory."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psutil
from ling_watchdog.config import Config

GiB = 1 << 30
MiB = 1 << 20


def available() -> int:
    """MemAvailable in bytes: what vLLM itself reads as free memory on an integrated GPU."""
    return psutil.virtual_memory().available


def total() -> int:
    return psutil.virtual_memory().total


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def guard_floor(cfg: Config, start_available: int, total_bytes: int) -> int:
    """The highest configured floor: a fraction of RAM (earlyoom), an absolute value, or
    `guard_floor_below_start_mb` below what was available when the watchdog started.

    Fixed once, before the engine starts, and judged in every phase, serving included. vLLM 0.34's extensible
    KV cache commits most of its pages after warm-up and CUDA graph capture, then caps torch's allocator at the
    memory left free on the device, not at --gpu-memory-utilization
    (vllm/v1/worker/extensible_kv_cache.py): on unified memory the resident size may still grow after ready,
    toward this floor. Left unset, util is 1.0 there and the cache alone would cross it: the preflight refuses that
    (rule kv_cache_size)."""
    floors = [int(cfg.guard_floor_fraction * total_bytes)]
    if cfg.guard_floor_gib is not None:
        floors.append(int(cfg.guard_floor_gib * GiB))
    if cfg.guard_floor_below_start_mb is not None:
        floors.append(start_available - int(cfg.guard_floor_below_start_mb * MiB))
    return max(floors)


def release_floor(cfg: Config, start_available: int) -> int:
    """MemAvailable to wait for after a kill: relaunching over memory the driver has not yet
    released wedges GB10 (docs/ops-walls.md, "Supervisor practice")."""
    floor = int(cfg.release_fraction * start_available)
    if cfg.release_floor_gib is not None:
        floor = max(floor, int(cfg.release_floor_gib * GiB))
    return floor


def wait_for(floor: int, timeout: float, stop: threading.Event, read: Callable[[], int] = available,
             poll: float = 0.5, clock: Callable[[], float] = time.monotonic) -> tuple[bool, int]:
    """Wait until read() >= floor; (reached, last reading). Returns early when `stop` is set."""
    deadline = clock() + timeout
    while True:
        now = read()
        if now >= floor:
            return True, now
        if clock() >= deadline or stop.wait(poll):
            return False, now
