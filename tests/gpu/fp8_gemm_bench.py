"""BF16 vs FP8 W8A16 (Marlin) vs W8A8 (per-token, vLLM's scaled-mm), for every BF16 linear of Ling-3.0-flash.

    python3 tests/gpu/fp8_gemm_bench.py MODEL_DIR OUT.json [--m 1,2,4,8,16]

MODEL_DIR holds the full-size config.json (`ling-make-tiny DIR --full-config`). Each layer is built the way
the engine builds it (vLLM's ReplicatedLinear with `vllm_ling.fp8.LingFp8Config` for the FP8 kernels, no quant
config for BF16) and timed inside a CUDA graph that calls enough copies of it (different weights) to stream more
than 4x the L2 cache, so each call reads its weight from HBM as a decode step does; median of 5 replays. The
per-step column weights each shape by how often one decode step runs it (35 KDA, 7 MLA, 40 shared experts,
2 dense MLPs, 1 LM head). Also reports each kernel's max relative error against the BF16 product, and KDA's
merged in_proj (q|k|v|β|f|g, one GEMM) against the three GEMMs it replaced (q|k|v|β, f, g), per KDA layer.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

L2_BYTES = 60 * 2**20
KERNELS = ("bf16", "w8a16", "w8a8")


def shapes(c: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (out, in, calls per decode step), from config.json."""
    h, heads, d = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
    p = heads * d
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    mla = sum((i + 1) % c["layer_group_size"] == 0 for i in range(c["num_hidden_layers"]))
    kda = c["num_hidden_layers"] - mla
    moe = c["num_hidden_layers"] - c["first_k_dense_replace"]
    shared = c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    return {
        "kda.in_proj": (5 * p + heads, h, kda), "kda.o_proj": (h, p, kda),
        "mla.q_proj": (heads * qk, h, mla), "mla.kv_a_proj": (c["kv_lora_rank"] + c["qk_rope_head_dim"], h, mla),
        "mla.g_proj": (heads, h, mla), "mla.dense": (h, heads * c["v_head_dim"], mla),
        "shared.gate_up_proj": (2 * shared, h, moe), "shared.down_proj": (h, shared, moe),
        "dense.gate_up_proj": (2 * c["intermediate_size"], h, c["first_k_dense_replace"]),
        "dense.down_proj": (h, c["intermediate_size"], c["first_k_dense_replace"]),
        "lm_head": (c["vocab_size"], h, 1),
    }


def kda_split(c: dict) -> list[tuple[int, int]]:
    """The (out, in) shapes KDA's in_proj replaced: q|k|v|β, f, g."""
    h, p = c["hidden_size"], c["num_attention_heads"] * c["head_dim"]
    return [(3 * p + c["num_attention_heads"], h), (p, h), (p, h)]


def copies_for(out_f: int, in_f: int) -> int:
    """How many copies of an [out_f, in_f] layer stream > 4x the L2 cache in BF16 (at most 16)."""
    return min(16, max(1, math.ceil(4 * L2_BYTES / (out_f * in_f * 2))))


def build(out_f: int, in_f: int, kernel: str | None, copies: int, device: str = "cuda") -> list[torch.nn.Module]:
    """`copies` layers as the engine builds them (under the target device, online FP8 quantized when loaded)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from vllm_ling.fp8 import LingFp8Config

    layers = []
    with torch.device(device):
        for i in range(copies):
            cfg = LingFp8Config(kernel=kernel) if kernel else None
            layer = ReplicatedLinear(in_f, out_f, bias=False, quant_config=cfg, prefix=f"model.layers.{i}.proj")
            w = torch.randn(out_f, in_f, dtype=torch.bfloat16) / in_f**0.5
            layer.weight.weight_loader(layer.weight, w)
            if kernel is None:
                layer.quant_method.process_weights_after_loading(layer)
            layer.reference = w
            layers.append(layer)
    return layers


def time_graph(layers: list[torch.nn.Module], m: int) -> tuple[float, float]:
    """(microseconds per call, max relative error vs the layer's BF16 weight)."""
    from gpu_helpers import graph_us  # beside this script; a CUDA-only import (--cpu-smoke never gets here)

    xs = [torch.randn(m, layers[0].input_size, dtype=torch.bfloat16, device="cuda") for _ in layers]
    outs = [layer(x)[0] for layer, x in zip(layers, xs)]  # warm-up, JIT
    err = max(((o.float() - x.float() @ layer.reference.float().t()).abs().max()
               / (x.float() @ layer.reference.float().t()).abs().max()).item() for o, x, layer in zip(outs, xs, layers))

    def calls():
        for layer, x in zip(layers, xs):
            layer(x)
    return graph_us(calls, len(layers)), err


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--cpu-smoke", action="store_true", help="build each layer once on the CPU and run it (no timing)")
    a = ap.parse_args()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ling.fp8  # noqa: F401  registers the config

    config = json.load(open(f"{a.model}/config.json"))
    vc = EngineArgs(model=a.model, dtype="bfloat16", skip_tokenizer_init=True, load_format="dummy",
                    enable_prefix_caching=False).create_engine_config()
    ms = [int(x) for x in a.m.split(",")]
    result = {"m": ms, "layers": {}, "per_step_us": {}}
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29533",
                                     local_rank=0, backend="gloo" if a.cpu_smoke else "nccl")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        if a.cpu_smoke:
            for kernel in (None, "w8a16", "w8a8"):
                layer = build(64, 256, kernel, 1, device="cpu")[0]
                x = torch.randn(2, 256)
                err = (layer(x)[0].float() - x.float() @ layer.reference.float().t()).abs().max().item()
                print(kernel, type(getattr(layer.quant_method, "fp8_linear", layer.quant_method)).__name__, err)
            return 0
        for name, (out_f, in_f, calls) in shapes(config).items():
            copies = copies_for(out_f, in_f)
            row = {"out": out_f, "in": in_f, "calls_per_step": calls, "copies": copies}
            for kernel in KERNELS:
                try:
                    layers = build(out_f, in_f, None if kernel == "bf16" else kernel, copies)
                    row[kernel] = {"kernel": type(getattr(layers[0].quant_method, "fp8_linear",
                                                          layers[0].quant_method)).__name__}
                    for m in ms:
                        us, err = time_graph(layers, m)
                        row[kernel][str(m)] = {"us": us, "max_rel_err": err}
                    del layers
                    torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001 - a kernel that cannot run is a result
                    row[kernel] = {"error": f"{type(e).__name__}: {e}"[:300]}
            result["layers"][name] = row
            print(name, {k: {m: round(v[m]["us"], 1) for m in map(str, ms)} if "error" not in v else v["error"]
                         for k, v in row.items() if k in KERNELS}, flush=True)
        split = {}  # µs per KDA layer for the three GEMMs in_proj replaced, to set beside its own row
        for kernel in ("bf16", "w8a8"):
            try:
                times = {str(m): 0.0 for m in ms}
                for out_f, in_f in kda_split(config):
                    layers = build(out_f, in_f, None if kernel == "bf16" else kernel, copies_for(out_f, in_f))
                    for m in ms:
                        times[str(m)] += time_graph(layers, m)[0]
                    del layers
                    torch.cuda.empty_cache()
                split[kernel] = times
            except Exception as e:  # noqa: BLE001 - recorded, the rest of the run stands
                print(f"kda split {kernel}: {type(e).__name__}: {e}"[:300], flush=True)
        merged = result["layers"]["kda.in_proj"]
        result["kda_in_proj_merged_vs_split_us"] = {
            k: {m: {"merged": merged[k][m]["us"], "split": t} for m, t in times.items()}
            for k, times in split.items() if "error" not in merged[k]}
        print("kda in_proj merged vs split:", json.dumps(result["kda_in_proj_merged_vs_split_us"]), flush=True)
    for kernel in KERNELS:
        result["per_step_us"][kernel] = {
            str(m): sum(r[kernel][str(m)]["us"] * r["calls_per_step"] for r in result["layers"].values()
                        if "error" not in r[kernel]) for m in ms}
    print(json.dumps(result["per_step_us"], indent=1))
    json.dump(result, open(a.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
