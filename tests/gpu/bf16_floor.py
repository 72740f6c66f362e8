"""bf16's own floor on a tiny checkpoint: the transformers reference in bf16 against itself in fp32.

    python3 tests/gpu/bf16_floor.py [CHECKPOINT | --variant NAME] [--chains] [--low float16] [--device cuda]

Same prompts as test_model_gpu.py, or with `--chains` the prefix-cache tests' agent turns (~550-900 tokens,
tests/model/test_prefix_cache_engine.py at a 256-token block). Prints top-1 agreement (all positions and decided
ones, margin >= 0.2 nat), the relative top-20 logprob error, the margin distribution and the largest |Δ logprob| of
the fp32 top-1 token: the best any bf16 engine can do here, and so the least a bf16 resume can be judged to.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

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
    p.add_argument("--variant", default="stable_router", help="the tiny checkpoint's variant, without CHECKPOINT")
    p.add_argument("--chains", action="store_true", help="the prefix-cache agent turns instead of the model prompts")
    p.add_argument("--low", choices=("bfloat16", "float16"), default="bfloat16", help="the dtype held to fp32")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    low_dtype = getattr(torch, a.low)
    path = a.model or str(ensure_tiny(variant=a.variant))
    prompts = _chain_prompts() if a.chains else model_prompts()
    models = {dt: BailingHybridForCausalLM.from_pretrained(path, dtype=dt).to(a.device).eval()
              for dt in (torch.float32, low_dtype)}
    ref, low = [], []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=a.device)
            ref.append(torch.log_softmax(models[torch.float32](x).logits[0].float(), -1).cpu())
            low.append(torch.log_softmax(models[low_dtype](x).logits[0].float(), -1).cpu())
    ref, low = torch.cat(ref), torch.cat(low)
    top2 = ref.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    same = ref.argmax(-1) == low.argmax(-1)
    top = ref.topk(TOPK, -1)
    err = low.gather(-1, top.indices) - top.values
    decided = margin >= DECIDED
    print(f"{path} ({a.low}): {len(same)} positions; top-1 agreement {same.float().mean():.4f}, on {int(decided.sum())} "
          f"decided {same[decided].float().mean():.4f}; relative top-{TOPK} logprob error "
          f"{(err.pow(2).sum() / top.values.pow(2).sum()).sqrt():.3e}; |Δ logprob| median {err.abs().median():.3f} "
          f"p99 {err.abs().quantile(0.99):.3f}; margin median {statistics.median(margin.tolist()):.2f}; top-1 "
          f"|Δ logprob| max {err[:, 0].abs().max():.3f}")


def _chain_prompts() -> list[list[int]]:
    """Every turn of the prefix-cache tests' agent chains at the GPU's 256-token block."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
    from test_prefix_cache_engine import _chains

    return [turn for turns in _chains(256).values() for turn in turns]


if __name__ == "__main__":
    main()
