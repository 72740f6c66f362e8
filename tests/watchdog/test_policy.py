"""Relaunch decisions: exponential backoff, the relaunch limit, the burst limit, stable reset."""
from ling_watchdog.config import load_config
from ling_watchdog.policy import RelaunchPolicy


def policy(**kw):
    return RelaunchPolicy(load_config(overrides=dict(backoff_initial_s=5, backoff_max_s=300, max_relaunches=3,
                                                     burst_failures=4, burst_window_s=1800) | kw))


def test_backoff_doubles_up_to_the_cap():
    p = policy(max_relaunches=10, burst_failures=100, backoff_max_s=30)
    assert [p.after_failure(i * 1000.0).delay_s for i in range(5)] == [5, 10, 20, 30, 30]


def test_three_relaunches_then_give_up_by_default():
    p = policy()
    assert [p.after_failure(t).relaunch for t in (0, 400, 800, 1200)] == [True, True, True, False]
    assert p.total == 3 and "relaunch limit" in p.after_failure(1300).reason


def test_burst_limit_counts_failures_inside_the_window_only():
    p = policy(max_relaunches=100, burst_failures=3, burst_window_s=100)
    assert p.after_failure(0).relaunch and p.after_failure(50).relaunch
    assert p.after_failure(120).relaunch  # the failure at 0 left the window
    d = p.after_failure(130)
    assert not d.relaunch and "burst limit: 3 failures within 100s" in d.reason


def test_a_stable_serving_period_resets_the_relaunch_count_and_backoff():
    p = policy(burst_failures=100)
    for t in (0, 1, 2):
        p.after_failure(t)
    p.stable()
    d = p.after_failure(10_000)
    assert d.relaunch and d.delay_s == 5 and p.total == 4
