"""bf16's own floor on a tiny checkpoint: the transformers reference in bf16 against itself in fp32.

    python3 tests/gpu/bf16_floor.py [CHECKPOINT] [--device cuda]

Same prompts as test_model_gpu.py. Prints top-1 agreement (all positions and decided ones, margin >= 0.2 nat),
the relative top-20 logprob error and the margin distribution: the best any bf16 engine can do here.
"""

from __future__ import annotations

import argparse
import statistics
import sys

sys.modules["fla"] = None  # type: ignore[assignment]  # transformers' torch KDA path (see tests/model/oracle.py)
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import torch  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from criteria import DECIDED, TOPK, model_prompts  # noqa: E402


def main() -> None:
    from transformers import BailingHybridForCausalLM

    from ling_tools.tiny import ensure_tiny

    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    path = a.model or str(ensure_tiny(variant="stable_router"))
    prompts = model_prompts()
    models = {dt: BailingHybridForCausalLM.from_pretrained(path, dtype=dt).to(a.device).eval()
              for dt in (torch.float32, torch.bfloat16)}
    ref, low = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=a.device)
            ref.append(torch.log_softmax(models[torch.float32](x).logits[0].float(), -1).cpu())
            low.append(torch.log_softmax(models[torch.bfloat16](x).logits[0].float(), -1).cpu())
    ref, low = torch.cat(ref), torch.cat(low)
    top2 = ref.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    same = ref.argmax(-1) == low.argmax(-1)
    top = ref.topk(TOPK, -1)
    err = low.gather(-1, top.indices) - top.values
    decided = margin >= DECIDED
    print(f"{path}: {len(same)} positions; top-1 agreement {same.float().mean():.4f}, on {int(decided.sum())} "
          f"decided {same[decided].float().mean():.4f}; relative top-{TOPK} logprob error "
          f"{(err.pow(2).sum() / top.values.pow(2).sum()).sqrt():.3e}; |Δ logprob| median {err.abs().median():.3f} "
          f"p99 {err.abs().quantile(0.99):.3f}; margin median {statistics.median(margin.tolist()):.2f}")


if __name__ == "__main__":
    main()
