"""ling-bench --workload agent against the fake server: histories that grow turn by turn and hold every
earlier request verbatim, the history limit, prefix-cache and spec deltas per turn, parallel sessions
kept apart, deterministic datasets, and bad settings refused by name."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from bench_fake_server import fake_count

from ling_bench.agent import AgentConfig, PrefixCache, first_history, prefix_cache
from ling_bench.bench import main
from ling_bench.prompts import agent_prefix, agent_task, estimate_tokens, tool_output

pytest.importorskip("vllm.benchmarks.lib.endpoint_request_func")

MAX_TOKENS = 8
SMALL = ["--max-tokens", str(MAX_TOKENS), "--agent-prefix-tokens", "200", "--agent-tool-tokens", "60,120",
         "--agent-max-history", "1500", "--warmup", "0"]
LINE_TOKENS = 40  # a tool-output line is well under 160 characters


def _fast(fake, **kw):
    return fake(first_token_delay_s=0.01, chunk_delay_s=0.001, **kw)


def _run(server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "agent.json"
    rc = main(["--workload", "agent", "--base-url", server.url, "--out", str(out), *SMALL, *extra])
    return rc, json.loads(out.read_text()) if out.exists() else {}


def _reply(server) -> str:
    """What the fake generates for one request: `MAX_TOKENS` tokens, ignore_eos on."""
    return server.config.first_text + " tok" * (MAX_TOKENS - 1)


def test_each_turn_sends_the_previous_request_its_reply_and_a_new_tool_output(fake, tmp_path):
    server = _fast(fake)
    rc, report = _run(server, tmp_path)
    prompts = [b["prompt"] for b in server.state.bodies]
    assert rc == 0 and len(prompts) == report["scenarios"][0]["summary"]["turns"] >= 3
    for prev, nxt in zip(prompts, prompts[1:]):
        assert nxt.startswith(prev + _reply(server) + "\n\n")
        added = nxt[len(prev + _reply(server) + "\n\n"):]
        assert added.startswith("User: Tool output:\n") and added.endswith("Assistant: ")
        tool = added[len("User: Tool output:\n"):-len("\n\nAssistant: ")]
        assert 60 <= estimate_tokens(tool) <= 120 + LINE_TOKENS
    turns = report["scenarios"][0]["session_runs"][0]["turns"]
    assert [t["prompt_tokens"] for t in turns] == [fake_count(p) for p in prompts]
    assert all(t["completion_tokens"] == MAX_TOKENS for t in turns)


def test_each_turn_records_when_it_was_sent_and_its_longest_wait_between_chunks(fake, tmp_path):
    """A slow turn is one stall or every step slower: the longest chunk gap tells; `sent_at` lines the turn up
    with the server's and the watchdog's logs."""
    server = _fast(fake, stall_s=0.5)
    before = datetime.now(timezone.utc)
    rc, report = _run(server, tmp_path, "--agent-turns", "2")
    turns = report["scenarios"][0]["session_runs"][0]["turns"]
    assert rc == 0 and len(turns) == 2
    sent = [datetime.fromisoformat(t["sent_at"]) for t in turns]
    assert before <= sent[0] < sent[1] <= datetime.now(timezone.utc)
    # the stall less TCP's delayed-ACK blur (~40 ms between a fake's small writes); unstalled, decode takes ~10 ms
    assert all(0.4 <= t["max_gap_s"] <= t["latency_s"] - t["ttft_s"] for t in turns)


def test_chat_history_appends_the_reply_as_an_assistant_message(fake, tmp_path):
    server = _fast(fake)
    rc, _ = _run(server, tmp_path, "--chat", "--agent-turns", "3")
    histories = [b["messages"] for b in server.state.bodies]
    assert rc == 0 and len(histories) == 3 and histories[0][0]["role"] == "system"
    assert histories[0][1]["content"].startswith("Task: ")
    for prev, nxt in zip(histories, histories[1:]):
        assert nxt[:len(prev)] == prev
        assert nxt[len(prev)] == {"role": "assistant", "content": _reply(server)}
        assert nxt[len(prev) + 1]["role"] == "user" and len(nxt) == len(prev) + 2


def test_a_session_stops_before_the_turn_that_would_pass_the_history_limit(fake, tmp_path):
    server = _fast(fake)
    rc, report = _run(server, tmp_path)
    run = report["scenarios"][0]["session_runs"][0]
    assert rc == 0 and run["stop"].startswith("history limit")
    assert all(t["prompt_tokens"] + MAX_TOKENS <= 1500 for t in run["turns"])
    assert int(run["stop"].split("need ")[1].split(" +")[0]) + MAX_TOKENS > 1500


def test_agent_turns_bounds_a_session(fake, tmp_path):
    server = _fast(fake)
    rc, report = _run(server, tmp_path, "--agent-turns", "2")
    assert rc == 0 and len(server.state.bodies) == 2
    assert report["scenarios"][0]["session_runs"][0]["stop"] == "--agent-turns 2 reached"


def test_prefix_cache_and_spec_per_turn_are_the_servers_counter_deltas(fake, tmp_path):
    server = _fast(fake, drafts_per_request=4, draft_tokens_per_request=12, accepted_per_request=7,
                   accepted_per_pos_per_request=(4, 2, 1))
    rc, report = _run(server, tmp_path, "--agent-turns", "4")
    scenario = report["scenarios"][0]
    turns = scenario["session_runs"][0]["turns"]
    assert rc == 0 and [(t["prefix_cache"]["queries"], t["prefix_cache"]["hits"]) for t in turns] == \
        server.state.prefix_log
    assert turns[0]["prefix_cache"]["hits"] == 0 < turns[1]["prefix_cache"]["hits"]
    queries, hits = server.state.prefix_log[1]
    assert turns[1]["prefix_cache"]["hit_rate"] == pytest.approx(hits / queries)
    assert scenario["prefix_cache"]["hits"] == sum(h for _, h in server.state.prefix_log)
    assert all(t["spec"]["num_draft_tokens"] == 12 and t["spec"]["num_accepted_tokens"] == 7 for t in turns)


def test_without_prefix_cache_counters_the_hit_rate_is_absent_not_zero(fake, tmp_path):
    rc, report = _run(_fast(fake, prefix_cache=False, spec=False), tmp_path, "--agent-turns", "2")
    scenario = report["scenarios"][0]
    assert rc == 0 and scenario["prefix_cache"] is None
    assert all(t["prefix_cache"] is None and t["spec"] is None for t in scenario["session_runs"][0]["turns"])


def test_prefix_cache_counters_sum_engines_and_skip_created_samples():
    text = "\n".join([
        "# TYPE vllm:prefix_cache_queries counter",
        'vllm:prefix_cache_queries_total{engine="0"} 100.0', 'vllm:prefix_cache_queries_total{engine="1"} 50.0',
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e+09',
        "# TYPE vllm:prefix_cache_hits counter",
        'vllm:prefix_cache_hits_total{engine="0"} 30.0', 'vllm:prefix_cache_hits_total{engine="1"} 10.0', ""])
    assert prefix_cache(text) == PrefixCache(150, 40)
    assert (PrefixCache(150, 40) - PrefixCache(100, 10)).hit_rate == pytest.approx(30 / 50)
    assert prefix_cache("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n") is None


def _task(prompt: str) -> str:
    return prompt.split("User: Task: ")[1].split("\n")[0]


def test_parallel_sessions_run_at_once_and_keep_their_own_histories(fake, tmp_path):
    server = fake(first_token_delay_s=0.05, chunk_delay_s=0.001)
    rc, report = _run(server, tmp_path, "--agent-sessions", "3", "--agent-turns", "3")
    assert rc == 0 and [s["sessions"] for s in report["scenarios"]] == [1, 3]
    bodies = server.state.bodies[3:]  # after the one-session scenario's three turns
    assert len(bodies) == 9 and server.state.max_in_flight >= 2
    assert len({b["cache_salt"] for b in bodies}) == 1 != server.state.bodies[0]["cache_salt"]
    by_task: dict[str, list[str]] = {}
    for b in bodies:
        by_task.setdefault(_task(b["prompt"]), []).append(b["prompt"])
    assert len(by_task) == 3 and all(len(p) == 3 for p in by_task.values())
    for prompts in by_task.values():
        assert all(p.count("User: Task: ") == 1 for p in prompts)
        assert all(nxt.startswith(prev + _reply(server)) for prev, nxt in zip(prompts, prompts[1:]))
    runs = report["scenarios"][1]["session_runs"]
    assert [len(r["turns"]) for r in runs] == [3, 3, 3] and all(r["wall_s"] > 0 for r in runs)
    for r in runs:  # the report's turns are the session's own requests
        own = [p for p in (b["prompt"] for b in bodies) if agent_task(0, r["session"]) in p]
        assert [t["prompt_tokens"] for t in r["turns"]] == [fake_count(p) for p in own]


def test_dataset_is_deterministic_for_a_seed_and_holds_each_earlier_request(fake, tmp_path, capsys):
    server = _fast(fake)
    paths = [tmp_path / f"{name}.jsonl" for name in ("a", "b", "c")]
    for path, seed in zip(paths, ("0", "0", "1")):
        assert main(["--workload", "agent", "--base-url", server.url, *SMALL, "--agent-replies", "fixed",
                     "--agent-sessions", "2", "--seed", seed, "--write-dataset", str(path)]) == 0
    assert paths[0].read_bytes() == paths[1].read_bytes() != paths[2].read_bytes()
    assert server.state.bodies == []  # nothing generated
    rows = [json.loads(line) for line in paths[0].read_text().splitlines()]
    for s in (0, 1):
        mine = [r for r in rows if r["session"] == s]
        assert [r["turn"] for r in mine] == list(range(1, len(mine) + 1)) and len(mine) >= 2
        assert all(n["prompt"].startswith(p["prompt"]) for p, n in zip(mine, mine[1:]))
        assert all(r["prompt_tokens"] == fake_count(r["prompt"]) for r in mine)
        assert all(r["prompt_tokens"] + MAX_TOKENS <= 1500 and r["output_tokens"] == MAX_TOKENS for r in mine)
    assert "2 session(s)" in capsys.readouterr().out


def test_dataset_refuses_the_models_own_replies(fake, tmp_path, capsys):
    rc = main(["--workload", "agent", "--base-url", _fast(fake).url, *SMALL, "--write-dataset", str(tmp_path / "x")])
    assert rc == 1 and "--agent-replies fixed" in capsys.readouterr().err


def test_agent_texts_are_pure_functions_of_the_seed():
    assert agent_prefix(0, 3072) == agent_prefix(0, 3072) != agent_prefix(1, 3072)
    assert 3072 <= estimate_tokens(agent_prefix(0, 3072)) <= 3072 + 400  # one tool schema of slack
    sizes = [estimate_tokens(tool_output(0, 0, t, 1000, 2000)) for t in range(1, 30)]
    assert all(1000 <= n <= 2000 + LINE_TOKENS for n in sizes) and len(set(sizes)) > 10
    assert tool_output(0, 0, 1, 1000, 2000) != tool_output(0, 1, 1, 1000, 2000)


@pytest.mark.parametrize("flags, words", [
    (["--agent-max-history", "250"], ["--agent-max-history 250 is smaller than the smallest turn", "= 268"]),
    (["--agent-max-history", "40000"], ["max_model_len 32768", "--agent-max-history 32768"]),
    (["--agent-tool-tokens", "200,100"], ["--agent-tool-tokens 200,100", "MIN <= MAX"]),
    (["--agent-sessions", "0"], ["--agent-sessions 0 must be >= 1", "default is 1"]),
], ids=["smaller-than-prefix", "over-max-model-len", "tool-range", "sessions"])
def test_bad_settings_are_refused_by_name_before_any_request(fake, tmp_path, capsys, flags, words):
    server = _fast(fake)
    rc, report = _run(server, tmp_path, *flags)
    err = capsys.readouterr().err
    assert rc == 1 and report == {} and server.state.bodies == []
    assert all(w in err for w in words), err


def test_a_first_turn_over_the_limit_is_refused_with_the_size_the_server_counts(fake, tmp_path, capsys):
    cfg = AgentConfig(prefix_tokens=200, tool_tokens=(60, 120), seed=0)
    counted = [fake_count(first_history(cfg, False, s).prompt) for s in (0, 1)]
    limit = max(counted) + MAX_TOKENS - 1  # session 0's or 1's first turn is one token too long
    server = _fast(fake)
    rc, report = _run(server, tmp_path, "--agent-max-history", str(limit), "--agent-sessions", "2")
    err = capsys.readouterr().err
    assert rc == 1 and report == {} and server.state.bodies == []
    assert f"--agent-max-history {limit} cannot hold session {counted.index(max(counted))}'s first turn" in err
    assert f"{max(counted)} prompt tokens" in err and f"use at least {max(counted) + MAX_TOKENS}" in err


def test_a_stream_without_usage_is_an_error_with_the_turn(fake, tmp_path, capsys):
    rc, report = _run(_fast(fake, usage=False), tmp_path, "--agent-turns", "2")
    assert rc == 1 and "include_usage" in report["error"] and "turn 1" in report["error"]


def test_a_refused_turn_reports_the_servers_message_and_keeps_earlier_turns(fake, tmp_path):
    server = _fast(fake, reject_with="This model's maximum context length is 900 tokens", reject_over_tokens=900)
    rc, report = _run(server, tmp_path)
    turns = report["scenarios"][0]["session_runs"][0]["turns"]
    assert rc == 1 and turns and all(t["prompt_tokens"] <= 900 for t in turns)
    assert "maximum context length is 900" in report["error"] and f"turn {len(turns) + 1}" in report["error"]


def test_a_run_stopped_mid_way_keeps_the_scenarios_it_finished(fake, tmp_path, monkeypatch):
    """--out is rewritten after each scenario: a run that a time limit stops in its second scenario (here the second
    scenario itself is interrupted) leaves the first one, marked incomplete; a finished run is marked complete."""
    from ling_bench import agent

    server, real, calls = _fast(fake), agent.run_scenario, []

    async def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as SIGINT would, mid-scenario
        return await real(*args, **kwargs)

    monkeypatch.setattr(agent, "run_scenario", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _run(server, tmp_path, "--agent-sessions", "2", "--agent-turns", "2")
    report = json.loads((tmp_path / "agent.json").read_text())
    assert report["complete"] is False and [s["name"] for s in report["scenarios"]] == ["sessions-1"]
    assert len(report["scenarios"][0]["session_runs"][0]["turns"]) == 2 and not (tmp_path / "agent.json.tmp").exists()
    monkeypatch.setattr(agent, "run_scenario", real)
    rc, report = _run(server, tmp_path, "--agent-sessions", "2", "--agent-turns", "2")
    assert rc == 0 and report["complete"] is True and len(report["scenarios"]) == 2
