"""The CPU engine serving the INT4 tiny checkpoint with `--quantization ling_fp8`, in each scale scheme: the layers
it quantizes, and its numbers against the plain-torch reference of that scheme (oracle.py `fp8_scheme`).

The expected sets are written here from the tiny config (6 layers, MLA at 2 and 5, a dense MLP at 0), not
read from the code under test: every KDA/MLA projection but kv_b, the dense MLP, the shared experts and the
LM head in FP8; the routed experts INT4 (compressed-tensors); kv_b, MLA's head-wise gate g_proj (4 outputs: not
a multiple of 16), the fp32 router and the embedding as they were. Every FP8 linear of the tiny model reads 128,
256 or 512 inputs, so the block scheme takes the same set.

Numbers: each engine (fp32 activations, so FP8's rounding is the only approximation) is scored teacher-forced
against the reference of its own scheme: top-1 agreement on decided positions (reference margin >= DECIDED nats)
and the mean |delta logprob| of the prompt tokens. The channel engine's distance to its own reference is the bar:
the block engine may be no farther from its own (TOP1_SLACK points, LOGPROB_FACTOR x), and must be nearer to
its own reference than to the channel one (a scheme wired to the wrong rounding shows there).
"""

from __future__ import annotations

import pytest

from model_helpers import FP8_MERGED, NO_CLAMPS, random_prompts, run_scripts
from shared_engines import Engine, declare

from vllm_ling.fp8 import SCHEME_ENV

pytestmark = pytest.mark.engine

KDA, MLA = (0, 1, 3, 4), (2, 5)
SCHEMES = ("channel", "block")
METHOD = {"channel": "Fp8W8A8LinearMethod", "block": "Fp8BlockLinearMethod"}
LENGTHS = [9, 63, 130]
DECIDED = 0.2  # nats
TOP1_SLACK = 0.01
LOGPROB_FACTOR = 1.5


def expected_fp8() -> set[str]:
    names = {f"model.layers.{i}.self_attn.{p}" for i in KDA for p in ("in_proj", "o_proj")}
    names |= {f"model.layers.{i}.self_attn.{p}" for i in MLA for p in ("q_proj", "kv_a_proj_with_mqa", "dense")}
    names |= {f"model.layers.0.mlp.{p}" for p in ("gate_up_proj", "down_proj")}
    names |= {f"model.layers.{i}.mlp.shared_experts.{p}" for i in range(1, 6) for p in ("gate_up_proj", "down_proj")}
    return names | {"lm_head"}


@pytest.fixture(scope="module")
def checkpoint() -> str:
    from ling_tools.tiny import ensure_tiny

    return str(ensure_tiny(int4=True))


ENGINE = {"dtype": "float32", "hf_overrides": NO_CLAMPS, "max_model_len": 512, "max_num_batched_tokens": 512,
          "engine_kwargs": {"quantization": "ling_fp8"}}
RUNS = {s: declare(Engine(f"fp8-int4-{s}", tiny={"int4": True}, settings=ENGINE, env={SCHEME_ENV: s}), "fp8-engine",
                   prompts=random_prompts(LENGTHS, seed=11), max_tokens=4, prompt_topk=1, quant_methods=True,
                   log_lines=True) for s in SCHEMES}


@pytest.fixture(scope="module")
def engines(shared_engine):
    return {s: shared_engine(RUNS[s]) for s in SCHEMES}


@pytest.fixture(scope="module")
def references(checkpoint, tmp_path_factory):
    """The reference of each scheme, scoring the prompts (ours serves the CPU engine: its merged layout), on the
    checkpoint dequantized by compressed-tensors (what the CPU engine computes its INT4 experts from); the two run
    at once."""
    from ling_tools.tiny import dequantize_checkpoint

    tmp = tmp_path_factory.mktemp("oracle-fp8")
    bf16 = dequantize_checkpoint(checkpoint, tmp / "bf16")
    job = {"model": str(bf16), "prompts": [], "score": random_prompts(LENGTHS, seed=11), "fp8": "w8a8",
           "fp8_merged": FP8_MERGED["vllm-ling"]}
    runs = run_scripts([("oracle.py", {**job, "fp8_scheme": s}, f"oracle-fp8-int4-{s}") for s in SCHEMES], tmp)
    return {s: run["scored"] for s, run in zip(SCHEMES, runs)}


def distance(engine: dict, reference: list[dict]) -> dict:
    """Top-1 agreement on decided positions and mean |delta logprob| of the prompt tokens, engine vs reference."""
    agree, deltas = [], []
    for n, out, ref in zip(LENGTHS, engine["outputs"], reference):
        for i in range(1, n):
            deltas.append(abs(out["prompt_logprobs"][i] - ref["logprobs"][i]))
            if ref["margin"][i] >= DECIDED:
                top = out["prompt_topk"][i]
                agree.append(int(max(top, key=top.get)) == ref["argmax"][i])
    return {"top1_decided": sum(agree) / len(agree), "decided": len(agree), "logprob": sum(deltas) / len(deltas)}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_bf16_linear_and_the_lm_head_get_fp8(engines, scheme):
    methods = engines[scheme]["quant_methods"]
    assert {n for n, m in methods.items() if "Fp8" in m} == expected_fp8()
    assert {methods[n] for n in expected_fp8()} == {METHOD[scheme]}


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_start_up_line_counts_each_fp8_linear_once(engines, scheme):
    """`FP8 weights ON (N linears + LM head), w8a8, <scheme> scales`, as the self-check reads it from the engine's
    own log: N is the number of linears above, each built once (a layer that built a linear twice under one prefix
    would count it twice and still pass the set comparison)."""
    from ling_tools.selfcheck import Requested, inspect_log

    log = "\n".join(engines[scheme]["log_lines"])
    fp8 = next(v for v in inspect_log(log, Requested(fp8=True)) if v.name == "FP8 weights")
    assert fp8.on and fp8.why.startswith(f"({len(expected_fp8()) - 1} linears + LM head)"), fp8
    assert f"w8a8, {scheme} scales" in log


def test_routed_experts_stay_int4_and_kv_b_gate_router_embedding_stay_as_they_were(engines):
    """On the CPU engine the routed experts are ours (INT4 dequantized at load): no quant method, no FP8."""
    m = engines["block"]["quant_methods"]
    assert not any(".mlp.experts" in name for name in m)
    assert all(m[f"model.layers.{i}.self_attn.{p}"] == "UnquantizedLinearMethod" for i in MLA
               for p in ("kv_b_proj", "g_proj"))
    assert all(m[f"model.layers.{i}.mlp.gate"] == "UnquantizedLinearMethod" for i in range(1, 6))
    assert m["model.embed_tokens"] == "UnquantizedEmbeddingMethod"
    assert len(engines["block"]["outputs"][0]["token_ids"]) == 4


def test_the_block_engine_matches_its_reference_as_the_channel_engine_matches_its_own(engines, references):
    channel = distance(engines["channel"], references["channel"])
    block = distance(engines["block"], references["block"])
    crossed = distance(engines["block"], references["channel"])
    assert block["top1_decided"] >= channel["top1_decided"] - TOP1_SLACK, (block, channel)
    assert block["logprob"] <= LOGPROB_FACTOR * channel["logprob"] + 1e-4, (block, channel)
    assert block["logprob"] < crossed["logprob"] / 2, ("the block engine is no nearer its own reference", block,
                                                       crossed)
