"""Start-up self-check: is every optimisation we asked for really on? (issue: the integration trap)

Stacked optimisations fail silently: a draft reading the wrong weights is accepted ~0% and decodes
slower than no draft; a missing tuned-MoE file falls back to generic tiles. This module turns each one
into an ON/OFF line with the reason, and fails loudly when something requested fell back.

Two halves:
- `check_draft_shares_target` runs inside vLLM when the MTP draft first runs: its lm_head and embedding
  must be the target's tensors, in the target's dtype.
- `python -m vllm_ling.selfcheck --log server.log --url http://127.0.0.1:8000` runs against a live server:
  reads the server log for what each optimisation did, then sends a short greedy probe as two sequences of
  one batch (they must agree) and, with MTP, reads the spec-decode counters from /metrics to check the draft
  is accepted at a plausible rate.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import weakref
from dataclasses import dataclass

logger = logging.getLogger("vllm_ling")

# --- inside vLLM: draft/target sharing --------------------------------------------------------------

_targets: "weakref.WeakSet" = weakref.WeakSet()


def register_target(model) -> None:
    _targets.add(model)


def check_draft_shares_target(draft) -> str:
    """Raise unless the draft's lm_head and embedding are the target's tensors in the target's dtype."""
    targets = list(_targets)
    if len(targets) != 1:
        raise RuntimeError(f"vllm-ling self-check: expected one target model in this process, found {len(targets)}")
    target = targets[0]
    head, t_head = draft.lm_head.weight, target.lm_head.weight
    emb, t_emb = draft.model.embed_tokens.weight, target.model.embed_tokens.weight
    problems = []
    for name, mine, theirs in (("lm_head", head, t_head), ("embedding", emb, t_emb)):
        if mine.dtype != theirs.dtype:
            problems.append(f"{name} dtype {mine.dtype} != target {theirs.dtype}")
        elif mine.data_ptr() != theirs.data_ptr() and not _same(mine, theirs):
            problems.append(f"{name} differs from the target's")
    if problems:
        raise RuntimeError("vllm-ling self-check FAILED: MTP draft " + "; ".join(problems)
                           + ". Serve without --speculative-config or fix the checkpoint.")
    shared = head.data_ptr() == t_head.data_ptr() and emb.data_ptr() == t_emb.data_ptr()
    line = f"MTP draft: lm_head and embedding {'shared with' if shared else 'equal to'} the target's ({head.dtype})"
    logger.info("vllm-ling self-check: %s", line)
    return line


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


# --- against a live server ---------------------------------------------------------------------------


@dataclass
class Verdict:
    name: str
    on: bool
    why: str
    requested: bool = False

    @property
    def failed(self) -> bool:
        return self.requested and not self.on

    def line(self) -> str:
        state = "ON " if self.on else ("FAILED" if self.failed else "OFF")
        return f"{self.name:<16} {state:<6} {self.why}"


def inspect_log(log: str, args: list[str], choice: dict | None = None) -> list[Verdict]:
    """What each optimisation did, from vLLM's start-up log and the serve arguments. `choice` is ling-tune's
    measured MoE backend verdict (`backend_choice.json`), held against the backend vLLM really chose."""
    joined = " ".join(args)
    eager = "--enforce-eager" in args
    mtp_req = '"mtp"' in joined or "'mtp'" in joined or "method=mtp" in joined
    graphs = re.search(r"Graph capturing finished in", log)
    device = re.search(r"device_config=(\w+)", log)
    on_cpu = bool(device) and device.group(1) == "cpu"
    why = "captured" if graphs else ("CPU engine" if on_cpu else "--enforce-eager" if eager
                                     else "no 'Graph capturing finished' line")
    verdicts = [Verdict("CUDA graphs", bool(graphs), why, requested=not eager and not on_cpu)]
    spec = re.search(r"speculative_config=SpeculativeConfig\(method='mtp'|Speculative decoding.*mtp", log, re.I)
    verdicts.append(Verdict("MTP", bool(spec), "method=mtp in the engine config" if spec else "not configured",
                            requested=mtp_req))
    verdicts.append(_int4_verdict(log, choice))
    tuned = re.search(r"Using configuration from (\S+) for MoE layer", log)
    default = re.search(r"Using default MoE config", log)
    verdicts.append(Verdict("tuned MoE tiles", bool(tuned), tuned.group(1) if tuned else
                            ("vLLM fell back to default tiles" if default else "no Triton MoE config lookup (Marlin or CPU)"),
                            requested="VLLM_TUNED_CONFIG_FOLDER" in joined and bool(default)))
    verdicts.append(Verdict("FP8 LM head", False, "not implemented in vllm-ling yet"))
    return verdicts


def _int4_verdict(log: str, choice: dict | None) -> Verdict:
    """Which INT4 MoE backend serves, and whether it is the one ling-tune measured fastest on this device."""
    found = re.search(r"Using '(\w+)' WNA16 MoE backend|Using (CompressedTensorsWNA16\w*MoEMethod)", log)
    if not found:
        return Verdict("INT4 experts", False, "no WNA16 MoE backend line (BF16 checkpoint?)")
    backend = next(g for g in found.groups() if g)
    served = "marlin" if "marlin" in backend.lower() else "triton"
    if choice is None:
        return Verdict("INT4 experts", True, f"backend {backend} (no ling-tune backend verdict)")
    wanted = choice["moe_backend"]
    where = f"ling-tune on {choice.get('device_name', '?')}: {choice.get('reason', '')}"
    if wanted != served:
        return Verdict("INT4 experts", False, f"backend {backend}, but {where}; this vLLM chose otherwise",
                       requested=True)
    return Verdict("INT4 experts", True, f"backend {backend}, as measured ({where})")


def read_choice(tuned_dir: str | None, device_name: str | None) -> dict | None:
    """ling-tune's backend verdict in the tuned-config folder, if it was measured on `device_name`; else None
    (a folder copied from another GPU says nothing about this one)."""
    from ling_tuning.choice import read_choice as read_verdict

    return read_verdict(tuned_dir, device_name) if tuned_dir and device_name else None


def gpu_name() -> str | None:
    """This machine's first GPU as nvidia-smi names it (the name vLLM puts in tuned-file names), or None."""
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None


def judge_acceptance(before: dict[str, float], after: dict[str, float], minimum: float) -> Verdict:
    """Draft acceptance over the probe, from spec-decode counter deltas."""
    drafted = after.get("num_draft_tokens", 0) - before.get("num_draft_tokens", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    if drafted <= 0:
        return Verdict("MTP acceptance", False, "no draft tokens during the probe", requested=True)
    rate = accepted / drafted
    ok = rate >= minimum
    why = f"{rate:.1%} of {int(drafted)} draft tokens accepted (minimum {minimum:.0%})"
    if not ok:
        why += ": the draft is reading wrong weights or a wrong state; it is slower than no draft"
    return Verdict("MTP acceptance", ok, why, requested=True)


def read_spec_counters(url: str, timeout: float = 5.0) -> dict[str, float]:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    counters: dict[str, float] = {}
    text = requests.get(f"{url}/metrics", timeout=timeout).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name.startswith("vllm:spec_decode_num_") and not sample.labels.get("position"):
                key = name.removeprefix("vllm:spec_decode_")
                counters[key] = counters.get(key, 0.0) + sample.value
    return counters


PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
AGREE_CHARS = 64  # about 16 tokens of the probe's continuation


def probe(url: str, model: str, tokens: int, timeout: float = 120.0) -> list[str]:
    """A greedy completion of a self-consistent input (plain prose), twice in one request: vLLM schedules the
    two sequences together (greedy forbids n > 1, so the prompt is sent as a batch of two)."""
    import requests

    r = requests.post(f"{url}/v1/completions", timeout=timeout, json={
        "model": model, "prompt": [PROBE_PROMPT, PROBE_PROMPT], "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True})
    if not r.ok:
        raise RuntimeError(f"the self-check's probe got HTTP {r.status_code} from {url}: {r.text[:500]}")
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def judge_batch_agreement(texts: list[str], chars: int = AGREE_CHARS) -> Verdict:
    """Two greedy sequences of one prompt, decoded side by side, must agree. A mix-up of per-sequence rows or
    state slots corrupts every sequence but the first from its first token (the H200 MTP verify bug,
    FINDINGS.md §1), which a one-request probe never sees; rounding can part identical rows only at a
    near-tie, rarely within the first ~16 tokens."""
    a, b = texts
    shorter = min(len(a), len(b))
    agree = len(os.path.commonprefix([a, b]))
    need = min(shorter, chars)
    why = f"2 greedy sequences of one prompt, one batch: first {agree} of {shorter} characters agree"
    if agree < need:
        why += f" (need {need}): a sequence reads another's rows or state; concurrent requests get garbage"
    return Verdict("batch agreement", agree >= need, why, requested=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_ling.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="the server's log file")
    p.add_argument("--url", help="server base URL; with it, run the greedy probe (batch agreement, MTP acceptance)")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--min-acceptance", type=float, default=0.3,
                   help="lowest draft acceptance that passes (real Ling MTP: ~0.9 at k=1)")
    p.add_argument("--probe-tokens", type=int, default=64)
    p.add_argument("--tuned-dir", default=os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
                   help="ling-tune's folder, for its measured MoE backend (default: $VLLM_TUNED_CONFIG_FOLDER)")
    p.add_argument("serve_args", nargs="*", help="the serve command's arguments (after --)")
    a = p.parse_args(argv)
    with open(a.log, errors="replace") as f:
        verdicts = inspect_log(f.read(), a.serve_args, read_choice(a.tuned_dir, gpu_name()))
    mtp = next(v for v in verdicts if v.name == "MTP")
    if a.url:
        import requests

        model = a.model or requests.get(f"{a.url}/v1/models", timeout=5).json()["data"][0]["id"]
        before = read_spec_counters(a.url) if mtp.on else {}
        verdicts.append(judge_batch_agreement(probe(a.url, model, a.probe_tokens)))
        if mtp.on:
            verdicts.append(judge_acceptance(before, read_spec_counters(a.url), a.min_acceptance))
    for v in verdicts:
        print(f"vllm-ling self-check: {v.line()}", flush=True)
    failed = [v.name for v in verdicts if v.failed]
    if failed:
        print(f"vllm-ling self-check: FAILED ({', '.join(failed)}): an optimisation that was asked for is not "
              "active; fix it or remove it from the serve command.", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
