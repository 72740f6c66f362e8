"""The start-up self-check turns vLLM's log and spec-decode counters into ON/OFF lines, and fails loudly
when an optimisation that was asked for is not active. It judges only the launch it checks, reads what was
asked for from the serve command and the server's own environment, and presents the server's key."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from ling_watchdog.events import EventLog
from ling_watchdog.ports import free_port
from ling_watchdog.serve_args import ServeArgs

from ling_common.metrics import SpecCounters
from ling_tools.selfcheck import (Requested, inspect_log, judge_acceptance, judge_batch_agreement, judge_dspark,
                                 main, prefix_cache_verdict, prefix_counters, read_choice)
from vllm_ling import startup_log

FAKE = Path(__file__).parents[1] / "watchdog" / "fake_vllm.py"

GPU_LOG = """INFO [core.py:116] Initializing a V1 LLM engine (v0.34.0) with config: model='/m', speculative_config=SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1), device_config=cuda, ...
INFO [int_wna16.py:157] Using 'MARLIN' WNA16 MoE backend.
INFO [gpu_model_runner.py:6845] Graph capturing finished in 21 secs, took 0.55 GiB
"""
MTP_ARGS = ["vllm", "serve", "/m", "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}']
MTP = Requested(mtp=True)


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM's argument parser imported once here, so ServeArgs.parse runs it in-process."""
    from ling_watchdog import vllm_parse

    vllm_parse.parse([])


def _by_name(verdicts):
    return {v.name: v for v in verdicts}


def test_everything_requested_and_active_passes():
    v = _by_name(inspect_log(GPU_LOG, MTP))
    assert v["CUDA graphs"].on and v["MTP"].on and v["INT4 experts"].on
    assert "MARLIN" in v["INT4 experts"].why
    assert not any(x.failed for x in v.values())


def test_requested_mtp_that_did_not_start_fails():
    log = GPU_LOG.replace("speculative_config=SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1)",
                          "speculative_config=None")
    v = _by_name(inspect_log(log, MTP))
    assert v["MTP"].failed and "FAILED" in v["MTP"].line()


def test_missing_cuda_graphs_fail_unless_eager_was_asked_for():
    log = GPU_LOG.replace("Graph capturing finished in 21 secs", "")
    assert _by_name(inspect_log(log, MTP))["CUDA graphs"].failed
    assert not _by_name(inspect_log(log, Requested(mtp=True, eager=True)))["CUDA graphs"].failed


def test_cpu_engine_does_not_expect_cuda_graphs():
    v = _by_name(inspect_log("... device_config=cpu, ...", Requested()))
    assert not v["CUDA graphs"].on and not v["CUDA graphs"].failed


def test_tuned_tiles_asked_for_in_the_servers_environment_but_default_used_fails():
    """The recipe exports VLLM_TUNED_CONFIG_FOLDER; it is in the server's environment, never in its arguments."""
    log = GPU_LOG + "WARNING Using default MoE config. Performance might be sub-optimal!\n"
    v = _by_name(inspect_log(log, Requested.of(None, {"VLLM_TUNED_CONFIG_FOLDER": "/t"})))["tuned MoE tiles"]
    assert v.failed and "VLLM_TUNED_CONFIG_FOLDER=/t" in v.why
    assert not _by_name(inspect_log(log, Requested.of(None, {})))["tuned MoE tiles"].failed  # not asked for
    used = GPU_LOG + "INFO Using configuration from /t/E=512,N=768.json for MoE layer.\n"
    assert _by_name(inspect_log(used, Requested(tuned_folder="/t")))["tuned MoE tiles"].on


def test_what_was_asked_for_comes_from_vllms_reading_of_the_serve_command(vllm_parser):
    asked = Requested.of(ServeArgs.parse(MTP_ARGS + ["--enforce-eager"]), {"VLLM_TUNED_CONFIG_FOLDER": "/t"})
    assert asked == Requested(eager=True, mtp=True, tuned_folder="/t")
    assert not Requested.of(ServeArgs.parse(["vllm", "serve", "/m", "--max-model-len", "4096"]), {}).mtp


def test_acceptance_probe_catches_a_broken_draft():
    assert judge_acceptance(SpecCounters(100, 90), SpecCounters(164, 150), minimum=0.3).on
    before = {"num_draft_tokens": 100, "num_accepted_tokens": 90}  # the engine tests' form still works
    good = judge_acceptance(before, {"num_draft_tokens": 164, "num_accepted_tokens": 150}, minimum=0.3)
    broken = judge_acceptance(before, {"num_draft_tokens": 164, "num_accepted_tokens": 91}, minimum=0.3)
    silent = judge_acceptance(before, before, minimum=0.3)
    assert good.on and not good.failed
    assert broken.failed and "1.6%" in broken.why
    assert silent.failed and "no draft tokens" in silent.why


def test_batch_agreement_catches_a_sequence_reading_another_ones_rows():
    text = "The fox runs over the hill and the dog sleeps in the sun. " * 3
    assert judge_batch_agreement([text, text]).on
    mixed_up = judge_batch_agreement([text, "zq" + text])  # the second sequence parts at its first token
    assert mixed_up.failed and "first 0 of" in mixed_up.why and "garbage" in mixed_up.why
    late_tie = judge_batch_agreement([text, text[:100] + "X" + text[101:]])  # parted after 100 characters
    assert late_tie.on and not late_tie.failed
    assert judge_batch_agreement(["ab", "ab"]).on  # short continuations are judged on what there is


CHOICE = {"device_name": "NVIDIA H200", "moe_backend": "marlin",
          "reason": "tuned Triton is 0.44x Marlin (geomean over M=[1, 2, 4, 8, 16, 64]; needs >= 1.05x to switch)"}


def test_int4_backend_matches_ling_tunes_measured_choice(tmp_path):
    (tmp_path / "backend_choice.json").write_text(json.dumps(CHOICE))
    v = _by_name(inspect_log(GPU_LOG, MTP, read_choice(str(tmp_path), "NVIDIA H200")))["INT4 experts"]
    assert v.on and not v.failed and "as measured" in v.why and "0.44x" in v.why


def test_int4_backend_other_than_the_measured_one_fails():
    triton_log = GPU_LOG.replace("Using 'MARLIN' WNA16 MoE backend.", "Using CompressedTensorsWNA16MoEMethod")
    v = _by_name(inspect_log(triton_log, MTP, CHOICE))["INT4 experts"]
    assert v.failed and "CompressedTensorsWNA16MoEMethod" in v.why
    wants_triton = {**CHOICE, "moe_backend": "triton"}
    assert _by_name(inspect_log(GPU_LOG, MTP, wants_triton))["INT4 experts"].failed


def test_no_unreadable_or_other_gpus_choice_file_means_no_verdict(tmp_path):
    assert read_choice(None, "NVIDIA H200") is None and read_choice(str(tmp_path), "NVIDIA H200") is None
    (tmp_path / "backend_choice.json").write_text(json.dumps({**CHOICE, "moe_backend": "triton"}))
    assert read_choice(str(tmp_path), "NVIDIA GB10") is None  # measured on an H200: no verdict for a GB10
    assert read_choice(str(tmp_path), None) is None  # GPU unknown
    (tmp_path / "backend_choice.json").write_text("{not json")
    assert read_choice(str(tmp_path), "NVIDIA H200") is None
    assert _by_name(inspect_log(GPU_LOG, MTP, None))["INT4 experts"].on


# --- the live half, end to end: this launch's lines, the server's environment, its key ------------------


def _two_runs(tmp_path: Path) -> Path:
    """A log dir an MTP run used first, then a plain run: the recipe's serve.log after `demo --mtp`, `demo`."""
    log = EventLog(tmp_path, 1 << 20, 3, echo=False)
    log.emit("launch", "launch aaaa-1: pid 1 (own process group): vllm serve /m --speculative-config ...")
    log.output("INFO Initializing a V1 LLM engine with config: speculative_config=SpeculativeConfig(method='mtp', "
               "num_spec_tokens=1), device_config=cpu")
    log.emit("launch", "launch bbbb-1: pid 2 (own process group): vllm serve /m")
    log.output("INFO Initializing a V1 LLM engine with config: speculative_config=None, device_config=cpu")
    log.output("WARNING Using default MoE config. Performance might be sub-optimal!")
    log.close()
    return tmp_path / "serve.log"


def _json_lines(out: str) -> dict:
    return {r.get("check", "summary"): r for r in map(json.loads, out.splitlines())}


def test_a_plain_run_after_an_mtp_run_in_one_log_dir_is_judged_on_its_own_lines(tmp_path, capsys, vllm_parser):
    """Issue: `demo` after `demo --mtp` ended 'MTP acceptance FAILED no draft tokens'."""
    log = _two_runs(tmp_path)
    assert main(["--json", "--log", str(log), "--launch", "bbbb-1", "--", "vllm", "serve", "/m"]) == 0
    lines = _json_lines(capsys.readouterr().out)
    assert lines["MTP"]["state"] == "OFF" and all(r["level"] == "info" for r in lines.values())
    assert main(["--json", "--log", str(log), "--", "vllm", "serve", "/m"]) == 0  # no id: the latest launch
    capsys.readouterr()
    assert main(["--json", "--log", str(log), "--launch", "aaaa-1", "--", *MTP_ARGS]) == 0
    assert _json_lines(capsys.readouterr().out)["MTP"]["state"] == "ON"


def test_the_tuned_folder_is_read_from_the_servers_own_environment(tmp_path, capsys, vllm_parser):
    log = _two_runs(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TUNED_CONFIG_FOLDER"}
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                              env={**env, "VLLM_TUNED_CONFIG_FOLDER": str(tmp_path / "tuned")})
    try:
        code = main(["--json", "--log", str(log), "--launch", "bbbb-1", "--server-pid", str(server.pid),
                     "--", "vllm", "serve", "/m"])
    finally:
        server.kill()
        server.wait()
    lines = _json_lines(capsys.readouterr().out)
    assert code == 2 and lines["tuned MoE tiles"]["state"] == "FAILED"
    assert lines["tuned MoE tiles"]["level"] == "error" and lines["MTP"]["level"] == "info"  # only the failed one
    assert lines["summary"]["failed"] == ["tuned MoE tiles"] and f"pid {server.pid}" in lines["summary"]["message"]


@pytest.fixture
def keyed_server(tmp_path):
    """The watchdog tests' fake vLLM server, guarding /v1 with an API key."""
    port, key = free_port(), "sk-selfcheck-1"
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "fake-model", "--port", str(port), "--api-key", key,
                             "--fake-shard-s", "0", "--fake-tag", f"sc-{os.getpid()}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                break
        except requests.RequestException:
            time.sleep(0.2)
    yield url, key
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_the_probe_presents_the_servers_key(keyed_server, tmp_path, monkeypatch, capsys, vllm_parser):
    url, key = keyed_server
    log = _two_runs(tmp_path)
    monkeypatch.setenv("VLLM_API_KEY", key)  # what the watchdog hands the check
    assert main(["--json", "--log", str(log), "--url", url, "--", "vllm", "serve", "/m"]) == 0
    assert _json_lines(capsys.readouterr().out)["batch agreement"]["state"] == "ON"
    monkeypatch.delenv("VLLM_API_KEY")  # run by hand: the key comes from the serve command's own --api-key
    assert main(["--json", "--log", str(log), "--url", url, "--", "vllm", "serve", "/m", "--api-key", key]) == 0
    monkeypatch.setenv("VLLM_API_KEY", "wrong")
    with pytest.raises(RuntimeError, match="HTTP 401"):
        main(["--json", "--log", str(log), "--url", url, "--model", "fake-model", "--", "vllm", "serve", "/m"])


FP8_LINE = startup_log.FP8_ON.text(linears=279, head=startup_log.FP8_HEAD_ON, kernel="w8a8", scheme="block")
V033_LOG = f"""INFO Initializing a V1 LLM engine (v0.33.0) with config: model='/m', quantization=ling_fp8, speculative_config=None, device_config=cuda, compilation_config={{'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2, 1)>}}
INFO [plugin.py:70] vllm-ling: BailingMoeV3ForCausalLM and its MTP draft are served by vllm-ling on vLLM 0.33.0 (VLLM_LING_MODEL=vllm-ling; VLLM_LING_MODEL=vllm-ling|vllm picks).
INFO [compressed_tensors_moe.py:139] Using CompressedTensorsWNA16MoEMethod
INFO [int_wna16.py:356] Using 'HUMMING' WNA16 MoE backend.
INFO [fp8.py:190] {FP8_LINE}
INFO [gpu_model_runner.py:6517] Graph capturing finished in 81 secs, took 0.55 GiB
"""


def test_fp8_asked_for_and_active_names_the_layers_and_the_kernel():
    v = _by_name(inspect_log(V033_LOG, Requested(fp8=True)))["FP8 weights"]
    assert v.on and not v.failed and "(279 linears + LM head), w8a8" in v.why
    assert "FP8 weights      ON" in v.line()


def test_fp8_asked_for_but_no_fp8_layer_fails():
    log = V033_LOG.replace(FP8_LINE, "")
    v = _by_name(inspect_log(log, Requested(fp8=True)))["FP8 weights"]
    assert v.failed and "--quantization ling_fp8" in v.why
    assert not _by_name(inspect_log(log, Requested()))["FP8 weights"].failed  # not asked for: just OFF


def test_the_fp8_request_is_read_from_the_serve_command(vllm_parser):
    args = ServeArgs.parse(["vllm", "serve", "/m", "--quantization", "ling_fp8"])
    assert Requested.of(args, {}).fp8 and not Requested.of(ServeArgs.parse(["vllm", "serve", "/m"]), {}).fp8


def test_which_model_serves_and_why_is_a_line_of_its_own():
    v = _by_name(inspect_log(V033_LOG, Requested()))["Ling V3 model"]
    assert v.on and v.why.startswith("vllm-ling on vLLM 0.33.0: VLLM_LING_MODEL=vllm-ling")
    gone = _by_name(inspect_log("INFO " + startup_log.REGISTRATION_FAILED.text(error="ValueError: bad"), Requested()))
    assert "did not register: ValueError: bad" in gone["Ling V3 model"].why


def test_a_0_33_backend_name_is_held_to_ling_tunes_choice_as_named():
    choice = {"moe_backend": "humming", "device_name": "NVIDIA H200", "reason": "measured"}
    # 0.33 names the shared method class first, then the backend; the backend line is the one that counts
    assert _by_name(inspect_log(V033_LOG, Requested(), choice))["INT4 experts"].on
    marlin = _by_name(inspect_log(V033_LOG, Requested(), {**choice, "moe_backend": "marlin"}))["INT4 experts"]
    assert marlin.failed and "HUMMING" in marlin.why  # Humming is not Triton, and not what was measured


def test_the_cudagraph_mode_is_named():
    assert "FULL_AND_PIECEWISE" in _by_name(inspect_log(V033_LOG, Requested()))["CUDA graphs"].why


KERNEL_GATE = "INFO [kda.py:51] vllm-ling: KDA gate and β inside vLLM's KDA kernels (VLLM_LING_KDA_GATE=kernel)\n"


def test_the_kda_gate_line_says_where_the_gate_is_computed():
    gate = _by_name(inspect_log(V033_LOG + KERNEL_GATE, Requested(kda_gate_kernel=True)))["KDA gate"]
    assert gate.on and not gate.failed and "raw-gate KDA kernels" in gate.why
    ours = _by_name(inspect_log(V033_LOG, Requested()))["KDA gate"]
    assert not ours.on and not ours.failed and ours.why.startswith("ours")


def test_a_kda_gate_that_fell_back_fails_with_the_plugins_reason():
    fell = ("WARNING [kda_core.py:240] vllm-ling: KDA gate fell back to ours: vLLM's raw-gate KDA kernels need each "
            "cache slot's state dense [H, V, K], and this cache's state strides are (8320, 4096, 128, 1); "
            "VLLM_LING_KDA_GATE=kernel serves as VLLM_LING_KDA_GATE=ours\n")
    gate = _by_name(inspect_log(V033_LOG + KERNEL_GATE + fell, Requested(kda_gate_kernel=True)))["KDA gate"]
    assert gate.failed and "(8320, 4096, 128, 1)" in gate.why
    silent = _by_name(inspect_log(V033_LOG, Requested(kda_gate_kernel=True)))["KDA gate"]
    assert silent.failed  # asked for, and no line says it is on


def test_the_kda_gate_request_is_read_from_the_servers_environment(vllm_parser):
    args = ServeArgs.parse(["vllm", "serve", "/m"])
    assert Requested.of(args, {"VLLM_LING_KDA_GATE": "kernel"}).kda_gate_kernel
    assert not Requested.of(args, {"VLLM_LING_KDA_GATE": "ours"}).kda_gate_kernel


def _prefill_line(kernel: str, why: str, level: str = "INFO") -> str:
    return f"{level} [kda.py:60] {startup_log.KDA_PREFILL.text(kernel=kernel, why=why)}\n"


def test_the_flashkda_line_says_which_kernel_runs_kda_prefills():
    from vllm_ling import flashkda

    auto = flashkda.choose("auto", on_cpu=False, gaps=[])  # the plugin's own line under vLLM's default, on a GPU
    on = _by_name(inspect_log(V033_LOG + _prefill_line(auto.kernel, auto.reason), Requested()))["FlashKDA"]
    assert on.on and not on.failed and on.line().startswith("FlashKDA         ON") and "head dim 128" in on.why
    assert on.why.startswith("--kda-prefill-backend auto")
    why = "FlashKDA's contract does not hold: CUDA capability (8, 0) (FlashKDA is built for majors (9, 10, 12))"
    off = _by_name(inspect_log(V033_LOG + _prefill_line("Triton chunk_kda", why), Requested()))["FlashKDA"]
    assert off.state == "OFF" and off.why == f"KDA prefill on Triton chunk_kda: {why}"
    chosen = _by_name(inspect_log(V033_LOG + _prefill_line("Triton chunk_kda", "--kda-prefill-backend triton"),
                                  Requested(kda_prefill="triton")))["FlashKDA"]
    assert chosen.state == "OFF" and chosen.why.endswith("--kda-prefill-backend triton")


def test_flashkda_asked_for_by_name_and_not_serving_fails_with_the_reason():
    why = "FlashKDA's contract does not hold: head dim 64 (FlashKDA takes 128)"
    v = _by_name(inspect_log(V033_LOG + _prefill_line("Triton chunk_kda", why, "WARNING"),
                             Requested(kda_prefill="flashkda")))["FlashKDA"]
    assert v.failed and v.state == "FAILED" and "head dim 64" in v.why
    silent = _by_name(inspect_log(V033_LOG, Requested(kda_prefill="flashkda")))["FlashKDA"]
    assert silent.failed and "no vllm-ling KDA prefill line" in silent.why
    served = _by_name(inspect_log(V033_LOG + _prefill_line("FlashKDA", "--kda-prefill-backend flashkda; bf16"),
                                  Requested(kda_prefill="flashkda")))["FlashKDA"]
    assert served.on and not served.failed


def test_flashkda_is_off_not_failed_on_the_cpu_engine_and_under_the_in_tree_model():
    cpu = _by_name(inspect_log("... device_config=cpu, ...\n" + _prefill_line(
        "torch chunk_kda", "the CPU engine: FlashKDA and Triton chunk_kda are CUDA kernels"), Requested()))["FlashKDA"]
    assert cpu.state == "OFF" and "CPU engine" in cpu.why
    assert _by_name(inspect_log("... device_config=cpu, ...", Requested()))["FlashKDA"].why.startswith("CPU engine")
    intree = startup_log.REGISTERED.text(arch="BailingMoeV3ForCausalLM", who=startup_log.INTREE, version="0.34.0",
                                         why="VLLM_LING_MODEL=vllm", env="VLLM_LING_MODEL")
    intree_log = GPU_LOG + intree + "\n"  # vLLM's own model: none of our KDA lines
    v = _by_name(inspect_log(intree_log, Requested(kda_prefill="flashkda")))["FlashKDA"]
    assert v.failed and "in-tree model" in v.why


def _checkpoint_line(state: str, why: str) -> str:
    return f"INFO [kda.py:70] {startup_log.KDA_CHECKPOINT.text(state=state, why=why)}\n"


def test_in_prefill_checkpoints_are_on_by_default_and_fail_only_when_set_and_off(vllm_parser):
    """VLLM_LING_KDA_PREFILL_CHECKPOINT (read from the server's environment), on by default: ON with the plugin's
    line; OFF under Triton or without the prefix cache, which fails only when the variable was set on; no line
    (set to 0, or not our model) is off and no failure unless it was set on."""
    on = _by_name(inspect_log(V033_LOG + _checkpoint_line("ON", "FlashKDA writes the state"),
                              Requested()))["KDA checkpoints"]
    assert on.on and not on.failed and on.why == "FlashKDA writes the state"
    off = V033_LOG + _checkpoint_line("OFF", "Triton chunk_kda cannot write them")
    default = _by_name(inspect_log(off, Requested()))["KDA checkpoints"]
    assert not default.on and not default.failed and "cannot write them" in default.why
    triton = _by_name(inspect_log(off, Requested(kda_checkpoint=True)))["KDA checkpoints"]
    assert triton.failed and "cannot write them" in triton.why
    silent = _by_name(inspect_log(V033_LOG, Requested(kda_checkpoint=True)))["KDA checkpoints"]
    assert silent.failed and "no vllm-ling KDA checkpoint line" in silent.why
    unset = _by_name(inspect_log(V033_LOG, Requested()))["KDA checkpoints"]
    assert not unset.on and not unset.failed and "ends at a block boundary" in unset.why
    args = ServeArgs.parse(["vllm", "serve", "/m"])
    assert Requested.of(args, {"VLLM_LING_KDA_PREFILL_CHECKPOINT": "1"}).kda_checkpoint
    assert not Requested.of(args, {}).kda_checkpoint
    assert not Requested.of(args, {"VLLM_LING_KDA_PREFILL_CHECKPOINT": "0"}).kda_checkpoint
    dspark = ["--speculative-config", '{"method": "dspark", "model": "d"}', "--enable-prefix-caching"]
    assert not Requested.of(ServeArgs.parse(["vllm", "serve", "/m", *dspark]), {}).kda_checkpoint  # asks nothing


def test_the_kda_prefill_request_is_read_from_the_serve_command(vllm_parser):
    named = ServeArgs.parse(["vllm", "serve", "/m", "--kda-prefill-backend", "flashkda"])
    assert Requested.of(named, {}).kda_prefill == "flashkda"
    assert Requested.of(ServeArgs.parse(["vllm", "serve", "/m"]), {}).kda_prefill is None


def test_the_watchdogs_own_reading_of_the_serve_command_has_the_kda_prefill_backend():
    """When vLLM's parser cannot run (a launcher not vLLM's), the minimal parser still reads the flag."""
    args = ServeArgs.parse(["python3", "fake.py", "serve", "/m", "--kda-prefill-backend", "flashkda"])
    assert args.minimal and Requested.of(args, {}).kda_prefill == "flashkda"


VOCAB = ("INFO [draft_vocab.py:94] vllm-ling: MTP draft proposes among 32768 of 157184 tokens (VLLM_LING_DRAFT_VOCAB; "
         "80 MiB of head rows, torch.float8_e4m3fn)\n")


def test_the_draft_vocabulary_line_says_how_many_tokens_the_draft_proposes_among():
    on = _by_name(inspect_log(V033_LOG + VOCAB, Requested(mtp=True, draft_vocab=True)))["Draft vocab"]
    assert on.on and not on.failed and on.why == "32768 of 157184 tokens (torch.float8_e4m3fn rows)"
    off = _by_name(inspect_log(V033_LOG, Requested(mtp=True)))["Draft vocab"]
    assert not off.on and not off.failed and "whole LM head" in off.why
    ignored = _by_name(inspect_log(V033_LOG, Requested(mtp=True, draft_vocab=True)))["Draft vocab"]
    assert ignored.failed and "VLLM_LING_DRAFT_VOCAB" in ignored.why  # asked for, and no draft took it


def test_the_draft_vocabulary_request_is_read_from_the_servers_environment(vllm_parser):
    args = ServeArgs.parse(["vllm", "serve", "/m"])
    assert Requested.of(args, {"VLLM_LING_DRAFT_VOCAB": "/v.json"}).draft_vocab
    assert not Requested.of(args, {}).draft_vocab


PREFIX_LOG = GPU_LOG.replace("device_config=cuda, ...", "enable_prefix_caching=True, device_config=cuda, ...") + (
    "INFO [config.py:688] Mamba cache mode is set to 'align' for BailingMoeV3ForCausalLM by default when prefix "
    "caching is enabled\n")
# vLLM's /metrics (0.32-0.34): counters are exposed as <name>_total, with a _created sample that must not be summed
PREFIX_METRICS = """# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 3000.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1920.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_the_prefix_cache_line_says_on_how_kda_state_is_kept_and_the_hit_rate():
    v = prefix_cache_verdict(PREFIX_LOG, asked=True, counters=prefix_counters(PREFIX_METRICS))
    assert v.on and not v.failed
    assert v.line().startswith("Prefix cache     ON")
    assert "checkpointed at block boundaries (align)" in v.why
    assert "hit rate 64.0% (1,920 of 3,000 prompt tokens since start)" in v.why
    assert prefix_counters(PREFIX_METRICS + PREFIX_METRICS.replace('engine="0"', 'engine="1"')) == (6000.0, 3840.0)
    assert prefix_counters("vllm:prompt_tokens_total 5.0\n") is None
    assert "n/a" in prefix_cache_verdict(PREFIX_LOG, True, (0.0, 0.0)).why


def test_prefix_caching_asked_for_but_off_in_the_engine_fails_and_unasked_off_is_only_off():
    off_log = PREFIX_LOG.replace("enable_prefix_caching=True", "enable_prefix_caching=False")
    assert _by_name(inspect_log(off_log, Requested(prefix_cache=True)))["Prefix cache"].failed
    v = _by_name(inspect_log(off_log, Requested()))["Prefix cache"]
    assert v.state == "OFF" and "prefills its whole prompt" in v.why


def test_the_prefix_cache_request_is_read_from_the_serve_command(vllm_parser):
    assert Requested.of(ServeArgs.parse(["vllm", "serve", "/m", "--enable-prefix-caching"]), {}).prefix_cache
    assert not Requested.of(ServeArgs.parse(["vllm", "serve", "/m", "--no-enable-prefix-caching"]), {}).prefix_cache


def test_the_hit_rate_reaches_ling_watchdog_status(keyed_server, tmp_path, monkeypatch, capsys, vllm_parser):
    """The self-check reads the counters after its probe; its lines are what `ling-watchdog status` prints."""
    from ling_watchdog.events import format_summary, summarise

    url, key = keyed_server
    log = tmp_path / "serve.log"
    log.write_text(PREFIX_LOG.replace("SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1)", "None"))
    monkeypatch.setenv("VLLM_API_KEY", key)
    monkeypatch.setattr("ling_common.metrics.read_metrics", lambda url, headers=None, timeout=5.0: PREFIX_METRICS)
    assert main(["--json", "--log", str(log), "--url", url, "--", "vllm", "serve", "/m",
                 "--enable-prefix-caching"]) == 0
    out = capsys.readouterr().out
    line = _json_lines(out)["Prefix cache"]
    assert line["state"] == "ON" and "hit rate 64.0%" in line["why"]
    records = [{"event": "start", "pid": 1, "t": 0.0, "ts": "t0"}, {"event": "launch", "t": 1.0, "ts": "t1"}]
    records += [{"event": "after_serving", "ts": "t2", **json.loads(x)} for x in out.splitlines()]
    status = format_summary(summarise(records))
    assert "Prefix cache     ON     KDA state checkpointed at block boundaries (align); hit rate 64.0%" in status


# --- DSpark: asked for in the serve command, K from the engine, mean accepted length from /metrics ---------------

DSPARK_ENGINE = ("speculative_config=SpeculativeConfig(method='dspark', model='inclusionAI/Ling-3.0-flash-dspark', "
                 "num_spec_tokens=8)")
DSPARK_LOG = GPU_LOG.replace("speculative_config=SpeculativeConfig(method='mtp', model='/m', num_spec_tokens=1)",
                             DSPARK_ENGINE)
DSPARK_ARGS = ["vllm", "serve", "/m", "--speculative-config",
               '{"method":"dspark","model":"inclusionAI/Ling-3.0-flash-dspark"}']


def spec_metrics(drafts: int, draft_tokens: int, accepted: int) -> str:
    """vLLM's spec-decode counters as /metrics exposes them (0.32-0.34: <name>_total plus a _created sample)."""
    lines = []
    for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted)):
        lines += [f"# TYPE vllm:spec_decode_num_{name} counter",
                  f'vllm:spec_decode_num_{name}_total{{engine="0",model_name="m"}} {float(value)}',
                  f'vllm:spec_decode_num_{name}_created{{engine="0",model_name="m"}} 1.7e+09']
    return "\n".join(lines) + "\n"


def test_dspark_asked_for_and_in_the_engine_is_on_with_its_k_and_adaptive_width(vllm_parser):
    asked = Requested.of(ServeArgs.parse(DSPARK_ARGS), {})
    assert asked.dspark and not asked.mtp and not asked.adaptive
    v = _by_name(inspect_log(DSPARK_LOG, asked))
    assert v["DSpark"].on and v["DSpark"].why == "K=8, adaptive off" and not v["MTP"].failed
    adaptive = DSPARK_ARGS[:-1] + ['{"method":"dspark","model":"d","enable_adaptive_verification":true}']
    assert _by_name(inspect_log(DSPARK_LOG, Requested.of(ServeArgs.parse(adaptive), {})))["DSpark"].why == \
        "K=8, adaptive on"
    plain = _by_name(inspect_log(GPU_LOG, MTP))["DSpark"]
    assert not plain.on and not plain.failed and plain.why == "not configured"


def test_the_drafters_own_fp8_weights_are_read_from_the_plugins_line(vllm_parser):
    """`"quantization": "ling_fp8"` in a DSpark speculative config asks for the drafter's own FP8 weights: on with
    the plugin's line (its count), a failure without it (the drafter served BF16)."""
    args = DSPARK_ARGS[:-1] + ['{"method":"dspark","model":"d","quantization":"ling_fp8"}']
    asked = Requested.of(ServeArgs.parse(args), {})
    assert asked.dspark_fp8 and not Requested.of(ServeArgs.parse(DSPARK_ARGS), {}).dspark_fp8
    line = startup_log.DSPARK_FP8_ON.text(linears=36, markov=startup_log.DSPARK_MARKOV_ON, kernel="w8a8",
                                          scheme="block")
    v = _by_name(inspect_log(DSPARK_LOG + f"INFO 12-05 [dspark.py:1] {line}\n", asked))
    assert v["DSpark"].on and v["DSpark"].why == "K=8, adaptive off, drafter FP8 (36 linears + Markov head)"
    assert v["FP8 weights"].why == _by_name(inspect_log(DSPARK_LOG, asked))["FP8 weights"].why  # the target's line
    missing = _by_name(inspect_log(DSPARK_LOG, asked))["DSpark"]
    assert missing.failed and "the drafter's FP8 weights were asked for" in missing.why


def test_dspark_asked_for_but_absent_from_the_engine_fails():
    log = DSPARK_LOG.replace(DSPARK_ENGINE, "speculative_config=None")
    v = _by_name(inspect_log(log, Requested(dspark=True)))["DSpark"]
    assert v.failed and "FAILED" in v.line() and "no DSpark drafter" in v.why


def test_the_dspark_line_gives_the_mean_accepted_length_per_verify_from_vllms_counters():
    from ling_common.metrics import spec_counters

    engine = _by_name(inspect_log(DSPARK_LOG, Requested(dspark=True)))["DSpark"]
    before, after = spec_counters(spec_metrics(10, 80, 40)), spec_counters(spec_metrics(30, 240, 126))
    v = judge_dspark(engine, before, after, minimum=0.3)  # 86 accepted over 20 verifies: 1 + 4.3
    assert v.on and not v.failed
    assert v.line().startswith("DSpark           ON     K=8, adaptive off, mean accepted 5.30 (86 of 160 draft tokens")
    silent = judge_dspark(engine, before, before, minimum=0.3)
    assert silent.failed and "no drafts counted during the probe" in silent.why
    broken = judge_dspark(engine, before, spec_counters(spec_metrics(30, 240, 42)), minimum=0.3)  # 1.10 a verify
    assert broken.failed and "mean accepted 1.10" in broken.why and "slower than no draft" in broken.why


def test_the_self_check_probes_dspark_and_fails_loudly_when_it_does_not_draft(keyed_server, tmp_path, monkeypatch,
                                                                              capsys, vllm_parser):
    """End to end: the scrape before the probe and the one after; no drafts in between is the check's error line
    and exit 2, as for MTP."""
    url, key = keyed_server
    log = tmp_path / "serve.log"
    log.write_text(DSPARK_LOG)
    monkeypatch.setenv("VLLM_API_KEY", key)
    scrapes = iter([spec_metrics(10, 80, 40), spec_metrics(30, 240, 126)])
    monkeypatch.setattr("ling_common.metrics.read_metrics", lambda url, headers=None, timeout=5.0: next(scrapes))
    assert main(["--json", "--log", str(log), "--url", url, "--", *DSPARK_ARGS]) == 0
    line = _json_lines(capsys.readouterr().out)["DSpark"]
    assert line["state"] == "ON" and line["why"].startswith("K=8, adaptive off, mean accepted 5.30")
    scrapes = iter([spec_metrics(10, 80, 40)] * 2)
    assert main(["--json", "--log", str(log), "--url", url, "--", *DSPARK_ARGS]) == 2
    lines = _json_lines(capsys.readouterr().out)
    assert lines["DSpark"]["state"] == "FAILED" and lines["DSpark"]["level"] == "error"
    assert lines["summary"]["failed"] == ["DSpark"]
