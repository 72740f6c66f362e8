"""The independent reference: transformers 5.20's pure-PyTorch `BailingHybridForCausalLM`, fp32 on CPU.

Run as its own process (python oracle.py SPEC.json OUT.json): transformers picks flash-linear-attention's
Triton kernels when `fla` is importable (it is, as our op-test reference), and those need a GPU; hiding
`fla` before transformers' model module is imported selects its torch path.
It has no SwiGLU clamps, so engine runs compared against it disable ours through hf_overrides.
"""

from __future__ import annotations

import json
import sys

sys.modules["fla"] = None  # type: ignore[assignment]  # force transformers' torch KDA path
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import torch  # noqa: E402


@torch.no_grad()
def run(spec: dict) -> dict:
    from transformers import BailingHybridForCausalLM

    model = BailingHybridForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    results = []
    for ids in spec["prompts"]:
        seq = list(ids)
        for _ in range(spec.get("max_tokens", 32)):  # greedy, recomputed from scratch each step
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
        # log p(seq[i] | seq[:i]); None at position 0
        logprobs = [None] + [lp[i - 1, tok].item() for i, tok in enumerate(seq) if i > 0]
        results.append({"token_ids": seq[len(ids):], "logprobs": logprobs})
    # teacher-forced scoring of other continuations (e.g. the engine's), if asked
    scored = []
    for seq in spec.get("score", []):
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), dim=-1)
        scored.append([None] + [lp[i - 1, tok].item() for i, tok in enumerate(seq) if i > 0])
    return {"outputs": results, "scored": scored}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(spec), f)
