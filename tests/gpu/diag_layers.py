"""Diagnostic (not a test): per-layer relative error of the vLLM engine vs the transformers oracle.

python tests/gpu/diag_layers.py OUT.json [--eager]   (GPU, bf16 engine vs fp32 oracle, one 200-token prompt)
"""
import json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LING_FORCE="1")
sys.modules["fla"] = None
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "model"))
from model_helpers import NO_CLAMPS  # noqa: E402

IDS = [(37 * i + 11) % 890 + 10 for i in range(200)]


def hooks(store):
    def install(model):
        for i, layer in enumerate(model.model.layers):
            for part in ("self_attn", "mlp"):
                def f(mod, inp, out, key=f"{part}{i}"):
                    o = out[0] if isinstance(out, tuple) else out
                    x = inp[-1] if part == "self_attn" else inp[0]
                    store.setdefault(key, (x.detach().float().cpu().clone(), o.detach().float().cpu().clone()))
                getattr(layer, part).register_forward_hook(f)
    return install


def main():
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from ling_tools.tiny import ensure_tiny
    model = str(ensure_tiny())
    eager = "--eager" in sys.argv
    store = {}
    dtype = next((a for a in sys.argv[2:] if not a.startswith("-")), "bfloat16")
    llm = LLM(model=model, dtype=dtype,
              enforce_eager=eager, gpu_memory_utilization=0.3, max_model_len=1024, hf_overrides=NO_CLAMPS, seed=0)
    llm.apply_model(hooks(store))
    llm.generate([TokensPrompt(prompt_token_ids=IDS)], SamplingParams(max_tokens=1, temperature=0))
    from transformers import BailingHybridForCausalLM
    hf = BailingHybridForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    ref = {}
    for i, layer in enumerate(hf.model.layers):
        for part in ("self_attn", "mlp"):
            def g(mod, inp, out, key=f"{part}{i}"):
                o = out[0] if isinstance(out, tuple) else out
                ref[key] = o[0].detach().float().cpu()
            getattr(layer, part).register_forward_hook(g)
    with torch.no_grad():
        hf(torch.tensor([IDS]).cuda())
    res = {}
    for k, (x, y) in store.items():
        r = ref[k][: y.shape[0]]
        res[k] = {"rel": ((y - r).norm() / r.norm()).item(), "rows": y.shape[0]}
        # per-position error profile (first/last chunk) for attention
        res[k]["rel_first64"] = ((y[:64] - r[:64]).norm() / r[:64].norm()).item()
        res[k]["rel_last64"] = ((y[-64:] - r[-64:]).norm() / r[-64:].norm()).item()
    print(json.dumps(res, indent=1))
    json.dump(res, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
