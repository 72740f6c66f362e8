"""End to end: `ling-bench` main() against the fake server, checked against what it was told to do."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench_fake_server import write_fake_nvidia_smi

from ling_bench.bench import SCHEMA, main

FAST = ["--sets", "code", "--num-prompts", "1", "--max-tokens", "8", "--warmup", "1", "--repeats", "2"]
STAT_KEYS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "completion_tokens", "chunks")


def _bench(server, tmp_path, *extra: str) -> dict:
    out = tmp_path / "results.json"
    assert main(["--base-url", server.url, *FAST, *extra, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_report_has_the_documented_schema(fake, tmp_path):
    report = _bench(fake(), tmp_path, "--sets", "code,long", "--long-tokens", "512")
    assert report["schema"] == SCHEMA
    assert set(report) == {"schema", "created", "duration_s", "server", "config", "token_count_source",
                           "error", "cases", "spec", "gpu_mem_peak_mib"}
    assert report["error"] is None
    assert report["server"] == {"base_url": report["server"]["base_url"], "model": "fake-ling",
                                "max_model_len": 32768, "endpoint": "/v1/completions"}
    assert report["config"]["sets"] == ["code", "long"] and report["config"]["long_tokens"] == [512]
    assert [c["name"] for c in report["cases"]] == ["code-0", "long-512"]
    for case in report["cases"]:
        for key in STAT_KEYS:
            assert set(case[key]) == {"median", "min", "max"}
            assert case[key]["min"] <= case[key]["median"] <= case[key]["max"]
        assert len(case["prompt_sha256"]) == 64 and isinstance(case["prompt_tokens"], int)
        assert case["output_tok_s"] > 0
        assert set(case["requests"][0]) == {"prompt_tokens", "completion_tokens", "chunks", "ttft_s",
                                            "prefill_tok_s", "decode_tok_s"}
    assert report["gpu_mem_peak_mib"] is None


def test_every_measured_request_decodes_max_tokens_in_fewer_chunks(fake, tmp_path):
    report = _bench(fake(tokens_per_chunk=4), tmp_path)
    for r in report["cases"][0]["requests"]:
        assert r["completion_tokens"] == 8 and r["chunks"] == 1 + 2  # 1 + ceil(7 / 4)


def test_warmup_requests_are_sent_but_neither_reported_nor_counted(fake, tmp_path):
    server = fake()
    report = _bench(server, tmp_path, "--warmup", "2", "--repeats", "3")
    assert len(server.state.bodies) == 2 + 3
    case = report["cases"][0]
    assert len(case["requests"]) == 3
    assert case["spec"]["num_draft_tokens"] == 3 * server.config.draft_tokens_per_request


def test_acceptance_matches_the_configured_counters(fake, tmp_path):
    server = fake(drafts_per_request=8, draft_tokens_per_request=24, accepted_per_request=15,
                  accepted_per_pos_per_request=(7, 5, 3))
    spec = _bench(server, tmp_path, "--sets", "code,prose")["spec"]
    assert spec["acceptance_rate"] == pytest.approx(15 / 24)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 15 / 8)
    assert spec["acceptance_rate_per_pos"] == pytest.approx([7 / 8, 5 / 8, 3 / 8])
    assert spec["num_drafts"] == 2 * 2 * 8  # 2 cases x 2 measured requests, counters started at 1000


def test_without_spec_counters_the_report_says_so(fake, tmp_path, capsys):
    report = _bench(fake(spec=False), tmp_path)
    assert report["spec"] is None and report["cases"][0]["spec"] is None
    assert "no draft tokens counted on /metrics" in capsys.readouterr().out


def test_concurrency_keeps_that_many_requests_in_flight(fake, tmp_path):
    server = fake(first_token_delay_s=0.2)
    report = _bench(server, tmp_path, "--concurrency", "3")
    assert server.state.max_in_flight == 3
    assert len(server.state.bodies) == (1 + 2) * 3 and len(report["cases"][0]["requests"]) == 2 * 3


def test_every_request_gets_a_fresh_cache_salt(fake, tmp_path):
    server = fake()
    _bench(server, tmp_path, "--concurrency", "2")
    salts = [b["cache_salt"] for b in server.state.bodies]
    assert len(salts) == len(set(salts)) == (1 + 2) * 2


def test_prefix_cache_flag_sends_no_salt(fake, tmp_path):
    server = fake()
    _bench(server, tmp_path, "--prefix-cache")
    assert all("cache_salt" not in b for b in server.state.bodies)


def test_same_seed_sends_identical_prompts_across_runs(fake, tmp_path):
    server = fake()
    args = ("--sets", "code,prose,long", "--long-tokens", "600", "--seed", "7")
    first, second = _bench(server, tmp_path, *args), _bench(server, tmp_path, *args)
    other = _bench(server, tmp_path, *args[:-1], "8")
    digests = [[c["prompt_sha256"] for c in r["cases"]] for r in (first, second, other)]
    assert digests[0] == digests[1]
    assert all(a != b for a, b in zip(digests[0], digests[2]))


def test_long_prompts_are_sized_by_the_server_tokenizer(fake, tmp_path):
    report = _bench(fake(), tmp_path, "--sets", "long", "--long-tokens", "1000,3000")
    assert report["token_count_source"] == "server"
    for case in report["cases"]:
        assert case["target_tokens"] - 40 < case["prompt_tokens"] <= case["target_tokens"]


def test_estimate_is_reported_when_the_server_cannot_tokenize(fake, tmp_path, capsys):
    report = _bench(fake(tokenize=False), tmp_path)
    assert report["token_count_source"] == "estimate"
    assert "estimate (~4 chars/token)" in capsys.readouterr().out


def test_markdown_table_has_one_row_per_case(fake, tmp_path, capsys):
    _bench(fake(), tmp_path, "--sets", "code,prose", "--num-prompts", "2")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["code-0", "code-1", "prose-0", "prose-1"]


def test_chat_mode_uses_the_chat_endpoint(fake, tmp_path):
    server = fake()
    report = _bench(server, tmp_path, "--chat")
    assert report["server"]["endpoint"] == "/v1/chat/completions"
    assert all("messages" in b for b in server.state.bodies)


def test_long_target_beyond_max_model_len_is_rejected_before_any_request(fake, capsys):
    server = fake(max_model_len=2048)
    rc = main(["--base-url", server.url, "--sets", "long", "--long-tokens", "1024,4096",
               "--max-tokens", "64"])
    assert rc == 1 and server.state.bodies == []
    err = capsys.readouterr().err
    assert "[4096]" in err and "max_model_len 2048" in err and "up to 1984" in err


def test_a_failing_case_keeps_the_finished_ones_and_exits_nonzero(fake, tmp_path, capsys):
    server = fake(reject_with="maximum context length is 1000 tokens", reject_over_tokens=1000)
    out = tmp_path / "results.json"
    rc = main(["--base-url", server.url, *FAST, "--sets", "code,long", "--long-tokens", "2000",
               "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 1 and [c["name"] for c in report["cases"]] == ["code-0"]
    assert report["error"].startswith("long-2000: warm-up: 1 of 1 requests failed")
    assert "the server says: POST /v1/completions -> HTTP 400" in report["error"]
    assert "maximum context length is 1000" in capsys.readouterr().err


def test_unknown_model_is_rejected_naming_the_served_ones(fake, capsys):
    server = fake()
    assert main(["--base-url", server.url, "--model", "other", *FAST]) == 1
    err = capsys.readouterr().err
    assert "--model 'other'" in err and "fake-ling" in err


def test_unreachable_server_is_a_clear_error(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", *FAST]) == 1
    assert "is the server up" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--sets", "code,poetry"], "poetry"),
    (["--max-tokens", "1"], "1 must be >= 2"),
    (["--long-tokens", "4096,100"], "100 must be >= 256"),
    (["--concurrency", "0"], "0 must be >= 1"),
])
def test_bad_arguments_name_the_value_and_the_rule(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_gpu_mem_flag_is_silent_without_nvidia_smi(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on this PATH
    report = _bench(fake(), tmp_path, "--gpu-mem")
    assert report["gpu_mem_peak_mib"] is None


def test_gpu_mem_flag_reports_the_peak_nvidia_smi_reading(fake, tmp_path, monkeypatch):
    write_fake_nvidia_smi(tmp_path, ["70000\n", "81234\n", "75000\n"])
    monkeypatch.setenv("PATH", str(tmp_path))
    report = _bench(fake(), tmp_path, "--gpu-mem")  # sampled at start and at the end at least
    assert report["gpu_mem_peak_mib"] == [81234]


def test_write_dataset_is_a_custom_dataset_vllm_reads_back(fake, tmp_path, capsys):
    """The file is read by vLLM's own CustomDataset (with the tiny checkpoint's tokenizer), not by us."""
    pytest.importorskip("pandas")  # vLLM's `bench` extra: its custom dataset reads JSONL with pandas
    from vllm.benchmarks.datasets import CustomDataset
    from vllm.tokenizers import get_tokenizer

    from ling_tools.tiny import ensure_tiny

    server, path = fake(), tmp_path / "ling.jsonl"
    args = ["--base-url", server.url, "--sets", "code,long", "--num-prompts", "2", "--long-tokens", "512",
            "--max-tokens", "64", "--write-dataset", str(path)]
    assert main(args) == 0 and server.state.bodies == []  # nothing measured
    assert "--dataset-name custom" in capsys.readouterr().out
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["name"] for r in rows] == ["code-0", "code-1", "long-512"]
    dataset = CustomDataset(dataset_path=str(path), disable_shuffle=True)
    samples = dataset.sample(tokenizer=get_tokenizer(str(ensure_tiny())), num_requests=3, output_len=None,
                             skip_chat_template=True)
    assert [s.prompt for s in samples] == [r["prompt"] for r in rows]
    assert [s.expected_output_len for s in samples] == [64, 64, 64]


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "ling_bench", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "--concurrency" in result.stdout
