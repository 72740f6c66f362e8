"""What a line of vLLM's log means (vLLM 0.32, 0.33, 0.34; docs/ops-walls.md, "vLLM's log"): the watchdog's
start-up phases and faults, and which INT4 MoE backend serves (the self-check and ling-tune's engine comparison)."""
from __future__ import annotations

import re
from dataclasses import dataclass

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# tqdm bar of weight_utils.py; every update ends in "\n", so each is its own line. " (eager)" suffix
# for the eager load strategy. The same string in 0.33.
SHARDS = re.compile(r"Loading safetensors checkpoint shards(?: \(eager\))?:\s+(\d+)% Completed \| (\d+)/(\d+)")

# Start-up milestones after the shards, in order. Any of them is progress for the loading rule.
MILESTONES = (
    ("weights_loaded", "Loading weights took"),
    ("model_loaded", "Model loading took"),
    ("kv_cache", "GPU KV cache size:"),
    ("graphs_captured", "Graph capturing finished"),
    ("engine_ready", "init engine (profile, create kv cache, warmup model) took"),
    ("server_starting", "Starting vLLM server on"),
    ("startup_complete", "Application startup complete."),
)

# Lines after which vLLM exits by itself. retry=False: the same command fails the same way again. generic=True: the
# line says only that the engine died, not why; vLLM 0.34 logs "EngineCore failed to start." before a load failure's
# traceback and "Engine core initialization failed. See root cause above." after it, so a cause such as "CUDA out of
# memory" stands between two generic lines.
FATAL = (
    (re.compile(r"Free memory on device .* less than desired GPU memory utilization"), False, False),
    (re.compile(r"No available memory for the cache blocks"), False, False),
    (re.compile(r"To serve at least one request with the model's max seq len"), False, False),
    (re.compile(r"Model architectures .* are not supported"), False, False),
    # argparse's refusal of a flag (vLLM exits 2): `vllm serve: error: ...`, `api_server.py: error: ...`
    (re.compile(r"^(?:vllm \w+|[\w./-]+): error: "), False, False),
    (re.compile(r"Address already in use|port must be 0-65535"), False, False),
    # a model path or id that does not exist (transformers / huggingface_hub, raised in the API server)
    (re.compile(r"is not a local folder and is not a valid model identifier|"
                r"Repo id must (?:be in the form|use alphanumeric)|Repository Not Found for url"), False, False),
    (re.compile(r"Timed out waiting for engine core processes to start"), True, False),
    (re.compile(r"Engine core initialization failed"), True, True),
    (re.compile(r"EngineCore failed to start"), True, True),
    # the engine died while serving (its process or a worker's killed, e.g. by the OOM killer); the API
    # server then logs EngineDeadError and exits 0
    (re.compile(r"Worker proc \S+ died unexpectedly"), True, True),
    (re.compile(r"EngineCore encountered a fatal error"), True, True),
    (re.compile(r"Engine core (?:proc|process) \S+ died unexpectedly"), True, True),
    (re.compile(r"EngineDeadError"), True, True),
    (re.compile(r"CUDA out of memory"), True, False),
)
# vLLM's signal handler (0.32-0.34 launcher.py): the server was asked to stop, by a signal.
STOP_REQUESTED = "API server: shutdown triggered"
# The last line of a traceback, bare or behind vLLM's "ERROR ... [file.py:N] " prefix. The first one
# of a launch is the root cause, whatever generic fatal lines surround it ("See root cause above").
ERROR = re.compile(r"(?:^|ERROR .*?\] )((?:[a-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
# PyTorch's caching allocator when cudaMalloc runs out of memory (c10 CUDACachingAllocator.cpp, torch 2.14): it then
# frees its cached blocks and tries once more, so the line is no failure by itself; it says the process reached the
# device's memory limit. Seen 80 times in each load of the full-size model on an 80 GB H100 (vLLM 0.34, Humming's
# conversion of the INT4 experts), which then served (tests/watchdog/data/vllm034_h100_mtp_load_oom.txt).
ALLOC_RETRY = re.compile(r"CUDACachingAllocator\.cpp:\d+\] memory allocation failed with OOM on device \d+ while "
                         r"trying to allocate (\d+) bytes \(free: (\d+), total: (\d+)\)")
# The INT4 experts' backend, 0.33 quoted, 0.34 not (fused_moe/oracle/base.py make_log_backend)
WNA16_BACKEND = re.compile(r"Using '?(\w+)'? WNA16 MoE (?:LoRA )?backend")
# Logged, not fatal by themselves: a plugin that failed to load (vLLM carries on, maybe with the wrong
# model: W1) and a Triton kernel over GB10's 101,376 B of shared memory (W3, W5, W6).
ALERTS = (re.compile(r"Failed to load plugin"), re.compile(r"OutOfResources.*shared memory"))


@dataclass(frozen=True, slots=True)
class LogEvent:
    kind: str  # "shard" | a MILESTONES key | "fatal" | "error" | "alert" | "memory_edge" | "stop_requested"
    text: str
    shard: int = 0
    total: int = 0  # shard: how many; memory_edge: the device's bytes
    asked: int = 0  # memory_edge: the bytes the allocation asked for
    free: int = 0  # memory_edge: the device's free bytes then
    retry: bool = True
    generic: bool = False  # fatal: the line says the engine died, not why (FATAL's third column)
    exception: str | None = None  # fatal: the exception the line ends a traceback with, as an "error" event's text

    def outranks(self, other: LogEvent | None) -> bool:
        """Which fatal line says why a launch failed: one a relaunch would repeat over one it may not, a cause over
        a generic line; between equals the first (the root cause comes first)."""
        return other is None or (not self.retry, not self.generic) > (not other.retry, not other.generic)


def parse(line: str) -> LogEvent | None:
    """The event a line carries, or None for ordinary output."""
    text = ANSI.sub("", line).strip()
    if m := SHARDS.search(text):
        return LogEvent("shard", text, shard=int(m[2]), total=int(m[3]))
    for kind, needle in MILESTONES:
        if needle in text:
            return LogEvent(kind, text)
    if STOP_REQUESTED in text:
        return LogEvent("stop_requested", text)
    error = ERROR.search(text)
    for pattern, retry, generic in FATAL:
        if pattern.search(text):
            return LogEvent("fatal", text, retry=retry, generic=generic,
                            exception=f"{error[1]}: {error[2]}" if error else None)
    if error:
        return LogEvent("error", f"{error[1]}: {error[2]}")
    if any(pattern.search(text) for pattern in ALERTS):
        return LogEvent("alert", text)
    if m := ALLOC_RETRY.search(text):
        return LogEvent("memory_edge", text, asked=int(m[1]), free=int(m[2]), total=int(m[3]))
    return None


def served_int4_backend(log: str) -> tuple[str, str] | None:
    """(backend, as logged) of the INT4 MoE experts from vLLM's start-up log, or None. 0.33 and 0.34 name their
    backend (0.33 `Using 'MARLIN' WNA16 MoE backend.`, 0.34 `Using HUMMING WNA16 MoE backend.`, unquoted, maybe with
    "out of potential backends: [...]") after a line naming the one method class all of them share
    (CompressedTensorsWNA16MoEMethod), so the backend line wins; a log without it names only the class."""
    named = WNA16_BACKEND.search(log)
    if named:
        return named.group(1).lower(), named.group(1)
    method = re.search(r"Using (CompressedTensorsWNA16\w*MoEMethod)", log)
    if not method:
        return None
    return ("marlin" if "marlin" in method.group(1).lower() else "triton"), method.group(1)
