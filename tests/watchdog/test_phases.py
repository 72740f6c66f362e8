"""The phase rules of one launch, driven with explicit times (no processes)."""
from pathlib import Path

import pytest
from ling_watchdog.config import load_config
from ling_watchdog.phases import Monitor, Phase
from ling_watchdog.probes import ProbeResult
from ling_watchdog.procs import Busiest
from ling_common.vllm_log import parse

CFG = dict(load_stall_s=10, cpu_busy_s=5, busy_cpu_percent=90, load_silent_s=60, load_timeout_s=600,
           ready_timeout_s=20, warmup_grace_s=120, health_timeout_s=5, fail_threshold=3)
BUSY, IDLE = Busiest(42, "EngineCore", 100.0), Busiest(42, "EngineCore", 3.0)


def shard(k, n=24):
    return parse(f"Loading safetensors checkpoint shards: {100 * k // n:3d}% Completed | {k}/{n} [00:01<00:02]")


@pytest.fixture
def events():
    return []


@pytest.fixture
def monitor(events):
    return Monitor(load_config(overrides=CFG), 0.0, lambda kind, msg, **kw: events.append((kind, msg, kw)))


def feed_shards(m, upto, t0=0.0):
    for k in range(upto + 1):
        m.output(t0 + k)
        m.line(shard(k), t0 + k)
    return t0 + upto


def to_serving(m, t=1.0):
    m.line(parse("INFO:     Application startup complete."), t)
    m.probe(ProbeResult("ready", True, "/health 200", t))
    m.probe(ProbeResult("first", True, "1-token completion 200 in 30.0s", t + 30))
    return t + 30


def test_frozen_shard_with_a_pinned_cpu_is_a_stall_after_load_stall_s(monitor):
    t = feed_shards(monitor, 7)
    for dt in range(0, 10):
        monitor.cpu(BUSY, t + dt)
        assert monitor.check(t + dt) is None
    monitor.cpu(BUSY, t + 10)
    fault = monitor.check(t + 10)
    assert (fault.event, fault.cause, fault.data["shard"], fault.held_s) == ("stall", "shard_freeze", 7, 10)


def test_no_shard_progress_with_an_idle_cpu_waits_for_the_silence_limit(monitor):
    t = feed_shards(monitor, 7)
    for dt in range(0, 60, 5):
        monitor.cpu(IDLE, t + dt)
        assert monitor.check(t + dt) is None
    assert monitor.check(t + 60).cause == "silent"


def test_cpu_must_be_busy_continuously_not_in_one_sample(monitor):
    t = feed_shards(monitor, 7)
    monitor.cpu(BUSY, t + 1)
    monitor.cpu(IDLE, t + 8)  # a dip resets the busy window
    monitor.cpu(BUSY, t + 9)
    monitor.cpu(BUSY, t + 12)
    assert monitor.check(t + 12) is None  # busy for 3 s only
    monitor.cpu(BUSY, t + 14)
    assert monitor.check(t + 14).cause == "shard_freeze"


def test_shard_progress_resets_the_stall_clock(monitor):
    t = feed_shards(monitor, 7)
    monitor.cpu(BUSY, t)
    monitor.line(shard(8), t + 9)
    monitor.cpu(BUSY, t + 15)
    assert monitor.check(t + 15) is None
    assert monitor.check(t + 19).cause == "shard_freeze"


def test_after_the_last_shard_only_the_silence_rule_applies(monitor):
    t = feed_shards(monitor, 24)
    monitor.cpu(BUSY, t)
    monitor.cpu(BUSY, t + 30)  # KV profiling / graph capture can burn CPU quietly
    assert monitor.check(t + 30) is None
    assert monitor.check(t + 60).cause == "silent"


def test_whole_startup_is_capped_by_load_timeout(monitor):
    for t in range(0, 600, 30):
        monitor.output(t)
        monitor.line(parse("INFO Loading weights took 1.0 seconds"), t)
    assert monitor.check(599) is None
    assert monitor.check(600).cause == "load_timeout"


def test_first_request_jit_is_never_judged_by_liveness(monitor, events):
    monitor.line(parse("INFO:     Application startup complete."), 1)
    monitor.probe(ProbeResult("ready", True, "/health 200", 2))
    for t in range(2, 2 + 119):
        assert monitor.check(t) is None
    monitor.probe(ProbeResult("first", True, "1-token completion 200 in 100.0s", 102))
    assert monitor.phase is Phase.SERVING
    assert [e[2].get("to") for e in events if e[0] == "phase"] == ["warmup", "serving"]


def test_first_request_past_the_jit_grace_is_a_wedge(monitor):
    monitor.line(parse("INFO:     Application startup complete."), 1)
    monitor.probe(ProbeResult("ready", True, "/health 200", 2))
    assert monitor.check(2 + 120 + 4) is None
    assert monitor.check(2 + 120 + 5).cause == "first_request"


def test_health_not_ready_after_ready_timeout_is_a_wedge(monitor):
    monitor.line(parse("INFO:     Application startup complete."), 1)
    monitor.probe(ProbeResult("ready", False, "/health: ReadTimeout", 5))
    assert monitor.check(20) is None
    fault = monitor.check(21)
    assert fault.cause == "not_ready" and "ReadTimeout" in fault.message


def test_k_consecutive_liveness_failures_are_a_wedge_and_a_success_resets_the_count(monitor):
    t = to_serving(monitor)

    def fail(t):
        return ProbeResult("live", False, "1-token completion: ReadTimeout in 60.0s", t)

    monitor.probe(fail(t + 1))
    monitor.probe(fail(t + 2))
    monitor.probe(ProbeResult("live", True, "1-token completion 200 in 0.1s", t + 3))
    monitor.probe(fail(t + 4))
    monitor.probe(fail(t + 5))
    assert monitor.check(t + 5) is None
    monitor.probe(fail(t + 6))
    fault = monitor.check(t + 6)
    assert (fault.cause, fault.data["failures"], fault.held_s) == ("liveness", 3, 2)


def test_a_busy_probe_counts_as_progress(monitor, events):
    t = to_serving(monitor)
    for i in range(5):
        monitor.probe(ProbeResult("live", True, "busy, not wedged", t + i, busy=True))
    assert monitor.check(t + 5) is None
    assert sum(e[0] == "probe_busy" for e in events) == 5


def test_a_fatal_root_cause_is_kept_over_later_generic_lines(monitor):
    monitor.line(parse("ValueError: Free memory on device cuda:0 (1/119 GiB) on startup is less than desired "
                       "GPU memory utilization (0.9, 107 GiB)."), 1)
    monitor.line(parse("RuntimeError: Engine core initialization failed. See root cause above."), 2)
    assert monitor.fatal.retry is False and "Free memory" in monitor.fatal.text


def test_a_real_oom_while_loading_is_named_over_the_generic_lines_around_it(monitor):
    """vLLM 0.34 on an H100 (the recipe with MTP, full size, 2026-12-06): "EngineCore failed to start." before the
    traceback, the CUDA OOM that ends it, "Engine core initialization failed" after. The crash message must say OOM."""
    real = Path(__file__).with_name("data") / "vllm034_h100_mtp_load_oom.txt"
    for line in real.read_text().splitlines():
        if ev := parse(line):
            monitor.line(ev, 1)
    assert "CUDA out of memory" in monitor.fatal.text and monitor.fatal.retry and not monitor.fatal.generic
    assert monitor.root_cause.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.88 GiB")


def test_the_allocators_out_of_memory_retries_are_reported_once_a_phase(monitor, events):
    """The same real log: PyTorch's allocator ran out of the H100's memory and retried while loading (the target's
    conversion went on; the MTP layer's then failed). Every retry line is read as one; one warning, with the first
    retry's numbers."""
    real = Path(__file__).with_name("data") / "vllm034_h100_mtp_load_oom.txt"
    seen = 0
    for line in real.read_text().splitlines():
        if ev := parse(line):
            seen += ev.kind == "memory_edge"
            monitor.line(ev, 1)
    edges = [(msg, kw) for kind, msg, kw in events if kind == "memory_edge"]
    assert len(edges) == 1 and seen == real.read_text().count("memory allocation failed with OOM") > 1
    msg, kw = edges[0]
    assert (kw["asked"], kw["free"], kw["total"]) == (1006632960, 386072576, 85017493504)
    assert "during loading" in msg and "asked 0.94 GiB with 0.36 of 79.2 GiB free" in msg and kw["level"] == "warning"
    retry = next(line for line in real.read_text().splitlines() if "memory allocation failed with OOM" in line)
    to_serving(monitor, 2)
    monitor.line(parse(retry), 40)
    monitor.line(parse(retry), 41)
    edges = [kw for kind, _, kw in events if kind == "memory_edge"]
    assert [kw["phase"] for kw in edges] == ["loading", "serving"]


def test_between_two_causes_of_one_rank_the_first_is_kept(monitor):
    monitor.line(parse("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB"), 1)
    monitor.line(parse("(EngineCore pid=3) ERROR [core.py:1] RuntimeError: Worker proc W1 died unexpectedly"), 2)
    assert "Tried to allocate 2 GiB" in monitor.fatal.text


def test_health_200_ends_loading_even_when_uvicorns_startup_line_is_silenced(monitor):
    feed_shards(monitor, 24)
    monitor.line(parse("(APIServer pid=6) INFO Starting vLLM server on http://0.0.0.0:8000"), 30)
    assert monitor.http_up and monitor.phase is Phase.LOADING
    monitor.probe(ProbeResult("ready", True, "/health 200", 31))
    assert monitor.phase is Phase.WARMUP and monitor.ready_t == 31


def test_health_503_while_serving_is_a_dead_engine_at_once(monitor):
    t = to_serving(monitor)
    monitor.probe(ProbeResult("live", False, "/health 503: vLLM reports its engine dead (EngineDeadError)", t + 1,
                              dead=True))
    fault = monitor.check(t + 1)
    assert (fault.event, fault.cause) == ("crash", "engine_dead") and "during serving" in fault.message


@pytest.fixture
def worker(events):
    return Monitor(load_config(overrides=CFG), 0.0, lambda kind, msg, **kw: events.append((kind, msg, kw)),
                   worker=True)


def test_a_worker_waits_for_its_head_without_a_time_limit_and_serves_once_linked(worker):
    from ling_watchdog.headlink import LinkResult

    feed_shards(worker, 24)
    for t in (100, 700, 5000):  # past load_silent_s and load_timeout_s: the head may be relaunching
        worker.link(LinkResult(False, "no connection to the head at h:1", t))
        assert worker.check(t) is None and worker.phase is Phase.LOADING
    worker.link(LinkResult(True, "connected to the head at h:1", 5001))
    assert worker.phase is Phase.SERVING and worker.check(5001) is None


def test_a_worker_whose_head_link_fails_k_times_in_a_row_has_lost_its_head(worker, events):
    from ling_watchdog.headlink import LinkResult

    worker.link(LinkResult(True, "connected to the head at h:1", 1))
    worker.link(LinkResult(False, "connection to the head at h:1 is CLOSE_WAIT", 2))
    worker.link(LinkResult(True, "connected to the head at h:1", 3))  # one miss, then back: no fault
    assert worker.check(3) is None and worker.failures == 0
    for t in (4, 5, 6):
        worker.link(LinkResult(False, "connection to the head at h:1 is CLOSE_WAIT", t))
    fault = worker.check(6)
    assert fault is not None and (fault.event, fault.cause) == ("wedge", "head_lost") and fault.held_s == 2
    assert "CLOSE_WAIT" in fault.message and [e[0] for e in events].count("probe_fail") == 4


def test_a_worker_frozen_mid_load_is_still_a_stall(worker):
    t = feed_shards(worker, 5)
    worker.cpu(BUSY, t)
    assert worker.check(t + 11).cause == "shard_freeze"
