"""The tuned-config file: vLLM's exact name, its JSON schema, and a lookup-safety proof.

vLLM finds the file by name only (`get_config_file_name`, fused_moe.py):
    E={E},N={N},device_name={device}{,dtype=...}{,block_shape=[n,k] if both non-zero}.json
with device = the CUDA device name, whitespace and '/' runs replaced by '_', and any name holding
the token H200 collapsed to NVIDIA_H200. int4 passes block_shape [0, group], so no suffix.
It searches $VLLM_TUNED_CONFIG_FOLDER first, then its own configs/ folder, and for a batch of M
tokens uses the entry whose key is nearest to M (ties: the first key in file order).

That nearest-key rule crosses kernel boundaries: an entry tuned for M = 256 (CUDA kernel) would
serve M = 600 (Triton kernel), where BLOCK_SIZE_N = 1024 is a 100+ KB tile. `build_table` pins
both sides of the CUDA/Triton boundary and `unsafe_lookups` proves every M up to the largest
batch maps to an entry its kernel accepts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ling_tuning.shapes import MoEShape
from ling_tuning.smem import CUDA_DYNAMIC_SMEM_DEFAULT
from ling_tuning.space import Config, cuda_violations, uses_cuda_kernel, violations, vllm_default_config

TUNED_FOLDER_ENV = "VLLM_TUNED_CONFIG_FOLDER"
INT_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages", "SPLIT_K")


def device_name_as_file_name(name: str) -> str:
    """vLLM `get_device_name_as_file_name`: runs of whitespace or '/' become one '_'."""
    return re.sub(r"[\s/]+", "_", name)


def config_file_name(shape: MoEShape, device_name: str) -> str:
    """The file name vLLM (0.32-0.34, one rule) looks up for `shape` on a device reporting `device_name`."""
    dev = device_name_as_file_name(device_name)
    if "H200" in dev.split("_"):
        dev = "NVIDIA_H200"
    return f"E={shape.num_experts},N={shape.intermediate},device_name={dev},dtype={shape.dtype}.json"


def lookup(table: dict[int, Config], m: int) -> int:
    """The key vLLM picks for batch size m: min(keys, key=|key - m|), first key on ties."""
    return min(table, key=lambda k: abs(k - m))


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """What in a loaded JSON document vLLM would choke on or misuse ('triton_version' allowed)."""
    errs = []
    entries = {k: v for k, v in doc.items() if k != "triton_version"}
    if not entries:
        errs.append("no batch-size entries")
    for key, cfg in entries.items():
        if not key.isdigit() or int(key) < 1:
            errs.append(f"key {key!r} is not a positive integer batch size")
        if not isinstance(cfg, dict) or "BLOCK_SIZE_M" not in cfg:
            errs.append(f"entry {key}: needs at least BLOCK_SIZE_M")
            continue
        for name, value in cfg.items():
            if name not in INT_KEYS:
                errs.append(f"entry {key}: unknown field {name!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                errs.append(f"entry {key}: {name}={value!r} is not a positive int")
        if cfg.get("SPLIT_K", 1) != 1:
            errs.append(f"entry {key}: SPLIT_K must be 1 for int4_w4a16")
    return errs


def unsafe_lookups(table: dict[int, Config], shape: MoEShape, smem_limit: int, max_tokens: int) -> list[str]:
    """Every M in 1..max_tokens whose nearest entry its kernel would reject, as 'M=..: reason'."""
    bad = []
    for m in range(1, max_tokens + 1):
        key = lookup(table, m)
        reasons = violations(m, table[key], shape, smem_limit)
        if reasons:
            bad.append(f"M={m} -> entry {key}: {reasons[0]}")
    return bad


def untuned_fallback(m: int, shape: MoEShape) -> Config:
    """The entry for a kernel side no tuned M covers: vLLM's default on the Triton side; on the CUDA
    side explicit 16 x 128 x K tiles, because vLLM's heuristic there picks BLOCK_SIZE_K = 16 groups
    at M <= 2, which the kernel rejects (the H200 baseline's failure)."""
    if not uses_cuda_kernel(m, shape):
        return vllm_default_config(m, shape)
    for bk in (128, 64, 32, shape.group_size):
        cfg = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": bk, "SPLIT_K": 1}
        if not cuda_violations(cfg, shape, CUDA_DYNAMIC_SMEM_DEFAULT):
            return cfg
    raise ValueError(f"no CUDA wna16 tile fits {shape}")


def build_table(best: dict[int, Config], shape: MoEShape) -> dict[int, Config]:
    """Tuned entries plus the two boundary keys that stop nearest-key lookups crossing kernels.

    With keys c = cuda_max_tokens and c + 1 present, every M <= c is nearer to a key <= c and
    every M > c to a key > c. A side with no tuned entry gets `untuned_fallback` there."""
    c = shape.cuda_max_tokens
    table = dict(best)
    cuda_side = [m for m in best if m <= c]
    triton_side = [m for m in best if m > c]
    table.setdefault(c, best[max(cuda_side)] if cuda_side else untuned_fallback(c, shape))
    table.setdefault(c + 1, best[min(triton_side)] if triton_side else untuned_fallback(c + 1, shape))
    return dict(sorted(table.items()))


def write_table(folder: Path, name: str, table: dict[int, Config], triton_version: str | None) -> Path:
    """Write atomically (tmp + rename), keys ascending, so a reader never sees half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"triton_version": triton_version} if triton_version else {}
    doc |= {str(m): table[m] for m in sorted(table)}
    path = folder / name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=4) + "\n")
    os.replace(tmp, path)
    return path


def read_table(path: Path) -> dict[int, Config]:
    """Load a tuned file the way vLLM does (drop triton_version, int keys), after a schema check."""
    doc = json.loads(Path(path).read_text())
    errs = schema_errors(doc)
    if errs:
        raise ValueError(f"{path}: not a valid vLLM MoE config: {'; '.join(errs)}")
    doc.pop("triton_version", None)
    return {int(k): v for k, v in doc.items()}


def kernel_for(m: int, shape: MoEShape) -> str:
    return "cuda_wna16" if uses_cuda_kernel(m, shape) else "triton_wna16"
