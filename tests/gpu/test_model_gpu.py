"""Whole tiny model on a GPU (vLLM 0.26, CUDA graphs, real MLA) against the transformers oracle, bf16.

Run on the device: VLLM_LING_GPU_RESULTS=$OUT python -m pytest tests/gpu -q. Skips without CUDA or vLLM.
Criteria (issue #5): relative logprob error <= 2e-2 over every prompt position; teacher-forced top-1
agreement >= 99%; a prompt longer than --max-num-batched-tokens (chunked prefill carries KDA state);
8 concurrent requests of different lengths.

Top-1 on random weights: bf16 itself flips near-ties. The independent reference run in bf16 against its own
fp32 agrees on only ~96% of positions on this checkpoint (CPU, FINDINGS.md §1), so "99% of all positions" is
below bf16's floor here. The test therefore measures that floor in the same run (the oracle in bf16 on the
same GPU) and asserts: >= 99% agreement on *decided* positions (the fp32 oracle's top-1/top-2 margin
>= DECIDED nats, about 5x bf16's median logprob error), and overall agreement no worse than the reference's
own bf16 floor. Greedy decode is judged the same way, token by token, on the engine's own continuation.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from criteria import DECIDED, DECIDED_AGREEMENT, PROMPT_LENGTHS, TOPK, model_prompts as _prompts  # noqa: E402
from gpu_helpers import GPU_ENV, record, run_script  # noqa: E402  (skips the module without CUDA)
from model_helpers import NO_CLAMPS  # noqa: E402  (on sys.path via gpu_helpers)

TOKEN_BUDGET = 256
MAX_TOKENS = 32
FLOOR_SLACK = 0.005


@pytest.fixture(scope="module", params=["bf16", "int4", "int4_triton"])
def runs(request, tmp_path_factory):
    """bf16: the BF16 checkpoint. int4: the INT4 checkpoint (Marlin W4A16 experts) against the oracle on
    the same checkpoint dequantized to BF16 by compressed-tensors. int4_triton: the same through vLLM's
    Triton/CUDA wna16 fused-MoE kernels (VLLM_LING_MOE_BACKEND=triton), the path ling-tune tunes."""
    from vllm_ling.tiny import dequantize_checkpoint, ensure_tiny

    tmp = tmp_path_factory.mktemp(f"gpu-{request.param}")
    int4 = request.param.startswith("int4")
    model = str(ensure_tiny(seed=0, int4=int4, variant="stable_router"))
    reference = str(dequantize_checkpoint(model, tmp / "dequantized")) if int4 else model
    env = {**GPU_ENV, "VLLM_LING_MOE_BACKEND": "triton" if request.param == "int4_triton" else "marlin"}
    engine = run_script("engine_runner.py", {
        "model": model, "prompts": _prompts(), "max_tokens": MAX_TOKENS, "dtype": "bfloat16",
        "hf_overrides": NO_CLAMPS, "enforce_eager": False, "gpu_memory_utilization": 0.3,
        "max_model_len": 2048, "max_num_batched_tokens": TOKEN_BUDGET, "max_num_seqs": 8, "prompt_topk": TOPK,
    }, tmp, "engine", env)
    queries = [[None] + [[int(t) for t in top] for top in o["prompt_topk"][1:]] for o in engine["outputs"]]
    oracle = run_script("oracle.py", {
        "model": reference, "prompts": [], "device": "cuda", "query": queries,
        "score": [p + o["token_ids"] for p, o in zip(_prompts(), engine["outputs"])],
    }, tmp, "oracle")
    floor = run_script("oracle.py", {  # the same reference in bf16: how often bf16 alone flips the argmax
        "model": reference, "prompts": [], "device": "cuda", "dtype": "bfloat16",
        "score": [p + o["token_ids"] for p, o in zip(_prompts(), engine["outputs"])],
    }, tmp, "oracle_bf16")
    return request.param, engine, oracle, floor


def _agreement(pairs: list[tuple[int, int, float]]) -> tuple[float, float, int]:
    """(overall, on decided positions, number decided) for (ours, oracle's, oracle margin) triples."""
    decided = [(a, b) for a, b, m in pairs if m >= DECIDED]
    return (sum(a == b for a, b, _ in pairs) / len(pairs),
            sum(a == b for a, b in decided) / max(len(decided), 1), len(decided))


def test_plugin_model_serves_on_gpu(runs):
    assert runs[1]["implementation"] == "vllm_ling.model.BailingMoeV3ForCausalLM"


def test_int4_experts_use_the_requested_kernels(runs):
    name, engine = runs[0], runs[1]
    if name.startswith("int4"):
        assert engine.get("moe_method"), "engine_runner reported no MoE quant method"
        assert ("Marlin" in engine["moe_method"]) == (name == "int4"), engine["moe_method"]


def test_teacher_forced_top1_and_logprob_error(runs):
    name, engine, oracle, floor = runs
    ours, ref_bf16 = [], []
    num = den = 0.0
    for n, out, ref, low in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"], floor["scored"]):
        for i in range(1, n):
            top = out["prompt_topk"][i]
            ours.append((int(max(top, key=top.get)), ref["argmax"][i], ref["margin"][i]))
            ref_bf16.append((low["argmax"][i], ref["argmax"][i], ref["margin"][i]))
            for t, want in zip(top, ref["lp_at"][i]):
                num += (top[t] - want) ** 2
                den += want**2
    (top1, decided, n_decided), (floor_top1, floor_decided, _) = _agreement(ours), _agreement(ref_bf16)
    rel = (num / den) ** 0.5
    record(f"model_{name}_vs_oracle", {
        "positions": len(ours), "top1_agreement": top1, "decided_positions": n_decided,
        "top1_agreement_decided": decided, "relative_logprob_error": rel,
        "oracle_bf16_floor": {"top1_agreement": floor_top1, "top1_agreement_decided": floor_decided}})
    assert rel <= 2e-2, f"relative logprob error {rel:.3e}"
    assert decided >= DECIDED_AGREEMENT, f"top-1 agreement {decided:.4f} on {n_decided} decided positions"
    assert top1 >= min(0.99, floor_top1 - FLOOR_SLACK), \
        f"top-1 agreement {top1:.4f} over {len(ours)} positions; the reference's own bf16 floor is {floor_top1:.4f}"


def test_concurrent_greedy_decode_agrees_with_oracle(runs):
    name, engine, oracle, floor = runs
    ours, ref_bf16 = [], []
    for n, out, ref, low in zip(PROMPT_LENGTHS, engine["outputs"], oracle["scored"], floor["scored"]):
        for j, tok in enumerate(out["token_ids"]):
            ours.append((tok, ref["argmax"][n + j], ref["margin"][n + j]))
            ref_bf16.append((low["argmax"][n + j], ref["argmax"][n + j], ref["margin"][n + j]))
    (agree, decided, n_decided), (floor_agree, _, _) = _agreement(ours), _agreement(ref_bf16)
    record(f"model_{name}_decode", {"requests": len(PROMPT_LENGTHS), "tokens": len(ours), "agreement": agree,
                                    "decided_tokens": n_decided, "agreement_decided": decided,
                                    "oracle_bf16_floor": floor_agree})
    assert decided >= DECIDED_AGREEMENT, f"decode agreement {decided:.4f} on {n_decided} decided tokens"
    assert agree >= min(0.99, floor_agree - FLOOR_SLACK), f"decode agreement {agree:.4f}, floor {floor_agree:.4f}"


def test_long_prompt_exceeds_token_budget():
    assert max(PROMPT_LENGTHS) > 2 * TOKEN_BUDGET
