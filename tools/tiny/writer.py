"""Writing checkpoints: the tiny one, its BF16 twin from INT4, and the full-size config for dummy weights."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from vllm_ling.config import check_supported
from vllm_ling.configs import FLASH_INT4_DIR
from ling_tools.tiny.config import tiny_config
from ling_tools.tiny.int4 import check_int4_shapes, dequantize_experts, quantize_experts, write_quantization_config
from ling_tools.tiny.tokenizer import write_tokenizer
from ling_tools.tiny.weights import make_draft_agree, random_weights, widen_router_bias

GENERATOR_VERSION = 3  # bump when the weights, config or tokenizer recipe change: stale caches rebuild
STAMP_FILE = "vllm_ling_tiny.json"
NUM_SHARDS = 2  # more than one, so multi-shard loading is exercised


def stamp(seed: int, int4: bool, variant: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint was built from (written as STAMP_FILE; the cache compares it)."""
    return {"generator_version": GENERATOR_VERSION, "seed": seed, "int4": int4, "variant": variant,
            "overrides": overrides or {}}


def _json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _write_index(out_dir: Path, weight_map: dict[str, str]) -> None:
    total = sum((out_dir / f).stat().st_size for f in set(weight_map.values()))  # HF: sum of file sizes
    _json(out_dir / "model.safetensors.index.json",
          {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})


def _write_shards(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int = NUM_SHARDS) -> None:
    """Split in file order into `num_shards` files of about equal bytes, plus the HF index."""
    budget = sum(t.numel() * t.element_size() for t in tensors.values()) / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        if used >= budget * len(shards) and len(shards) < num_shards:
            shards.append({})
        shards[-1][name] = t
        used += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    _write_index(out_dir, weight_map)


@contextlib.contextmanager
def _single_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine each op waits for all of
    them (16 s instead of 1 s for the INT4 packing on 2 loaded cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_tiny_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, int4: bool = False,
                         variant: str = "default", overrides: dict[str, Any] | None = None,
                         force: bool = False) -> Path:
    """Write a tiny random Ling-3.0 checkpoint (config, 2 safetensors shards + index, generation config,
    tokenizer) to `out_dir`. Same arguments -> byte-identical files."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty; pass force=True (--force) to overwrite "
                                  f"it, or choose an empty directory")
        shutil.rmtree(out)
    config = tiny_config(variant, overrides)
    check_supported(config)
    if int4:
        check_int4_shapes(config)
    out.mkdir(parents=True, exist_ok=True)
    eos, pad, live_vocab = write_tokenizer(out, config["max_position_embeddings"])
    if live_vocab > config["vocab_size"]:
        raise ValueError(f"vocab_size={config['vocab_size']} does not cover the tokenizer "
                         f"({live_vocab} tokens); use vocab_size >= {live_vocab}")
    config |= {"eos_token_id": eos, "pad_token_id": pad}
    with _single_thread():
        tensors = random_weights(config, seed, live_vocab)
        if variant == "mtp_echo":
            make_draft_agree(tensors, config)
        if variant == "stable_router":
            widen_router_bias(tensors)
        if int4:
            tensors = quantize_experts(tensors)
    _write_shards(out, tensors)
    _json(out / "config.json", config)
    if int4:
        write_quantization_config(out, config)
    _json(out / "generation_config.json", {"eos_token_id": eos, "pad_token_id": pad})
    _json(out / STAMP_FILE, stamp(seed, int4, variant, overrides))
    return out


def dequantize_checkpoint(int4_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the INT4 checkpoint back as BF16 with compressed-tensors' own decompressor, each tensor in
    its source shard: the oracle that full-precision references run on."""
    from compressed_tensors.quantization import QuantizationConfig

    src, dst = Path(int4_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config.pop("quantization_config"))
    if qconfig.format != "pack-quantized" or len(qconfig.config_groups) != 1:
        raise ValueError(f"{src}: expected one pack-quantized config group, got format={qconfig.format!r} "
                         f"with groups {list(qconfig.config_groups)}")
    scheme = next(iter(qconfig.config_groups.values()))
    dst.mkdir(parents=True, exist_ok=True)
    shard_of = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # a module's packed/scale/shape triple may straddle two shards: load them all first
    tensors = {k: v for shard in sorted(set(shard_of.values())) for k, v in load_file(src / shard).items()}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in dequantize_experts(tensors, scheme).items():
        shard = shard_of.get(name) or shard_of[name.removesuffix("weight") + "weight_packed"]
        shards.setdefault(shard, {})[name] = t
    weight_map: dict[str, str] = {}
    for shard, out in sorted(shards.items()):
        save_file(out, dst / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, shard)
    _write_index(dst, weight_map)
    _json(dst / "config.json", config)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json", STAMP_FILE):
            shutil.copy2(f, dst / f.name)
    return dst


def write_full_config(out_dir: str | os.PathLike, *, force: bool = False, tokenizer: bool = False) -> Path:
    """Copy the bundled Ling-3.0-flash-int4 config.json + generation_config.json into a model dir, for vLLM's
    `--load-format dummy` (random weights of the real shapes). Without `tokenizer` the engine needs
    `--skip-tokenizer-init` (token ids in, token ids out; `ling_bench.fullsize`).

    With `tokenizer`, the tiny BPE tokenizer and chat template (`write_tokenizer`, ~1000 ids) go beside the config,
    so a full-size dummy-weight server takes text: for load benchmarks of the served recipe (the agent step of
    tests/gpu/run_on_device.sh), where speed is what is measured and the text means nothing. The config is left as
    released: its 157,184-id vocabulary, of which prompts use only the tokenizer's ids and the model emits any (ids
    past the tokenizer decode to nothing), and its eos/pad ids (156,895 / 156,892), which the tokenizer lacks. vLLM
    then stops a request at the tokenizer's `<|endoftext|>` (the engine's eos) or at the generation config's
    156,895 (added to the stop ids), and at neither with `ignore_eos`, which ling-bench sends by default: every
    request decodes exactly its max_tokens."""
    out = Path(out_dir)
    names = ["config.json", "generation_config.json", *(["tokenizer.json", "tokenizer_config.json"] if tokenizer
                                                         else [])]
    if not force and (there := [n for n in names if (out / n).exists()]):
        raise FileExistsError(f"{out} already holds {', '.join(there)}; pass force=True (--force) to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for name in names[:2]:
        shutil.copyfile(FLASH_INT4_DIR / name, out / name)
    if tokenizer:
        config = json.loads((out / "config.json").read_text())
        write_tokenizer(out, config["max_position_embeddings"])
    return out
