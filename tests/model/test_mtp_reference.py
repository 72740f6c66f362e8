"""The MTP draft layer (docs/architecture.md §MTP) written from the equations, on the tiny checkpoints.

CPU only: it checks the draft math and the two tiny checkpoints the GPU MTP tests rely on. With the
`mtp_echo` variant the draft, fed the target's post-norm hidden states (from the transformers oracle),
predicts what the target says next; with the default random draft it almost never does. vLLM's MTP path
itself runs on CUDA only (tests/gpu/test_mtp_gpu.py).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from references import mtp_draft_guesses


def _agreement(model_dir: str, run_oracle, tmp: Path) -> float:
    rng = random.Random(3)
    seq = [rng.randrange(10, 600) for _ in range(48)]
    out = run_oracle({"model": model_dir, "prompts": [], "score": [seq], "hidden_path": str(tmp / "h.pt")},
                     f"mtp-{Path(model_dir).name}")
    target_next = out["scored"][0]["argmax"]  # argmax[i]: the target's prediction for position i
    # row t: embed(token t+1) with h_t -> the draft's guess for token t+2, vs the target's guess for t+2
    draft = mtp_draft_guesses(model_dir, [seq], torch.load(tmp / "h.pt"))[0]
    hits = [d == target_next[t + 2] for t, d in enumerate(draft) if t + 2 < len(seq)]
    return sum(hits) / len(hits)


def test_echo_draft_predicts_the_target(run_oracle, tmp_path):
    from ling_tools.tiny import ensure_tiny

    rate = _agreement(str(ensure_tiny(variant="mtp_echo")), run_oracle, tmp_path)
    assert rate >= 0.8, f"the mtp_echo draft agreed with the target on {rate:.0%} of positions"


def test_random_draft_rarely_predicts_the_target(run_oracle, tmp_path):
    from ling_tools.tiny import ensure_tiny

    rate = _agreement(str(ensure_tiny()), run_oracle, tmp_path)
    assert rate <= 0.2, f"a random draft agreed with the target on {rate:.0%} of positions"
