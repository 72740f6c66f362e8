"""Which MoE backend the serve recipe should use on this device, decided from measurements.

Decode is what a Spark serves most, and it is memory-bound, so the criterion is the geometric mean
over decode batch sizes (M <= decode_max_m) of Marlin's time over a challenger's. Marlin is vLLM's
default for INT4 MoE on sm_121, so it keeps the job unless a challenger beats it by more than `margin`
(beyond timing noise) and runs at every one of those M. With the engine comparison (vLLM >= 0.28,
`ling_tuning.engine_compare`) the challengers are Humming and tuned Triton, all timed as decode steps of
one engine per backend; without it, tuned Triton against Marlin kernel for kernel. The verdict and the per-M
evidence go to backend_choice.json beside the tuned file; `recommended_backend` reads it back.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ling_tuning.compare import Row
from ling_tuning.configfile import TUNED_FOLDER_ENV, device_name_as_file_name
from ling_tuning.engine_compare import BACKENDS, EngineResult

CHOICE_FILE = "backend_choice.json"  # its moe_backend is one of BACKENDS


def decide(rows: list[Row], decode_max_m: int = 64, margin: float = 0.05) -> tuple[str | None, str]:
    """(backend or None, why) from per-M timings."""
    decode = [r for r in rows if r.m <= decode_max_m]
    if not decode:
        return None, f"no measured batch size <= decode_max_m={decode_max_m}"
    triton_bad = [r.m for r in decode if r.tuned.us is None]
    marlin_bad = [r.m for r in decode if r.marlin.us is None]
    if triton_bad and marlin_bad:
        return None, f"neither backend ran at every decode M (triton failed {triton_bad}, marlin {marlin_bad})"
    if triton_bad:
        return "marlin", f"tuned Triton failed at M={triton_bad}"
    if marlin_bad:
        return "triton", f"Marlin failed at M={marlin_bad}"
    speedup = math.exp(sum(math.log(r.marlin.us / r.tuned.us) for r in decode) / len(decode))
    why = f"tuned Triton is {speedup:.2f}x Marlin (geomean over M={[r.m for r in decode]}; "
    if speedup >= 1 + margin:
        return "triton", why + f"needs >= {1 + margin:.2f}x)"
    return "marlin", why + f"needs >= {1 + margin:.2f}x to switch)"


def decide_engine(results: list[EngineResult], decode_max_m: int = 64,
                  margin: float = 0.05) -> tuple[str | None, str]:
    """(backend or None, why) from engine decode steps: the fastest challenger (geomean over decode M) takes the
    job from Marlin only by more than `margin`; a backend missing any decode M is out."""
    decode = sorted({m for r in results for m in r.step_us if m <= decode_max_m})
    if not decode:
        return None, f"no engine timing at a batch size <= decode_max_m={decode_max_m}"
    ran = {r.backend: r for r in results if all(m in r.step_us for m in decode)}
    out = {r.backend: r.error or "missing M" for r in results if r.backend not in ran}
    if not ran:
        return None, f"no backend ran at every decode M={decode} ({out})"
    incumbent = "marlin" if "marlin" in ran else next(iter(ran))

    def speedup(b: str) -> float:
        return math.exp(sum(math.log(ran[incumbent].step_us[m] / ran[b].step_us[m]) for m in decode) / len(decode))

    lost = f"; not measured at every M: {out}" if out else ""
    rivals = {b: speedup(b) for b in ran if b != incumbent}
    if not rivals:
        return incumbent, f"only {incumbent} ran at every decode M={decode} in the engine{lost}"
    best = max(rivals, key=rivals.get)
    why = (f"engine decode step: {', '.join(f'{b} {x:.3f}x' for b, x in rivals.items())} vs {incumbent} "
           f"(geomean over M={decode}; needs >= {1 + margin:.2f}x to switch){lost}")
    return (best if rivals[best] >= 1 + margin else incumbent), why


def write_choice(folder: Path, device_name: str, rows: list[Row], decode_max_m: int = 64,
                 margin: float = 0.05, extra: dict[str, Any] | None = None,
                 engine: list[EngineResult] | None = None) -> dict[str, Any]:
    """Decide and write backend_choice.json; returns the document. With `engine` results that decide, they
    rule (every backend timed alike, Humming included); the kernel rows stay as evidence."""
    backend, reason = decide(rows, decode_max_m, margin)
    metric = "geomean(marlin_us / tuned_triton_us) over M <= decode_max_m"
    if engine:
        engine_backend, engine_reason = decide_engine(engine, decode_max_m, margin)
        if engine_backend is not None:
            backend, reason = engine_backend, engine_reason
            metric = "geomean(marlin engine decode step / challenger's) over M <= decode_max_m"
        else:
            reason += f" (engine comparison undecided: {engine_reason})"
    folder = Path(folder).resolve()
    doc = {
        "device_name": device_name,
        "moe_backend": backend,
        "reason": reason,
        "criterion": {"metric": metric, "decode_max_m": decode_max_m, "margin": margin},
        "env": {TUNED_FOLDER_ENV: str(folder)},
        "evidence": [{"M": r.m, "kernel": r.kernel, "triton_us": r.tuned.us, "marlin_us": r.marlin.us,
                      "default_us": r.default.us, "default_error": r.default.error,
                      "triton_error": r.tuned.error, "marlin_error": r.marlin.error} for r in rows],
        "engine_evidence": [r.to_dict() for r in engine or []],
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **(extra or {}),
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CHOICE_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def read_choice(folder: str | Path, device_name: str | None = None) -> dict[str, Any] | None:
    """The verdict document in this tuned folder, or None when there is no usable verdict (no file,
    unreadable, undecided, or tuned on another device than `device_name`)."""
    try:
        doc = json.loads((Path(folder) / CHOICE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("moe_backend") not in BACKENDS:
        return None
    if device_name is not None and device_name_as_file_name(str(doc.get("device_name", ""))) != \
            device_name_as_file_name(device_name):
        return None
    return doc


def recommended_backend(folder: str | Path, device_name: str | None = None) -> str | None:
    """The measured MoE backend for this tuned folder: "marlin", "triton", "humming", or None (see `read_choice`)."""
    doc = read_choice(folder, device_name)
    return None if doc is None else doc["moe_backend"]
