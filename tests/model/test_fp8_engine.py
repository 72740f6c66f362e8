"""The CPU engine serving the INT4 tiny checkpoint with `--quantization ling_fp8`: the layers it quantizes.

The expected sets are written here from the tiny config (6 layers, MLA at 2 and 5, a dense MLP at 0), not
read from the code under test: every KDA/MLA projection but kv_b, the dense MLP, the shared experts and the
LM head in FP8; the routed experts INT4 (compressed-tensors); kv_b, MLA's head-wise gate g_proj (4 outputs: not
a multiple of 16), the fp32 router and the embedding as they were.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine

KDA, MLA = (0, 1, 3, 4), (2, 5)


def expected_fp8() -> set[str]:
    names = {f"model.layers.{i}.self_attn.{p}" for i in KDA for p in ("in_proj", "o_proj")}
    names |= {f"model.layers.{i}.self_attn.{p}" for i in MLA for p in ("q_proj", "kv_a_proj_with_mqa", "dense")}
    names |= {f"model.layers.0.mlp.{p}" for p in ("gate_up_proj", "down_proj")}
    names |= {f"model.layers.{i}.mlp.shared_experts.{p}" for i in range(1, 6) for p in ("gate_up_proj", "down_proj")}
    return names | {"lm_head"}


@pytest.fixture(scope="module")
def methods(run_engine, tmp_path_factory):
    from vllm_ling.tiny import ensure_tiny

    spec = {"model": str(ensure_tiny(int4=True)), "prompts": [[5, 6, 7, 8]], "max_tokens": 4, "dtype": "bfloat16",
            "prompt_logprobs": False, "quant_methods": True, "log_lines": True,
            "engine_kwargs": {"quantization": "ling_fp8"}}
    return run_engine(spec, "fp8-int4")


def test_every_bf16_linear_and_the_lm_head_get_fp8(methods):
    fp8 = {n for n, m in methods["quant_methods"].items() if "Fp8" in m}
    assert fp8 == expected_fp8()


def test_the_start_up_line_counts_each_fp8_linear_once(methods):
    """`FP8 weights ON (N linears + LM head)`, as the self-check reads it from the engine's own log: N is the number
    of linears above, each built once (a layer that built a linear twice under one prefix would count it twice and
    still pass the set comparison)."""
    from vllm_ling.selfcheck import Requested, inspect_log

    fp8 = next(v for v in inspect_log("\n".join(methods["log_lines"]), Requested(fp8=True)) if v.name == "FP8 weights")
    assert fp8.on and fp8.why.startswith(f"({len(expected_fp8()) - 1} linears + LM head)"), fp8


def test_routed_experts_stay_int4_and_kv_b_gate_router_embedding_stay_as_they_were(methods):
    """On the CPU engine the routed experts are ours (INT4 dequantized at load): no quant method, no FP8."""
    m = methods["quant_methods"]
    assert not any(".mlp.experts" in name for name in m)
    assert all(m[f"model.layers.{i}.self_attn.{p}"] == "UnquantizedLinearMethod" for i in MLA
               for p in ("kv_b_proj", "g_proj"))
    assert all(m[f"model.layers.{i}.mlp.gate"] == "UnquantizedLinearMethod" for i in range(1, 6))
    assert m["model.embed_tokens"] == "UnquantizedEmbeddingMethod"
    assert len(methods["outputs"][0]["token_ids"]) == 4
