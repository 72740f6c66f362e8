"""Reading vLLM settings from a serve command's argv."""
import shlex

import pytest
from ling_watchdog.serve_args import ServeArgs, human_int

MTP1 = """'{"method":"mtp","num_speculative_tokens":1}'"""


def parse(cmd: str) -> ServeArgs:
    return ServeArgs.parse(shlex.split(cmd))


def test_the_shipped_recipe_is_read_in_full():
    a = parse(f"vllm serve inclusionAI/Ling-3.0-flash-int4 --host 0.0.0.0 --port 8001 --max-model-len 131072 "
              f"--gpu-memory-utilization 0.72 --enable-chunked-prefill --max-num-batched-tokens 8192 "
              f"--speculative-config {MTP1} --enable-auto-tool-choice --tool-call-parser ling3")
    assert a.model == "inclusionAI/Ling-3.0-flash-int4"
    assert (a.host, a.port, a.max_model_len, a.util) == ("127.0.0.1", 8001, 131072, 0.72)
    assert (a.chunked_prefill, a.max_batched_tokens, a.spec_tokens) == (True, 8192, 1)
    assert a.flags["--tool-call-parser"] == "ling3" and a.flags["--enable-auto-tool-choice"] is None


def test_the_api_server_launcher_takes_the_model_from_the_model_flag():
    a = parse("python3 -m vllm.entrypoints.openai.api_server --model /models/ling --port=9000")
    assert (a.model, a.port) == ("/models/ling", 9000)


@pytest.mark.parametrize("cmd, k", [
    ("vllm serve m -sc '{\"method\":\"mtp\",\"num_speculative_tokens\":3}'", 3),
    ("vllm serve m --speculative_config.num_speculative_tokens 2", 2),
    ("vllm serve m", 0),
])
def test_speculative_tokens_in_all_spellings(cmd, k):
    assert parse(cmd).spec_tokens == k


def test_boolean_flags_do_not_swallow_the_model():
    a = parse("vllm serve --enforce-eager m --max-model-len -1 --no-enable-chunked-prefill")
    assert a.model == "m" and a.max_model_len is None and not a.chunked_prefill and a.has("--enforce-eager")


@pytest.mark.parametrize("text, n", [("131072", 131072), ("128K", 131072), ("128k", 128000), ("1M", 1 << 20),
                                     ("2T", 2 << 40)])
def test_human_readable_token_counts_follow_vllm(text, n):
    assert human_int(text) == n


def test_bad_values_name_the_flag():
    with pytest.raises(ValueError, match="--speculative-config .* is not JSON"):
        _ = parse("vllm serve m --speculative-config '{mtp'").spec_tokens
    with pytest.raises(ValueError, match="'lots' is not a count"):
        _ = parse("vllm serve m --max-model-len lots").max_model_len


def test_probe_address_and_served_name_follow_the_command():
    a = parse("vllm serve /models/ling --host :: --served-model-name ling-flash")
    assert (a.host, a.served_model) == ("127.0.0.1", "ling-flash")
    assert parse("vllm serve m --host ::1").host == "[::1]" and parse("vllm serve m").served_model == "m"
