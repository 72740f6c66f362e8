"""The GPU query: what the serve command will run on (CPU only, a discrete GPU, or unified memory: GB10), and the
first GPU's name.

Asked of `nvidia-smi`, not torch: importing torch costs seconds, and a CUDA context in the
watchdog would hold unified memory that the server needs.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass

# Opt-in shared memory per block by compute capability (GB10's 101,376 B is docs/ops-walls.md, "The box").
from ling_common.smem import SMEM_PER_BLOCK

UNIFIED = {(8, 7), (12, 1)}  # Jetson Orin, GB10 (DGX Spark): the GPU's memory is host RAM
UNIFIED_NAMES = ("GB10",)  # by name too, whatever capability or memory total a driver reports for it
QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]
# Adaptive verification (DSpark) replays decode CUDA graphs whose query length varies per request, and vLLM checks
# every attention backend of the target for it once the KV cache is set up, after the weights are loaded (0.34
# `get_varlen_cudagraph_unsupported_backend`, v1/worker/gpu/attn_utils.py). Of 0.34's MLA backends only FlashInfer
# MLA (ALWAYS; `supports_compute_capability`: major 10) passes; FlashAttention MLA, Triton MLA and FlashMLA are
# UNIFORM_BATCH with no varying-length bound ("FlashAttnMLABackend allows none", seen on an H100). Read by the
# watchdog's preflight and the full-size bench.
ADAPTIVE_VERIFICATION_MLA_MAJORS = (10,)
# Before 0.34 no GPU qualifies: vLLM 0.33's GDN attention backend, which serves our KDA layers, is an SSM backend and
# so opts out of `supports_device_cpu_query_lens_mismatch` (v1/attention/backend.py), and 0.33 refuses adaptive
# verification for it after loading ("...which the GDN_ATTN attention backend does not support",
# v1/worker/gpu/spec_decode/adaptive_verification.py); 0.34's GDN backend declares the support.
ADAPTIVE_VERIFICATION_FROM_VLLM = (0, 34)


# Below this a card holds the full-size model (67-72 GiB of weights served, FP8 or not, draft or not) only at its
# edge: an 80 GB H100 (79.2 GiB) loads the target at util 0.95 with the allocator retrying, and not the target with
# its MTP layer (2026-12-06, vLLM 0.34). Used by the full-size bench's default util and the agent step's refusal.
ROOMY_CARD_GIB = 100


@dataclass(frozen=True, slots=True)
class Device:
    kind: str  # "cpu" | "discrete" | "unified"
    name: str = "cpu"
    total_bytes: int | None = None  # GPU memory of a discrete GPU
    smem_bytes: int | None = None
    count: int = 1  # GPUs on this host (nvidia-smi's lines); the rules read the first one's properties
    capability: tuple[int, int] | None = None  # compute capability (major, minor)


def parse_query(line: str) -> Device:
    """One line of QUERY's output, e.g. 'NVIDIA GB10, [N/A], 12.1'. Unified memory: a capability or a name known
    to share host RAM, or no memory total of its own ('[N/A]', what a DGX Spark's driver reports)."""
    name, mem, cc = (part.strip() for part in line.split(","))
    major, minor = (int(x) for x in cc.split("."))
    total = int(float(mem)) << 20 if mem.replace(".", "").isdigit() else None
    unified = (major, minor) in UNIFIED or total is None or any(n in name for n in UNIFIED_NAMES)
    return Device("unified" if unified else "discrete", name, None if unified else total,
                  SMEM_PER_BLOCK.get((major, minor)), capability=(major, minor))


def detect(run=subprocess.run) -> Device:
    """The first GPU nvidia-smi lists (and how many it lists), or a CPU device when there is none."""
    try:
        out = run(QUERY, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return Device("cpu")
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    try:
        return dataclasses.replace(parse_query(lines[0]), count=len(lines)) if lines else Device("cpu")
    except ValueError:
        return Device("unified", lines[0], count=len(lines))  # unknown format: assume the cautious memory model


def gpu_name() -> str | None:
    """This machine's first GPU as nvidia-smi names it (the name vLLM puts in tuned-file names), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=30)
    names = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return names[0].strip() if names else None
