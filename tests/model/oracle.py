"""The independent reference: transformers 5.20's pure-PyTorch `BailingHybridForCausalLM`, fp32 on CPU.

`dtype` (default float32) also runs it in bfloat16: the GPU test uses that as the bf16 noise floor of the
checkpoint itself (how often the reference's own bf16 argmax differs from its fp32 one).

Run as its own process (python oracle.py SPEC.json OUT.json): transformers picks flash-linear-attention's
Triton kernels when `fla` is importable (it is, as our op-test reference), and those need a GPU; hiding
`fla` before transformers' model module is imported selects its torch path.
It has no SwiGLU clamps, so engine runs compared against it disable ours through hf_overrides.

`fp8` ("w8a8" or "w8a16") scores the model as `--quantization ling_fp8` serves it, written here from the rule
alone (no vllm_ling code), in one of two scale schemes (`fp8_scheme`, "channel" when absent):
- "channel": every `nn.Linear` but MLA's kv_b_proj gets its weight rounded to e4m3 with one scale per output row
  (s = max|W_row| / 448); with "w8a8" each such linear's input is rounded to e4m3 per token too
  (s = max(max|x_row| / 448, 1 / (448 * 512)), vLLM's dynamic per-token rule).
- "block": the weight is rounded with one scale per 128 x 128 block, rows and columns counted from 0, the last
  block partial where the width is no multiple of 128 (s = max(max|W_block|, 1e-4) / 448, W8 = e4m3(W * (1 / s)):
  vLLM's `per_block_cast_to_fp8`); with "w8a8" the input per token per group of 128 inputs
  (s = max(max|x_group| / 448, 1 / (448 * 512))). A linear whose input width is no multiple of 128 stays as it is.
The routed experts and the router are no nn.Linear here, as they are no FP8 target there. A linear whose output
width is no multiple of 16 stays as it is (ling_fp8's rule). `fp8_merged` says which of these linears the served
model computes as one, and so rounds or keeps together: [{"names": [...], "pad": bool}], each group a list of
modules under one parent (dotted paths allowed), in the served linear's row order, rounded where the served linear
is padded to a multiple of 16 or its summed width is one (the test says why per implementation). Under "block"
a group is one weight, its parts concatenated in that order, so its blocks run across parts as the served ones do
(zero padding rows change no block's maximum).
Computation stays fp32: what differs from the plain oracle is exactly FP8's rounding, so an engine scored against
it shows the implementation's error alone.
"""

from __future__ import annotations

import json
import sys

sys.modules["fla"] = None  # type: ignore[assignment]  # force transformers' torch KDA path
sys.modules["causal_conv1d"] = None  # type: ignore[assignment]

import torch  # noqa: E402

E4M3_MAX = 448.0
FP8_KEEP = ("kv_b_proj",)  # vLLM absorbs kv_b into W_UK / W_UV; ling_fp8 keeps it BF16
FP8_ALIGN = 16  # ling_fp8 keeps a linear BF16 unless its output width is a multiple of 16
BLOCK = 128  # "block": weight blocks BLOCK x BLOCK, input groups 1 x BLOCK; inputs a multiple of BLOCK
ACT_FLOOR = 1 / (E4M3_MAX * 512)  # vLLM's dynamic activation scales never go below this


def _e4m3_rows(x: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """Round each row (last dim) to e4m3 under its own scale max|row| / 448, back in x's dtype."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=max(floor, 1e-30))
    return ((x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def _e4m3_groups(x: torch.Tensor) -> torch.Tensor:
    """Round each row per group of BLOCK values (last dim, a multiple of BLOCK) under its own scale."""
    return _e4m3_rows(x.unflatten(-1, (-1, BLOCK)), ACT_FLOOR).flatten(-2)


def _e4m3_blocks(w: torch.Tensor) -> torch.Tensor:
    """Round a [N, K] weight per BLOCK x BLOCK block (the last row block partial) under s = max(max|W_b|, 1e-4)
    / 448, by W * (1 / s) as vLLM's per_block_cast_to_fp8 does; back in w's dtype."""
    n, k = w.shape
    rows = -(-n // BLOCK) * BLOCK
    tiles = torch.nn.functional.pad(w.float(), (0, 0, 0, rows - n)).reshape(rows // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / E4M3_MAX
    codes = (tiles * (1.0 / scale)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).reshape(rows, k)[:n].to(w.dtype)


def _groups(model: torch.nn.Module, merged: list[dict]) -> list[tuple[list[str], bool, list[torch.nn.Module]]]:
    """The full names of each `merged` group's members, for every parent that holds all of them as nn.Linear."""
    found = []
    for parent_name, parent in model.named_modules():
        for group in merged:
            members = [_child(parent, n) for n in group["names"]]
            if all(isinstance(m, torch.nn.Linear) for m in members):
                found.append(([f"{parent_name}.{n}" for n in group["names"]], group["pad"], members))
    return found


def _child(parent: torch.nn.Module, path: str) -> torch.nn.Module | None:
    try:
        return parent.get_submodule(path)
    except AttributeError:
        return None


def fp8_targets(model: torch.nn.Module, merged: list[dict] = (), scheme: str = "channel") -> list[str]:
    """The linears ling_fp8 rounds, by name: every nn.Linear but FP8_KEEP whose served linear is FP8_ALIGN-aligned
    (and under "block" reads a multiple of BLOCK inputs), a `merged` group deciding for all its members at once."""
    group_rule: dict[str, bool] = {}
    for names, pad, members in _groups(model, merged):
        width = sum(m.out_features for m in members)
        for name in names:
            group_rule[name] = pad or width % FP8_ALIGN == 0
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in FP8_KEEP
            and group_rule.get(name, module.out_features % FP8_ALIGN == 0)
            and (scheme == "channel" or module.in_features % BLOCK == 0)]


def _round_weights(model: torch.nn.Module, targets: list[str], merged: list[dict], scheme: str) -> None:
    """Each target's weight rounded in place of the old (a new tensor: unties a tied head); under "block" a merged
    group's parts as one concatenated weight."""
    modules = dict(model.named_modules())
    if scheme == "channel":
        for name in targets:
            modules[name].weight = torch.nn.Parameter(_e4m3_rows(modules[name].weight.data))
        return
    done: set[str] = set()
    for names, _, members in _groups(model, merged):
        if all(n in targets for n in names):
            parts = _e4m3_blocks(torch.cat([m.weight.data for m in members])).split([m.out_features for m in members])
            for m, part in zip(members, parts):
                m.weight = torch.nn.Parameter(part.clone())
            done.update(names)
    for name in targets:
        if name not in done:
            modules[name].weight = torch.nn.Parameter(_e4m3_blocks(modules[name].weight.data))


def apply_fp8(model: torch.nn.Module, kernel: str, merged: list[dict] = (), scheme: str = "channel") -> list[str]:
    """Round the FP8 targets' weights (and, for w8a8, their inputs per token or per token group); their names."""
    if scheme not in ("channel", "block"):
        raise ValueError(f"fp8_scheme={scheme!r} is neither 'channel' nor 'block'")
    targets = fp8_targets(model, merged, scheme)
    _round_weights(model, targets, merged, scheme)
    modules = dict(model.named_modules())
    round_input = _e4m3_groups if scheme == "block" else (lambda x: _e4m3_rows(x, ACT_FLOOR))
    for name in targets:
        if kernel == "w8a8":
            modules[name].register_forward_pre_hook(lambda _, args: (round_input(args[0]),))
    return targets


@torch.no_grad()
def run(spec: dict) -> dict:
    from transformers import BailingHybridForCausalLM

    device = spec.get("device", "cpu")
    dtype = getattr(torch, spec.get("dtype", "float32"))
    model = BailingHybridForCausalLM.from_pretrained(spec["model"], dtype=dtype).to(device).eval()
    fp8_names = (apply_fp8(model, spec["fp8"], spec.get("fp8_merged", []), spec.get("fp8_scheme", "channel"))
                 if spec.get("fp8") else [])

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
    scored, dists = [], []
    for n, seq in enumerate(spec.get("score", [])):
        lp = logprobs(seq)
        dists += [lp] if spec.get("logprobs_path") else []
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
    if spec.get("logprobs_path"):  # every scored position's full log-distribution (a KL between two references)
        torch.save(dists, spec["logprobs_path"])
    if spec.get("hidden_path"):  # post-final-norm hidden states of the scored sequences (what MTP consumes)
        hidden = [model.model(torch.tensor([seq], device=device)).last_hidden_state[0].float().cpu()
                  for seq in spec.get("score", [])]
        torch.save(hidden, spec["hidden_path"])
    return {"outputs": results, "scored": scored, "fp8_linears": len(fp8_names), "fp8_names": fp8_names}


if __name__ == "__main__":
    from model_helpers import exit_at_once

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump(run(spec), f)
    exit_at_once()
