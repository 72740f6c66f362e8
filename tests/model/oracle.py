"""The independent reference: transformers 5.20's pure-PyTorch `BailingHybridForCausalLM`, fp32 on CPU.

`dtype` (default float32) also runs it in bfloat16: the GPU test uses that as the bf16 noise floor of the
checkpoint itself (how often the reference's own bf16 argmax differs from its fp32 one).

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

    device = spec.get("device", "cpu")
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = BailingHybridForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(device).eval()

    def logprobs(seq: list[int]) -> torch.Tensor:
        """Row i: log p(· | seq[:i+1])."""
        return torch.log_softmax(model(torch.tensor([seq], device=device)).logits[0].float(), dim=-1).cpu()

    results = []
    for ids in spec["prompts"]:
        seq = list(ids)
        for _ in range(spec.get("max_tokens", 32)):  # greedy, recomputed from scratch each step
            seq.append(int(model(torch.tensor([seq], device=device)).logits[0, -1].argmax()))
        lp = logprobs(seq)
        # log p(seq[i] | seq[:i]); None at position 0
        results.append({"token_ids": seq[len(ids):], "logprobs": [None] + [lp[i - 1, t].item() for i, t in enumerate(seq) if i > 0]})
    # teacher-forced scoring of other sequences (e.g. the engine's): logprob of each token, the argmax
    # at each position, and optionally the logprobs of queried token ids per position
    scored = []
    for n, seq in enumerate(spec.get("score", [])):
        lp = logprobs(seq)
        top2 = lp[:-1].topk(2, dim=-1).values
        entry = {
            "logprobs": [None] + [lp[i - 1, t].item() for i, t in enumerate(seq) if i > 0],
            "argmax": [None] + [int(lp[i - 1].argmax()) for i in range(1, len(seq))],
            # how decided the prediction is: top-1 minus top-2 logprob
            "margin": [None] + (top2[:, 0] - top2[:, 1]).tolist(),
        }
        queries = spec.get("query", [])
        if n < len(queries):
            entry["lp_at"] = [None if q is None else [lp[i - 1, t].item() for t in q] for i, q in enumerate(queries[n]) if i < len(seq)]
        scored.append(entry)
    if spec.get("hidden_path"):  # post-final-norm hidden states of the scored sequences (what MTP consumes)
        hidden = [model.model(torch.tensor([seq], device=device)).last_hidden_state[0].float().cpu()
                  for seq in spec.get("score", [])]
        torch.save(hidden, spec["hidden_path"])
    return {"outputs": results, "scored": scored}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(spec), f)
