"""Reading vLLM settings from a serve command's argv, with vLLM's own parser."""
import shlex
import subprocess
import sys

import pytest
from ling_watchdog.serve_args import ServeArgs, human_int, mask_argv, split_launcher

pytestmark = pytest.mark.usefixtures("vllm_parser")  # vLLM's parser, in-process

MTP1 = """'{"method":"mtp","num_speculative_tokens":1}'"""


def parse(cmd: str) -> ServeArgs:
    return ServeArgs.parse(shlex.split(cmd))


def test_the_shipped_recipe_is_read_in_full_by_vllms_parser():
    a = parse(f"vllm serve inclusionAI/Ling-3.0-flash-int4 --host 0.0.0.0 --port 8001 --max-model-len 131072 "
              f"--gpu-memory-utilization 0.72 --enable-chunked-prefill --max-num-batched-tokens 8192 "
              f"--speculative-config {MTP1} --enable-auto-tool-choice --tool-call-parser ling3")
    assert a.parser.startswith("vLLM 0.") and a.error is None
    assert a.model == "inclusionAI/Ling-3.0-flash-int4"
    assert (a.host, a.port, a.max_model_len, a.util) == ("127.0.0.1", 8001, 131072, 0.72)
    assert (a.chunked_prefill, a.max_batched_tokens, a.spec_tokens) == (True, 8192, 1)
    assert a.values["tool_call_parser"] == "ling3" and a.values["enable_auto_tool_choice"] is True


def test_the_api_server_launcher_takes_the_model_from_the_model_flag():
    a = parse("python3 -m vllm.entrypoints.openai.api_server --model /models/ling --port=9000")
    assert (a.model, a.port) == ("/models/ling", 9000)
    assert a.launcher == ("python3", "-m", "vllm.entrypoints.openai.api_server")


@pytest.mark.parametrize("cmd, k", [
    ("vllm serve m -sc '{\"method\":\"mtp\",\"num_speculative_tokens\":3}'", 3),
    ("vllm serve m --speculative_config.num_speculative_tokens 2", 2),
    ("vllm serve m --speculative-config '{\"method\":\"mtp\"}'", 1),  # vLLM takes the draft's own layer count
    ("vllm serve m", 0),
])
def test_speculative_tokens_in_all_spellings(cmd, k):
    assert parse(cmd).spec_tokens == k


def test_a_flag_vllm_knows_takes_no_value_when_vllm_says_so():
    """The hand-written parser took /m as --async-scheduling's value; vLLM knows it is a boolean."""
    a = parse("vllm serve --async-scheduling /m --max-model-len -1 --no-enable-chunked-prefill --enforce-eager")
    assert a.model == "/m" and a.max_model_len is None and not a.chunked_prefill and a.enforce_eager
    assert a.values["async_scheduling"] is True


@pytest.mark.parametrize("text, n", [("131072", 131072), ("128K", 131072), ("128k", 128000), ("1M", 1 << 20),
                                     ("2T", 2 << 40), ("1.5g", 1_500_000_000)])
def test_human_readable_token_counts_follow_vllm(text, n):
    assert human_int(text) == n
    assert parse(f"vllm serve m --max-model-len {text}").max_model_len == n  # vLLM's own reading agrees


@pytest.mark.parametrize("cmd, says", [
    ("vllm serve m --speculative-config '{mtp'", "speculative"),
    ("vllm serve m --max-model-len lots", "lots"),
    ("vllm serve m --port x", "argument --port: invalid int value: 'x'"),
    ("vllm serve m --no-such-flag 3", "unrecognized arguments: --no-such-flag"),
    ("vllm serve m --enable-auto-tool-choice", "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_arguments_vllm_refuses_carry_vllms_own_message(cmd, says):
    a = parse(cmd)
    assert a.error is not None and says in a.error


def test_probe_address_and_served_name_follow_the_command():
    a = parse("vllm serve /models/ling --host :: --served-model-name ling-flash")
    assert (a.host, a.served_model) == ("127.0.0.1", "ling-flash")
    assert parse("vllm serve m --host ::1").host == "[::1]" and parse("vllm serve m").served_model == "m"


def test_the_api_key_comes_from_the_flag_first_then_vllms_env_var():
    assert parse("vllm serve m --api-key k1").api_key({"VLLM_API_KEY": "env"}) == "k1"
    assert parse("vllm serve m").api_key({"VLLM_API_KEY": "env"}) == "env"
    assert parse("vllm serve m").api_key({}) is None
    assert sorted(parse("vllm serve m --api-key k1 --hf-token t").secrets({"VLLM_API_KEY": "e"})) == ["e", "k1", "t"]


def test_secret_flags_are_masked_in_both_spellings():
    cmd = shlex.split("vllm serve m --api-key k1 k2 --hf_token=t --port 1")
    assert mask_argv(cmd) == ["vllm", "serve", "m", "--api-key", "***", "***", "--hf_token=***", "--port", "1"]


def test_a_launcher_that_is_not_vllms_is_read_by_the_minimal_parser_and_says_so():
    launcher, args = split_launcher(["python3", "fake_vllm.py", "serve", "fake-model", "--fake-mode", "x"])
    assert launcher.python is None and args[0] == "fake-model"
    a = parse("python3 fake_vllm.py serve fake-model --fake-mode clean --port 9 --api-key=zz --max-model-len 8k")
    assert a.minimal and "not vLLM's" in a.parser
    assert (a.model, a.port, a.api_key({}), a.max_model_len) == ("fake-model", 9, "zz", 8000)


@pytest.mark.parametrize("how", ["vLLM", "minimal"])
def test_the_multi_node_flags_read_the_same_by_vllms_parser_and_the_minimal_one(how):
    flags = "-tp 2 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --headless"
    cmd = f"vllm serve m {flags}" if how == "vLLM" else f"python3 fake_vllm.py serve m {flags}"
    a = parse(cmd)
    assert a.minimal == (how == "minimal")
    assert (a.parallel, a.nnodes, a.node_rank, a.master_addr, a.headless) == ((2, 1, 1), 2, 1, "10.0.0.1", True)
    d = parse(cmd.removesuffix(flags))
    assert (d.parallel, d.nnodes, d.node_rank, d.master_addr, d.headless) == ((1, 1, 1), 1, 0, "127.0.0.1", False)


def test_the_watchdog_parses_in_a_subprocess_and_never_imports_vllm_itself():
    """Importing vLLM costs ~10 s and ~650 MB and rewrites os.environ: not in a supervisor's process."""
    code = ("import sys; from ling_watchdog.serve_args import ServeArgs; "
            "a = ServeArgs.parse(['vllm', 'serve', '--async-scheduling', '/m', '--max_model_len', '4k']); "
            "print(a.parser, a.model, a.max_model_len, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600).stdout.split()
    assert out[0] == "vLLM" and out[2:] == ["/m", "4000", "False", "False"], out
