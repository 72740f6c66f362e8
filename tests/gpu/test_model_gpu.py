"""Whole tiny model on a GPU (CUDA graphs, real MLA) against the transformers oracle, bf16 and FP8.

Run on the device: VLLM_LING_GPU_RESULTS=$OUT python -m pytest tests/gpu -q. Skips without CUDA or vLLM.
Every engine configuration runs side by side in one go (each with a fixed KV cache), then one fp32 oracle and
one bf16 oracle per reference checkpoint score all their continuations:
  bf16 / int4           our model, BF16 checkpoint / INT4 experts (Marlin) vs the checkpoint dequantized by
                        compressed-tensors
  int4_triton           the same through vLLM's Triton/CUDA wna16 MoE kernels (what ling-tune tunes)
  bf16_fp8 / int4_fp8   `--quantization ling_fp8`: every BF16 linear and the LM head in FP8 (vllm_ling.fp8)
  bf16_intree           vLLM's in-tree model (vLLM >= 0.28) with our config class
  int4_intree_fp8       the same on the INT4 checkpoint with FP8
Criteria: relative logprob error <= 2e-2 over the top-20 of every prompt position (BF16 weights); >= 99% top-1
on *decided* positions (fp32 margin >= DECIDED nats); overall agreement no worse than the reference's own bf16
floor (BF16 weights) or than the same implementation's BF16-weight run by more than 1 point (FP8). The mean
|Δ prompt logprob| against the oracle is recorded beside the BF16 run's.

Top-1 on random weights: bf16 itself flips near-ties. The independent reference run in bf16 against its own
fp32 agrees on only ~96% of positions on this checkpoint (FINDINGS.md §1), so "99% of all positions" is below
bf16's floor; hence the decided-position criterion and the floor measured in the same run.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import DECIDED, DECIDED_AGREEMENT, PROMPT_LENGTHS, TOPK, model_prompts as _prompts  # noqa: E402
from gpu_helpers import GPU_ENV, record, run_scripts  # noqa: E402  (skips the module without CUDA)
from model_helpers import NO_CLAMPS  # noqa: E402  (on sys.path via gpu_helpers)

from vllm_ling import compat  # noqa: E402

TOKEN_BUDGET = 256
MAX_TOKENS = 32
FLOOR_SLACK = 0.005
FP8_SLACK = 0.01  # FP8 may cost at most 1 point of overall agreement against the same model in BF16
FP8 = {"quantization": "ling_fp8"}
OURS, INTREE = {"VLLM_LING_MODEL": "vllm-ling"}, {"VLLM_LING_MODEL": "vllm"}
MOE_FLAG = compat.has_intree_ling3()  # vLLM >= 0.28 honours --moe-backend for compressed-tensors INT4 experts


def _moe(backend: str) -> dict:
    return {"moe_backend": backend} if MOE_FLAG else {}


# name -> (checkpoint, environment, engine kwargs)
CONFIGS = {
    "bf16": ("bf16", OURS, {}),
    "int4": ("int4", OURS, _moe("marlin")),
    "int4_triton": ("int4", {**OURS, "VLLM_LING_MOE_BACKEND": "triton"}, _moe("triton")),
    "bf16_fp8": ("bf16", OURS, FP8),
    "int4_fp8": ("int4", OURS, {**_moe("marlin"), **FP8}),
}
if compat.has_intree_ling3():
    CONFIGS |= {"int4_humming": ("int4", OURS, _moe("humming")),
                "bf16_intree": ("bf16", INTREE, {}), "int4_intree": ("int4", INTREE, _moe("marlin")),
                "int4_intree_fp8": ("int4", INTREE, {**_moe("marlin"), **FP8})}
MOE_METHOD = {"marlin": "marlin", "humming": "humming", "triton": "wna16moemethod"}
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1 << 30}
IMPLEMENTATION = {"vllm-ling": "vllm_ling.model.BailingMoeV3ForCausalLM",
                  "vllm": "vllm.model_executor.models.bailing_moe_v3.BailingMoeV3ForCausalLM"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[dict, dict, dict]]:
    """name -> (engine run, its fp32 oracle scores, the bf16 oracle's scores of the same sequences)."""
    from vllm_ling.tiny import dequantize_checkpoint, ensure_tiny

    tmp = tmp_path_factory.mktemp("gpu-model")
    models = {"bf16": str(ensure_tiny(seed=0, variant="stable_router")),
              "int4": str(ensure_tiny(seed=0, int4=True, variant="stable_router"))}
    references = {"bf16": models["bf16"], "int4": str(dequantize_checkpoint(models["int4"], tmp / "dequantized"))}
    jobs, envs = [], {}
    for name, (ckpt, env, kwargs) in CONFIGS.items():
        jobs.append(("engine_runner.py", {
            "model": models[ckpt], "prompts": _prompts(), "max_tokens": MAX_TOKENS, "dtype": "bfloat16",
            "hf_overrides": NO_CLAMPS, "enforce_eager": False, "gpu_memory_utilization": SIDE_BY_SIDE[
                "gpu_memory_utilization"], "max_model_len": 2048, "max_num_batched_tokens": TOKEN_BUDGET,
            "max_num_seqs": 8, "prompt_topk": TOPK,
            "engine_kwargs": {"kv_cache_memory_bytes": SIDE_BY_SIDE["kv_cache_memory_bytes"], **kwargs},
        }, name))
        envs[name] = {**GPU_ENV, **env}
    engines = dict(zip(CONFIGS, run_scripts(jobs, tmp, envs=[envs[n] for n in CONFIGS])))
    oracle_jobs, order = [], []
    for ckpt, reference in references.items():
        names = [n for n, (c, _, _) in CONFIGS.items() if c == ckpt]
        order.append(names)
        score = [p + o["token_ids"] for n in names for p, o in zip(_prompts(), engines[n]["outputs"])]
        query = [[None] + [[int(t) for t in top] for top in o["prompt_topk"][1:]]
                 for n in names for o in engines[n]["outputs"]]
        oracle_jobs += [("oracle.py", {"model": reference, "prompts": [], "device": "cuda", "query": query,
                                       "score": score}, f"oracle-{ckpt}"),
                        ("oracle.py", {"model": reference, "prompts": [], "device": "cuda", "dtype": "bfloat16",
                                       "score": score}, f"oracle-{ckpt}-bf16")]
    scored = run_scripts(oracle_jobs, tmp)
    out, k = {}, len(_prompts())
    for names, fp32, low in zip(order, scored[0::2], scored[1::2]):
        for i, name in enumerate(names):
            out[name] = (engines[name], fp32["scored"][i * k:(i + 1) * k], low["scored"][i * k:(i + 1) * k])
    return out


def _agreement(pairs: list[tuple[int, int, float]]) -> tuple[float, float, int]:
    """(overall, on decided positions, number decided) for (ours, oracle's, oracle margin) triples."""
    decided = [(a, b) for a, b, m in pairs if m >= DECIDED]
    return (sum(a == b for a, b, _ in pairs) / len(pairs),
            sum(a == b for a, b in decided) / max(len(decided), 1), len(decided))


def _prompt_scores(engine: dict, oracle: list, floor: list) -> dict:
    ours, ref_bf16, deltas = [], [], []
    num = den = 0.0
    for n, out, ref, low in zip(PROMPT_LENGTHS, engine["outputs"], oracle, floor):
        for i in range(1, n):
            top = out["prompt_topk"][i]
            ours.append((int(max(top, key=top.get)), ref["argmax"][i], ref["margin"][i]))
            ref_bf16.append((low["argmax"][i], ref["argmax"][i], ref["margin"][i]))
            deltas.append(abs(out["prompt_logprobs"][i] - ref["logprobs"][i]))
            for t, want in zip(top, ref["lp_at"][i]):
                num += (top[t] - want) ** 2
                den += want**2
    (top1, decided, n_decided), (floor_top1, floor_decided, _) = _agreement(ours), _agreement(ref_bf16)
    return {"positions": len(ours), "top1_agreement": top1, "decided_positions": n_decided,
            "top1_agreement_decided": decided, "relative_logprob_error": (num / den) ** 0.5,
            "mean_abs_prompt_logprob_delta": sum(deltas) / len(deltas),
            "oracle_bf16_floor": {"top1_agreement": floor_top1, "top1_agreement_decided": floor_decided}}


@pytest.fixture(scope="module")
def scores(runs) -> dict[str, dict]:
    out = {name: _prompt_scores(*run) for name, run in runs.items()}
    for name, s in out.items():
        record(f"model_{name}_vs_oracle", s)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_requested_model_serves(runs, name):
    want = IMPLEMENTATION[CONFIGS[name][1]["VLLM_LING_MODEL"]]
    assert runs[name][0]["implementation"] == want


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("int4")])
def test_int4_experts_use_the_requested_kernels(runs, name):
    engine = runs[name][0]
    backend = CONFIGS[name][2].get("moe_backend") or CONFIGS[name][1].get("VLLM_LING_MOE_BACKEND", "marlin")
    assert engine.get("moe_method"), "engine_runner reported no MoE quant method"
    method = engine["moe_method"].lower()
    assert MOE_METHOD[backend] in method, engine["moe_method"]
    if backend == "triton":
        assert "marlin" not in method and "humming" not in method, engine["moe_method"]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_teacher_forced_top1_and_logprob_error(scores, name):
    s = scores[name]
    fp8 = "quantization" in CONFIGS[name][2]
    assert s["top1_agreement_decided"] >= DECIDED_AGREEMENT, \
        f"top-1 agreement {s['top1_agreement_decided']:.4f} on {s['decided_positions']} decided positions"
    if not fp8:
        assert s["relative_logprob_error"] <= 2e-2, f"relative logprob error {s['relative_logprob_error']:.3e}"
        floor = s["oracle_bf16_floor"]["top1_agreement"]
        assert s["top1_agreement"] >= min(0.99, floor - FLOOR_SLACK), \
            f"top-1 agreement {s['top1_agreement']:.4f}; the reference's own bf16 floor is {floor:.4f}"
    else:
        twin = scores[name.removesuffix("_fp8")]  # the same checkpoint and model with BF16 weights
        assert s["top1_agreement"] >= twin["top1_agreement"] - FP8_SLACK, \
            f"FP8 top-1 agreement {s['top1_agreement']:.4f} vs {twin['top1_agreement']:.4f} with BF16 weights"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_concurrent_greedy_decode_agrees_with_oracle(runs, name):
    engine, oracle, floor = runs[name]
    ours, ref_bf16 = [], []
    for n, out, ref, low in zip(PROMPT_LENGTHS, engine["outputs"], oracle, floor):
        for j, tok in enumerate(out["token_ids"]):
            ours.append((tok, ref["argmax"][n + j], ref["margin"][n + j]))
            ref_bf16.append((low["argmax"][n + j], ref["argmax"][n + j], ref["margin"][n + j]))
    (agree, decided, n_decided), (floor_agree, _, _) = _agreement(ours), _agreement(ref_bf16)
    record(f"model_{name}_decode", {"requests": len(PROMPT_LENGTHS), "tokens": len(ours), "agreement": agree,
                                    "decided_tokens": n_decided, "agreement_decided": decided,
                                    "oracle_bf16_floor": floor_agree})
    assert decided >= DECIDED_AGREEMENT, f"decode agreement {decided:.4f} on {n_decided} decided tokens"
    if "quantization" not in CONFIGS[name][2]:
        assert agree >= min(0.99, floor_agree - FLOOR_SLACK), f"decode agreement {agree:.4f}, floor {floor_agree:.4f}"


def test_long_prompt_exceeds_token_budget():
    assert max(PROMPT_LENGTHS) > 2 * TOKEN_BUDGET
