"""The preflight's count of a dummy-weight model from its config.json (ling_watchdog.weights) against the tensor table
the checkpoints are written from (ling_tools.tensors): the watchdog keeps its own copy of the geometry, since it may
not import the plugin's config, and this holds the two together for every layout the tiny maker writes."""

import json

import pytest

from ling_tools import tiny
from ling_tools.tiny.int4 import INT4_GROUP_SIZE
from ling_watchdog.weights import dummy_weight_bytes


def table_bytes(config: dict) -> int:
    """Every tensor of ling_tools.tensors at BF16, the routed experts of a quantized config at 4 bits plus a BF16 scale
    per group (the INT4 checkpoint's compressed-tensors scheme)."""
    expert = 0.5 + 2 / INT4_GROUP_SIZE if config.get("quantization_config") else 2
    return int(sum(s.numel * (expert if s.kind == "expert" else 2) for s in tiny.tensor_specs(config).values()))


@pytest.mark.parametrize("variant", ["default", "qlora"])
def test_the_tiny_layouts_count_as_the_table(variant):
    config = tiny.tiny_config(variant, None)
    assert dummy_weight_bytes(config) == table_bytes(config)


def test_the_int4_tiny_checkpoint_counts_as_the_table_and_its_files(tmp_path):
    path = tiny.make_tiny_checkpoint(tmp_path / "int4", int4=True)
    config = json.loads((path / "config.json").read_text())
    files = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    assert dummy_weight_bytes(config) == table_bytes(config) == pytest.approx(files, rel=0.02)


def test_the_full_size_config_counts_the_released_checkpoint():
    """77.0 GB of safetensors in the INT4 release (docs/ops-walls.md): the preflight's weights_gib, 71.7 GiB."""
    config = tiny.full_config()
    assert dummy_weight_bytes(config) == table_bytes(config)
    assert dummy_weight_bytes(config) / 2**30 == pytest.approx(71.7, abs=0.15)
