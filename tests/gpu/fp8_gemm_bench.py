"""BF16 vs ling_fp8's configurations, for every BF16 linear of Ling-3.0-flash: per-channel scales on W8A8 (per-token
activations, vLLM's scaled-mm) and on W8A16 (Marlin), and 128 x 128 block scales on W8A8 (1 x 128 activation groups,
vLLM's block GEMM), block W8A16 (Marlin) on request.

    python3 tests/gpu/fp8_gemm_bench.py MODEL_DIR [OUT.json] [--m 1,2,4,8,16] [--configs ...] [--no-kda-split]

OUT.json defaults to $OUT/fp8_gemm.json where $OUT is set. Prints a table (µs per call per shape and M, the
kernel class vLLM chose, and the per-step sums) and writes it all as JSON.

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
# configuration -> (scheme, kernel) of LingFp8Config, None for BF16
CONFIGS = {"bf16": None, "channel_w8a8": ("channel", "w8a8"), "channel_w8a16": ("channel", "w8a16"),
           "block_w8a8": ("block", "w8a8"), "block_w8a16": ("block", "w8a16")}
DEFAULT_CONFIGS = ("bf16", "channel_w8a8", "channel_w8a16", "block_w8a8")


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


def build(out_f: int, in_f: int, config: str, copies: int, device: str = "cuda") -> list[torch.nn.Module]:
    """`copies` layers as the engine builds them (under the target device, online FP8 quantized when loaded)."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    from vllm_ling.fp8 import LingFp8Config

    layers = []
    for i in range(copies):
        cfg = LingFp8Config(scheme=CONFIGS[config][0], kernel=CONFIGS[config][1]) if CONFIGS[config] else None
        with torch.device(device):  # built under the device, loaded outside it, as vLLM's model loader does
            layer = ReplicatedLinear(in_f, out_f, bias=False, quant_config=cfg, prefix=f"model.layers.{i}.proj")
            w = torch.randn(out_f, in_f, dtype=torch.bfloat16) / in_f**0.5
        layer.weight.weight_loader(layer.weight, w)
        if cfg is None or not type(layer.quant_method).__name__.startswith("Fp8"):  # BF16 (or kept BF16)
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


def kernel_name(layer: torch.nn.Module) -> str:
    """The class that computes the layer: vLLM's chosen FP8 kernel, or the BF16 method (a linear kept BF16)."""
    return type(getattr(layer.quant_method, "fp8_linear", layer.quant_method)).__name__


def table(result: dict, configs: list[str]) -> str:
    """µs per call: one row per shape and configuration, one column per M; then the per-step sums."""
    ms = [str(m) for m in result["m"]]
    lines = [f"{'shape':22} {'config':14} {'kernel':36} " + " ".join(f"M={m:>5}" for m in ms)]
    for name, row in result["layers"].items():
        for config in configs:
            cell = row.get(config, {})
            times = " ".join(f"{cell[m]['us']:7.1f}" for m in ms) if "error" not in cell else cell["error"][:60]
            lines.append(f"{name:22} {config:14} {cell.get('kernel', '-')[:36]:36} {times}")
    lines.append(f"{'per decode step (µs)':22} {'':14} {'':36} " + " ".join(f"M={m:>5}" for m in ms))
    for config in configs:
        lines.append(f"{'':22} {config:14} {'':36} " + " ".join(f"{result['per_step_us'][config][m]:7.0f}" for m in ms))
    return "\n".join(lines)


def main() -> int:
    import os

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out", nargs="?", help="JSON result (default: $OUT/fp8_gemm.json where $OUT is set)")
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="of " + ", ".join(CONFIGS))
    ap.add_argument("--no-kda-split", action="store_true", help="skip KDA's in_proj merged vs its three GEMMs")
    ap.add_argument("--cpu-smoke", action="store_true", help="build each layer once on the CPU and run it (no timing)")
    a = ap.parse_args()
    out = a.out or (os.path.join(os.environ["OUT"], "fp8_gemm.json") if os.environ.get("OUT") else None)
    configs = [c for c in a.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        ap.error(f"--configs {sorted(unknown)}: not among {', '.join(CONFIGS)}")
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    import vllm_ling.fp8  # noqa: F401  registers the config

    config = json.load(open(f"{a.model}/config.json"))
    vc = EngineArgs(model=a.model, dtype="bfloat16", skip_tokenizer_init=True, load_format="dummy",
                    enable_prefix_caching=False).create_engine_config()
    ms = [int(x) for x in a.m.split(",")]
    result = {"m": ms, "configs": {c: CONFIGS[c] for c in configs}, "layers": {}, "per_step_us": {}}
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method="tcp://127.0.0.1:29533",
                                     local_rank=0, backend="gloo" if a.cpu_smoke else "nccl")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        if a.cpu_smoke:
            for name in configs:
                if name == "channel_w8a16":
                    continue  # FP8-Marlin is CUDA-only
                layer = build(64, 256, name, 1, device="cpu")[0]
                x = torch.randn(2, 256)
                err = (layer(x)[0].float() - x.float() @ layer.reference.float().t()).abs().max().item()
                print(name, kernel_name(layer), err)
            return 0
        for name, (out_f, in_f, calls) in shapes(config).items():
            copies = copies_for(out_f, in_f)
            row = {"out": out_f, "in": in_f, "calls_per_step": calls, "copies": copies}
            for cfg in configs:
                try:
                    layers = build(out_f, in_f, cfg, copies)
                    row[cfg] = {"kernel": kernel_name(layers[0])}
                    for m in ms:
                        us, err = time_graph(layers, m)
                        row[cfg][str(m)] = {"us": us, "max_rel_err": err}
                    del layers
                    torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001 - a kernel that cannot run is a result
                    row[cfg] = {"error": f"{type(e).__name__}: {e}"[:300]}
            result["layers"][name] = row
            print(name, {k: {m: round(v[m]["us"], 1) for m in map(str, ms)} if "error" not in v else v["error"]
                         for k, v in row.items() if k in configs}, flush=True)
        split = {}  # µs per KDA layer for the three GEMMs in_proj replaced, to set beside its own row
        for cfg in ([] if a.no_kda_split else [c for c in ("bf16", "channel_w8a8") if c in configs]):
            try:
                times = {str(m): 0.0 for m in ms}
                for out_f, in_f in kda_split(config):
                    layers = build(out_f, in_f, cfg, copies_for(out_f, in_f))
                    for m in ms:
                        times[str(m)] += time_graph(layers, m)[0]
                    del layers
                    torch.cuda.empty_cache()
                split[cfg] = times
            except Exception as e:  # noqa: BLE001 - recorded, the rest of the run stands
                print(f"kda split {cfg}: {type(e).__name__}: {e}"[:300], flush=True)
        merged = result["layers"]["kda.in_proj"]
        result["kda_in_proj_merged_vs_split_us"] = {
            k: {m: {"merged": merged[k][m]["us"], "split": t} for m, t in times.items()}
            for k, times in split.items() if "error" not in merged[k]}
        if split:
            print("kda in_proj merged vs split:", json.dumps(result["kda_in_proj_merged_vs_split_us"]), flush=True)
    for cfg in configs:
        result["per_step_us"][cfg] = {
            str(m): sum(r[cfg][str(m)]["us"] * r["calls_per_step"] for r in result["layers"].values()
                        if "error" not in r[cfg]) for m in ms}
    print(table(result, configs), flush=True)
    if out:
        json.dump(result, open(out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
