"""The INT4 format of Ling-3.0-flash-int4, written and read by compressed-tensors itself
(docs/architecture.md §INT4): W4A16 pack-quantized, symmetric int4 in groups of 32, routed experts only.

Per quantized Linear W [out, in]: `weight_packed` int32 [out, in/8] (nibble = q + 8, little-endian),
`weight_scale` bf16 [out, in/32], `weight_shape` [2]; w = (nibble - 8) * scale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ling_tools.tensors import tensor_specs

INT4_GROUP_SIZE = 32
QUANTIZED_KIND = "expert"  # the only INT4 tensors; everything else keeps its BF16 `.weight`
IGNORED_KINDS = ("linear", "router", "lm_head")  # the Linears the ignore list names


def int4_scheme():
    """compressed-tensors W4A16: symmetric int4, group 32, weights only."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=INT4_GROUP_SIZE)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def int4_ignore_list(config: dict[str, Any]) -> list[str]:
    """Every Linear that is not a routed expert, with the checkpoint's `.attention.` names."""
    return [name.removesuffix(".weight") for name, spec in tensor_specs(config).items()
            if spec.kind in IGNORED_KINDS]


def int4_quantization_config(config: dict[str, Any]):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": int4_scheme()}, format="pack-quantized",
                              quantization_status="compressed", ignore=int4_ignore_list(config))


def check_int4_shapes(config: dict[str, Any]) -> None:
    """Group-32 quantization needs both expert GEMM widths to be multiples of 32."""
    for key in ("hidden_size", "moe_intermediate_size"):
        if config[key] % INT4_GROUP_SIZE:
            raise ValueError(
                f"{key}={config[key]} is not a multiple of the INT4 group size {INT4_GROUP_SIZE}; "
                f"pick a multiple of 32 (Marlin also wants hidden_size % 128 == 0)"
            )


def write_quantization_config(model_dir: Path, config: dict[str, Any]) -> None:
    """Add `quantization_config` to config.json exactly as compressed-tensors' ModelCompressor writes it."""
    from compressed_tensors.compressors import ModelCompressor

    ModelCompressor(quantization_config=int4_quantization_config(config)).update_config(str(model_dir))


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def quantize_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each routed expert `.weight` by its `weight_packed`, `weight_scale` and `weight_shape`
    (compressed-tensors' pack-quantized compressor; scale = absmax / 7.5 per group); everything else
    passes through."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme = int4_scheme()
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not is_routed_expert(name):
            out[name] = w
            continue
        scale, _ = compute_dynamic_scales_and_zp(w, scheme.weights, module=None)
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        prefix = name.removesuffix("weight")
        out |= {prefix + k: packed[k].contiguous() for k in ("weight_packed", "weight_scale", "weight_shape")}
    return out


def dequantize_experts(tensors: dict[str, torch.Tensor], scheme) -> dict[str, torch.Tensor]:
    """The inverse: each packed/scale/shape triple becomes a BF16 `.weight` (compressed-tensors'
    decompressor), in the position of its `weight_packed`."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix("weight_packed")
            local = {k: tensors[prefix + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
            out[prefix + "weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        elif not name.endswith((".weight_scale", ".weight_shape")):
            out[name] = t
    return out
