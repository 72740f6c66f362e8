"""ling-bench --workload agent: fixed-seed multi-turn agent sessions against a running vLLM server.

An agent step re-sends the whole conversation: system prompt, tool schemas, every earlier tool output and
reply. A session here is a ~3K-token system + tool-schema prefix and a task, then turns that each append
a tool output (`--agent-tool-tokens`, ~1-2K tokens) and generate `--max-tokens`; the model's own reply is
appended to the history, so each request holds all earlier ones verbatim (what a prefix cache can reuse).
A session ends after `--agent-turns` turns or before a turn whose prompt + max_tokens would pass
`--agent-max-history`. The first scenario runs one session; `--agent-sessions N` (N > 1) adds a second
with N sessions in parallel, sharing the prefix as sub-agents of one harness do.

Each request goes through vLLM's own client (`vllm.benchmarks.lib.endpoint_request_func`, the one `vllm
bench serve` uses): TTFT, and tokens from usage.completion_tokens, never stream chunks. Around each turn
the server's /metrics is scraped and the prefix-cache counters' delta gives that turn's hit rate (with
parallel sessions the window also holds the other sessions' requests: the scenario's delta is the clean
number). Each scenario has its own vLLM `cache_salt`, so it never hits what an earlier one cached.
`--write-dataset FILE` (with `--agent-replies fixed`) writes every request as JSONL without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import aiohttp
import requests

from ling_bench.client import BenchError, Endpoint, resolve_endpoint, token_counter
from ling_bench.gpu_memory import GpuMemSampler
from ling_bench.prompts import agent_prefix, agent_task, estimate_tokens, fixed_reply, tool_output
from ling_bench.vllm_bench import RequestResult, Sampling

from ling_common.metrics import PrefixCache, SpecCounters, prefix_cache, spec_counters

SCHEMA = "ling-bench-agent/1"


@dataclass(frozen=True)
class AgentConfig:
    prefix_tokens: int = 3072  # estimated tokens (CHARS_PER_TOKEN): the texts never depend on a tokenizer
    tool_tokens: tuple[int, int] = (1000, 2000)
    max_history: int = 65536  # counted tokens: prompt + max_tokens of the last turn
    turns: int = 64
    sessions: int = 1
    replies: str = "model"  # "fixed": a seeded stand-in, so the history is known before the run
    seed: int = 0


@dataclass(frozen=True)
class Scrape:
    cache: PrefixCache | None
    spec: SpecCounters | None

    def __sub__(self, before: Scrape) -> Scrape:
        return Scrape(self.cache - before.cache if self.cache and before.cache else None,
                      self.spec - before.spec if self.spec and before.spec else None)


class History:
    """One session's conversation. Completions mode renders it as plain `Role: text` blocks ending in
    `Assistant: `, so every request is the previous request + its reply + the new tool output, verbatim."""

    def __init__(self, chat: bool, prefix: str, task: str):
        self.chat = chat
        self.messages: list[dict[str, str]] = [{"role": "system", "content": prefix}]
        self._task: str | None = task

    def add_tool(self, text: str) -> None:
        head, self._task = (self._task + "\n\n" if self._task else ""), None  # the task opens turn 1
        self.messages.append({"role": "user", "content": f"{head}Tool output:\n{text}"})

    def add_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    @property
    def prompt(self) -> str:
        return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in self.messages) + "Assistant: "

    def body(self) -> dict:
        """The request's text: the messages in chat mode, else the rendered prompt."""
        return {"messages": [dict(m) for m in self.messages]} if self.chat else {"prompt": self.prompt}


@dataclass(frozen=True)
class Turn:
    turn: int
    prompt_tokens_counted: int  # before sending: /tokenize (or the estimate), for the history limit
    request: RequestResult
    cache: PrefixCache | None  # the /metrics delta around this turn
    spec: SpecCounters | None
    prompt_sha256: str
    sent_at: float = 0.0  # wall clock (Unix seconds) when the request went out: to line a turn up with server logs

    def to_json(self, exclusive: bool) -> dict:
        r, sent = self.request, datetime.fromtimestamp(self.sent_at, timezone.utc)
        return {"turn": self.turn, "sent_at": sent.isoformat(timespec="milliseconds"), "prompt_tokens": r.prompt_tokens,
                "prompt_tokens_counted": self.prompt_tokens_counted, "completion_tokens": r.completion_tokens,
                "ttft_s": r.ttft_s, "latency_s": r.latency_s, "max_gap_s": r.max_gap_s,
                "decode_tok_s": r.decode_tok_s, "prefill_tok_s": r.prefill_tok_s,
                "prefix_cache": self.cache.to_json() if self.cache else None,
                "prefix_cache_window": "this turn" if exclusive else "this turn and the other sessions' requests",
                "spec": self.spec.to_json() if self.spec else None, "prompt_sha256": self.prompt_sha256}


@dataclass
class SessionRun:
    session: int
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0  # first request sent to last reply, the /tokenize calls between turns excluded
    stop: str = ""
    error: str | None = None


Count = Callable[[History], Awaitable[int]]


def validate(cfg: AgentConfig, max_tokens: int, max_model_len: int | None) -> None:
    """Refuse settings that cannot make a session, by name, before any request."""
    lo, hi = cfg.tool_tokens
    if not 1 <= lo <= hi:
        raise BenchError(f"--agent-tool-tokens {lo},{hi}: need 1 <= MIN <= MAX; e.g. 1000,2000")
    if cfg.max_history < (least := cfg.prefix_tokens + lo + max_tokens):
        raise BenchError(
            f"--agent-max-history {cfg.max_history} is smaller than the smallest turn: --agent-prefix-tokens "
            f"{cfg.prefix_tokens} + --agent-tool-tokens MIN {lo} + --max-tokens {max_tokens} = {least} "
            f"(estimated); use more (the default is {AgentConfig.max_history}; the server's count of the first "
            "turn decides)")
    if max_model_len and cfg.max_history > max_model_len:
        raise BenchError(f"--agent-max-history {cfg.max_history} exceeds the server's max_model_len {max_model_len}; "
                         f"use --agent-max-history {max_model_len} or raise --max-model-len on the server")


def tokenize_counter(http: aiohttp.ClientSession, ep: Endpoint, source: str) -> Count:
    """A history's prompt tokens: vLLM's POST /tokenize (messages in chat mode: the template counts too),
    or ~4 chars/token when the server has no /tokenize."""

    async def count(history: History) -> int:
        if source != "server":
            return estimate_tokens(history.prompt)
        async with http.post(ep.url("/tokenize"), json={"model": ep.model, **history.body()},
                             headers=ep.headers) as resp:
            if resp.status != 200:
                raise BenchError(f"POST /tokenize -> HTTP {resp.status}: {(await resp.text())[:500]}")
            return int((await resp.json())["count"])

    return count


async def scrape(http: aiohttp.ClientSession, ep: Endpoint) -> Scrape:
    """Prefix-cache and spec-decode counters from /metrics (both None if it does not answer)."""
    try:
        async with http.get(ep.url("/metrics"), headers=ep.headers) as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        text = ""
    return Scrape(prefix_cache(text), spec_counters(text)) if text else Scrape(None, None)


async def _server_says(http: aiohttp.ClientSession, ep: Endpoint, history: History) -> str:
    """vLLM's client keeps only the HTTP reason of a refusal: ask once more, for one token, for the message."""
    path = "/v1/chat/completions" if ep.chat else "/v1/completions"
    try:
        async with http.post(ep.url(path), json={"model": ep.model, **history.body(), "max_tokens": 1},
                             headers=ep.headers) as resp:
            return "" if resp.status == 200 else f" (the server says: HTTP {resp.status}: {(await resp.text())[:500]})"
    except aiohttp.ClientError as e:
        return f" ({path}: {e})"


async def send(http: aiohttp.ClientSession, ep: Endpoint, history: History, sampling: Sampling,
               salt: str) -> tuple[RequestResult, str]:
    """One streamed request through vLLM's benchmark client; returns its timings and the generated text."""
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS, RequestFuncInput

    path = "/v1/chat/completions" if ep.chat else "/v1/completions"
    body = history.body()
    inp = RequestFuncInput(prompt=body.get("prompt", ""), api_url=ep.url(path), prompt_len=0,
                           output_len=sampling.max_tokens, model=ep.model, ignore_eos=sampling.ignore_eos,
                           extra_headers=ep.headers or None, chat_messages=body.get("messages"),
                           extra_body={"temperature": sampling.temperature, "cache_salt": salt})
    out = await ASYNC_REQUEST_FUNCS["openai-chat" if ep.chat else "openai"](inp, http)
    if not out.success:
        last = out.error.strip().splitlines()[-1] if out.error.strip() else "unknown error"
        raise BenchError(f"request failed: {last}{await _server_says(http, ep, history)}")
    if not out.output_tokens:
        raise BenchError("a stream carried no usage; the server must honour stream_options.include_usage "
                         "(tokens are never counted from stream chunks)")
    return RequestResult(int(out.prompt_len), int(out.output_tokens), 1 + len(out.itl), out.ttft,
                         out.ttft + sum(out.itl), max(out.itl, default=0.0)), out.generated_text


def first_history(cfg: AgentConfig, chat: bool, session: int) -> History:
    """Session `session` up to its first request."""
    h = History(chat, agent_prefix(cfg.seed, cfg.prefix_tokens), agent_task(cfg.seed, session))
    h.add_tool(tool_output(cfg.seed, session, 1, *cfg.tool_tokens))
    return h


async def check_first_turns(cfg: AgentConfig, chat: bool, max_tokens: int, count: Count) -> None:
    """Every session's first turn must fit --agent-max-history, counted as the server counts; refused
    before any session starts, so no scenario runs with fewer sessions than asked."""
    for session in range(cfg.sessions):
        n = await count(first_history(cfg, chat, session))
        if n + max_tokens > cfg.max_history:
            raise BenchError(
                f"--agent-max-history {cfg.max_history} cannot hold session {session}'s first turn: {n} prompt "
                f"tokens (prefix, task, first tool output) + --max-tokens {max_tokens}; use at least {n + max_tokens}")


async def run_session(cfg: AgentConfig, chat: bool, session: int, max_tokens: int, count: Count,
                      step: Callable[[int, int, History, int], Awaitable[tuple[Turn | None, str]]]) -> SessionRun:
    """The turn loop shared by measuring and --write-dataset: append a tool output, count, stop at the
    history limit, `step` (send, or record), append the reply `step` returns."""
    run, history, counting_s = SessionRun(session), first_history(cfg, chat, session), 0.0
    t0 = time.perf_counter()
    try:
        for turn in range(1, cfg.turns + 1):
            if turn > 1:
                history.add_tool(tool_output(cfg.seed, session, turn, *cfg.tool_tokens))
            c0 = time.perf_counter()
            n = await count(history)
            counting_s += time.perf_counter() - c0
            if n + max_tokens > cfg.max_history:  # turn 1 always fits: check_first_turns
                run.stop = f"history limit: turn {turn} would need {n} + {max_tokens} tokens"
                break
            result, reply = await step(session, turn, history, n)
            if result is not None:
                run.turns.append(result)
            history.add_reply(reply if cfg.replies == "model" else fixed_reply(cfg.seed, session, turn, max_tokens))
        else:
            run.stop = f"--agent-turns {cfg.turns} reached"
    except BenchError as e:
        run.error = f"session {session}, turn {len(run.turns) + 1}: {e}"
    run.wall_s = time.perf_counter() - t0 - counting_s
    return run


@dataclass
class Scenario:
    name: str
    sessions: list[SessionRun]
    wall_s: float
    cache: PrefixCache | None
    spec: SpecCounters | None

    @property
    def exclusive(self) -> bool:
        return len(self.sessions) == 1

    def summary(self) -> dict:
        turns = [t for s in self.sessions for t in s.turns]

        def stat(values: list[float]) -> dict | None:
            return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None

        later = [t.request.ttft_s for t in turns if t.turn > 1]
        completion = sum(t.request.completion_tokens for t in turns)
        return {
            "turns": len(turns), "prompt_tokens": sum(t.request.prompt_tokens for t in turns),
            "completion_tokens": completion,
            "max_prompt_tokens": max((t.request.prompt_tokens for t in turns), default=None),
            "ttft_s_first_turn": stat([t.request.ttft_s for t in turns if t.turn == 1]),
            "ttft_s_later_turns": stat(later),
            "decode_tok_s": stat([d for t in turns if (d := t.request.decode_tok_s) is not None]),
            "session_wall_s": stat([s.wall_s for s in self.sessions]),
            "output_tok_s": completion / self.wall_s if self.wall_s > 0 else None,
        }

    def to_json(self) -> dict:
        return {
            "name": self.name, "sessions": len(self.sessions), "wall_s": self.wall_s,
            "prefix_cache": self.cache.to_json() if self.cache else None,
            "spec": self.spec.to_json() if self.spec else None, "summary": self.summary(),
            "session_runs": [{"session": s.session, "wall_s": s.wall_s, "stop": s.stop, "error": s.error,
                              "turns": [t.to_json(self.exclusive) for t in s.turns]} for s in self.sessions],
        }


async def run_scenario(http: aiohttp.ClientSession, ep: Endpoint, cfg: AgentConfig, sampling: Sampling, count: Count,
                       n_sessions: int, salt: str) -> Scenario:
    """`n_sessions` sessions at once (the seed's first `n_sessions` sessions), all under one cache salt."""

    async def step(session: int, turn: int, history: History, counted: int) -> tuple[Turn, str]:
        before = await scrape(http, ep)
        sent_at = time.time()
        result, reply = await send(http, ep, history, sampling, salt)
        delta = await scrape(http, ep) - before
        sha = hashlib.sha256(json.dumps(history.body(), sort_keys=True).encode()).hexdigest()
        print(f"  session {session} turn {turn}: {result.prompt_tokens} prompt tokens, "
              f"TTFT {result.ttft_s * 1e3:.0f} ms", file=sys.stderr, flush=True)
        return Turn(turn, counted, result, delta.cache, delta.spec, sha, sent_at), reply

    before, t0 = await scrape(http, ep), time.perf_counter()
    runs = await asyncio.gather(*(run_session(cfg, ep.chat, i, sampling.max_tokens, count, step)
                                  for i in range(n_sessions)))
    wall, delta = time.perf_counter() - t0, await scrape(http, ep) - before
    return Scenario(f"sessions-{n_sessions}", list(runs), wall, delta.cache, delta.spec)


def _http() -> aiohttp.ClientSession:
    """Like `vllm bench serve`'s: no connection limit, its six-hour timeout."""
    from vllm.benchmarks.lib.endpoint_request_func import AIOHTTP_TIMEOUT

    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), trust_env=True, timeout=AIOHTTP_TIMEOUT)


def _salt(run_id: str, name: str) -> str:
    return f"ling-bench-agent-{run_id}-{name}"


async def measure(ep: Endpoint, cfg: AgentConfig, sampling: Sampling, source: str, warmup: int,
                  done: Callable[[list[Scenario]], None] = lambda _: None) -> list[Scenario]:
    """Every scenario in turn; `done` gets the finished ones after each."""
    run_id = hashlib.sha256(f"{time.time_ns()}".encode()).hexdigest()[:12]
    async with _http() as http:
        count = tokenize_counter(http, ep, source)
        await check_first_turns(cfg, ep.chat, sampling.max_tokens, count)
        for i in range(warmup):  # the first session's first turn under its own salt: compiles, never cached for later
            await send(http, ep, first_history(cfg, ep.chat, 0), sampling, _salt(run_id, f"warmup-{i}"))
        scenarios = []
        for n in ([1] if cfg.sessions == 1 else [1, cfg.sessions]):
            print(f"scenario: {n} session(s)", file=sys.stderr, flush=True)
            scenarios.append(await run_scenario(http, ep, cfg, sampling, count, n, _salt(run_id, f"sessions-{n}")))
            done(scenarios)
            if any(s.error for s in scenarios[-1].sessions):
                break
    return scenarios


async def dataset_rows(ep: Endpoint, cfg: AgentConfig, max_tokens: int, source: str) -> list[dict]:
    """Every request of every session (fixed replies), in session then turn order, unsent."""
    rows: list[dict] = []

    async def record(session: int, turn: int, history: History, counted: int) -> tuple[None, str]:
        rows.append({"session": session, "turn": turn, **history.body(), "output_tokens": max_tokens,
                     "prompt_tokens": counted})
        return None, ""

    async with _http() as http:
        count = tokenize_counter(http, ep, source)
        await check_first_turns(cfg, ep.chat, max_tokens, count)
        for session in range(cfg.sessions):
            run = await run_session(cfg, ep.chat, session, max_tokens, count, record)
            if run.error:
                raise BenchError(run.error)
    return rows


# --- CLI -------------------------------------------------------------------------------------------------------


def _tool_tokens(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (integers), e.g. 1000,2000") from None
    return lo, hi


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--workload agent")
    g.add_argument("--agent-prefix-tokens", type=int, default=AgentConfig.prefix_tokens,
                   help="system + tool-schema prefix, estimated tokens (default 3072)")
    g.add_argument("--agent-tool-tokens", type=_tool_tokens, default=AgentConfig.tool_tokens, metavar="MIN,MAX",
                   help="tool output appended per turn, estimated tokens (default 1000,2000)")
    g.add_argument("--agent-max-history", type=int, default=AgentConfig.max_history,
                   help="stop a session before a turn's prompt + --max-tokens passes this (default 65536)")
    g.add_argument("--agent-turns", type=int, default=AgentConfig.turns, help="turns per session at most (default 64)")
    g.add_argument("--agent-sessions", type=int, default=1,
                   help="N > 1 adds a second scenario: N sessions in parallel (default 1: one scenario)")
    g.add_argument("--agent-replies", choices=("model", "fixed"), default="model",
                   help="append the model's reply (default) or a seeded stand-in, the same on every server")


def config(args: argparse.Namespace) -> AgentConfig:
    for flag, value, default in (("--agent-turns", args.agent_turns, AgentConfig.turns),
                                 ("--agent-sessions", args.agent_sessions, AgentConfig.sessions),
                                 ("--agent-prefix-tokens", args.agent_prefix_tokens, AgentConfig.prefix_tokens)):
        if value < 1:
            raise BenchError(f"{flag} {value} must be >= 1; the default is {default}")
    return AgentConfig(args.agent_prefix_tokens, args.agent_tool_tokens, args.agent_max_history, args.agent_turns,
                       args.agent_sessions, args.agent_replies, args.seed)


def _pct(cache: dict | None) -> str:
    return "-" if not cache or cache["hit_rate"] is None else f"{cache['hit_rate']:.1%}"


def _turn_row(t: dict) -> str:
    decode = "-" if t["decode_tok_s"] is None else f"{t['decode_tok_s']:.1f}"
    gap = t.get("max_gap_s")  # absent from reports written before it was recorded
    return (f"| {t['turn']} | {t['prompt_tokens']} | {t['ttft_s'] * 1e3:.0f} | {decode} | "
            f"{'-' if gap is None else f'{gap * 1e3:.0f}'} | {_pct(t['prefix_cache'])} |")


def _session_row(r: dict) -> str:
    if not r["turns"]:
        return f"| {r['session']} | 0 | {r['wall_s']:.1f} | - | - |"
    ttft = statistics.median(t["ttft_s"] for t in r["turns"])
    return (f"| {r['session']} | {len(r['turns'])} | {r['wall_s']:.1f} | {r['turns'][-1]['prompt_tokens']} "
            f"| {ttft * 1e3:.0f} |")


def markdown(report: dict) -> str:
    """Per turn for the one-session scenario, per session for the parallel one."""
    cfg, srv = report["config"], report["server"]
    lo, hi = cfg["tool_tokens"]
    lines = [f"**ling-bench agent** `{srv['model']}` at {srv['base_url']}{srv['endpoint']}: prefix "
             f"~{cfg['prefix_tokens']} tokens, tool outputs ~{lo}-{hi}, {cfg['max_tokens']} generated per turn, "
             f"history up to {cfg['max_history']}, replies {cfg['replies']}, seed {cfg['seed']}; "
             "measured by vLLM's client"]
    for sc in report["scenarios"]:
        s = sc["summary"]
        lines += ["", f"*{sc['name']}*: {s['turns']} turns, wall {sc['wall_s']:.1f} s, prefix-cache hit rate "
                      f"{_pct(sc['prefix_cache'])}, output {s['output_tok_s'] or 0:.1f} tok/s", ""]
        if sc["sessions"] == 1:
            lines += ["| turn | prompt tok | TTFT ms | decode tok/s | longest gap ms | prefix-cache hits |",
                      "|---:|---:|---:|---:|---:|---:|", *map(_turn_row, sc["session_runs"][0]["turns"])]
        else:
            lines += ["| session | turns | wall s | last prompt tok | TTFT ms median |",
                      "|---:|---:|---:|---:|---:|", *map(_session_row, sc["session_runs"])]
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    """Whole or not at all: a run killed while writing leaves the previous file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    """`ling-bench --workload agent`, from bench.py's parser (its server, sampling, --out, --write-dataset flags).
    --out is written after each scenario (`complete` false until the last), so a run stopped by a time limit keeps
    the scenarios it finished."""
    try:
        cfg = config(args)
        with requests.Session() as s:
            ep, max_model_len = resolve_endpoint(args, s)
            _, source = token_counter(s, ep)
        validate(cfg, args.max_tokens, max_model_len)
        if args.write_dataset:
            if cfg.replies != "fixed":
                raise BenchError("--write-dataset writes requests known before the run, and the model's replies are "
                                 "not: pass --agent-replies fixed (a seeded stand-in reply, the same on every server)")
            rows = asyncio.run(dataset_rows(ep, cfg, args.max_tokens, source))
            with open(args.write_dataset, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            print(f"wrote {len(rows)} requests of {cfg.sessions} session(s) (sized by {source}) to "
                  f"{args.write_dataset}; each row's prompt (or messages) holds the earlier rows of its session")
            return 0
        sampling, t0 = Sampling(args.max_tokens, args.temperature, args.ignore_eos), time.time()
        gpu = GpuMemSampler() if args.gpu_mem else None

        def report(scenarios: list[Scenario], complete: bool) -> dict:
            return {
                "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                "duration_s": time.time() - t0, "complete": complete,
                "server": {"base_url": ep.base_url, "model": ep.model, "max_model_len": max_model_len,
                           "endpoint": "/v1/chat/completions" if ep.chat else "/v1/completions"},
                "config": {**asdict(cfg), "tool_tokens": list(cfg.tool_tokens), "max_tokens": args.max_tokens,
                           "temperature": args.temperature, "ignore_eos": args.ignore_eos, "warmup": args.warmup},
                "token_count_source": source,
                "error": next((s.error for sc in scenarios for s in sc.sessions if s.error), None),
                "scenarios": [sc.to_json() for sc in scenarios],
                "gpu_mem_peak_mib": gpu.peak_mib if gpu else None,
            }

        def done(scenarios: list[Scenario]) -> None:
            if args.out:
                write_json(args.out, report(scenarios, complete=False))

        with gpu or nullcontext():
            scenarios = asyncio.run(measure(ep, cfg, sampling, source, args.warmup, done))
    except (BenchError, ValueError, requests.RequestException, aiohttp.ClientError) as e:
        print(f"ling-bench: error: {e}", file=sys.stderr)
        return 1
    final = report(scenarios, complete=True)
    print(markdown(final))
    if args.out:
        write_json(args.out, final)
    if final["error"]:
        print(f"ling-bench: error: {final['error']} (stopped; finished turns are reported)", file=sys.stderr)
        return 1
    return 0
