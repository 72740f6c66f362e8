"""The CLI surface: preflight-only runs, refusals, --force, usage and config errors."""
import json
import shlex
import subprocess
import sys

import pytest
from ling_watchdog import memory
from ling_watchdog.cli import main
from ling_watchdog.events import read_events

pytestmark = pytest.mark.usefixtures("vllm_parser")  # vLLM's parser, in-process

LONG_08 = "vllm serve m --max-model-len 131072 --gpu-memory-utilization 0.8"
GB10 = ["--memory-model", "unified", "--gpu-smem-bytes", "101376"]


@pytest.fixture(autouse=True)
def spark_memory(monkeypatch):
    """The preflight sees a freshly booted DGX Spark, whatever this machine has."""
    monkeypatch.setattr(memory, "available", lambda: int(115 * memory.GiB))
    monkeypatch.setattr(memory, "total", lambda: int(119.6 * memory.GiB))


def run(tmp_path, opts, cmd):
    return main(["preflight", "--log-dir", str(tmp_path), *opts, "--", *shlex.split(cmd)])


def test_preflight_refusal_exits_2_and_says_why_on_stdout_and_in_the_log(tmp_path, capsys):
    assert run(tmp_path, GB10, LONG_08) == 2
    out = capsys.readouterr().out
    assert "ERROR: util_ceiling: --gpu-memory-utilization 0.8 is above 0.72" in out
    refused = [r for r in read_events(tmp_path) if r.get("verdict") == "refuse"]
    assert [r["rule"] for r in refused] == ["util_ceiling"] and refused[0]["values"]["util"] == 0.8
    assert read_events(tmp_path)[-1]["code"] == 2


def test_force_overrides_a_refusal_with_a_loud_warning(tmp_path, capsys):
    assert run(tmp_path, [*GB10, "--force"], LONG_08) == 0
    assert "!!! FORCED: starting despite 1 refused safety rule(s) (util_ceiling)" in capsys.readouterr().out
    assert [r["event"] for r in read_events(tmp_path)].count("preflight_forced") == 1


def test_a_passing_preflight_exits_0_and_starts_nothing(tmp_path):
    assert run(tmp_path, GB10, LONG_08.replace("0.8", "0.72")) == 0
    assert not [r for r in read_events(tmp_path) if r["event"] == "launch"]


def test_a_config_error_exits_7_with_the_message(tmp_path, capsys):
    """7, not 1: systemd's unit restarts on 1 (a watchdog crash) but not on a setting to fix."""
    assert run(tmp_path, ["--max-util", "1.5"], LONG_08) == 7
    assert "max_util=1.5 must be a fraction in (0, 1]" in capsys.readouterr().err


def test_a_missing_serve_command_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--log-dir", str(tmp_path)])
    assert e.value.code == 2 and "no serve command" in capsys.readouterr().err


def test_status_of_an_empty_log_dir_says_so(tmp_path, capsys):
    assert main(["status", "--log-dir", str(tmp_path)]) == 1
    assert "no events" in capsys.readouterr().err


def test_status_of_a_parent_dir_names_the_sub_dirs_that_hold_events(tmp_path, capsys):
    """The demo writes logs/demo: `status --log-dir logs` points there instead of only saying 'no events'."""
    run(tmp_path / "demo", GB10, LONG_08)
    capsys.readouterr()
    assert main(["status", "--log-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"no events in {tmp_path}" in err and f"ling-watchdog status --log-dir {tmp_path / 'demo'}" in err


def test_status_json_is_machine_readable(tmp_path, capsys):
    run(tmp_path, GB10, LONG_08)
    capsys.readouterr()
    assert main(["status", "--log-dir", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["phase"] == "stopped" and summary["final"]["code"] == 2


def test_a_serve_command_that_cannot_start_exits_7_and_says_so(tmp_path):
    # a real run installs signal handlers and becomes a subreaper: keep that out of pytest's process
    r = subprocess.run([sys.executable, "-m", "ling_watchdog", "--log-dir", str(tmp_path), "--memory-model", "cpu",
                        "--weights-gib", "0.01", "--overhead-gib", "0.1", "--host-reserve-gib", "0.1", "--",
                        str(tmp_path / "no-such-vllm"), "serve", "m",
                        "--max-model-len", "4096", "--kv-cache-memory-bytes", "1G"], capture_output=True, text=True)
    assert r.returncode == 7 and "No such file" in r.stdout
    assert "cannot start" in read_events(tmp_path)[-1]["message"]
