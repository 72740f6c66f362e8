import json

import pytest
from ling_tuning.configfile import (
    build_table,
    config_file_name,
    lookup,
    read_table,
    schema_errors,
    unsafe_lookups,
    write_table,
)
from ling_tuning.shapes import PRESETS
from ling_tuning.smem import GB10_SMEM_PER_BLOCK

LING = PRESETS["ling-3.0-flash"]
CUDA_CFG = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 1024, "BLOCK_SIZE_K": 128, "SPLIT_K": 1}  # fine on CUDA only
TRITON_CFG = {"BLOCK_SIZE_M": 128, "BLOCK_SIZE_N": 128, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 16, "num_warps": 8,
              "num_stages": 3, "SPLIT_K": 1}  # BLOCK_SIZE_M 128 is fine on Triton only


@pytest.mark.parametrize("raw, expected", [
    ("NVIDIA GB10", "E=512,N=768,device_name=NVIDIA_GB10,dtype=int4_w4a16.json"),
    ("NVIDIA H200", "E=512,N=768,device_name=NVIDIA_H200,dtype=int4_w4a16.json"),
    ("NVIDIA H200 NVL", "E=512,N=768,device_name=NVIDIA_H200,dtype=int4_w4a16.json"),
    ("NVIDIA H100 80GB HBM3", "E=512,N=768,device_name=NVIDIA_H100_80GB_HBM3,dtype=int4_w4a16.json"),
    ("AMD Instinct MI300X / MI308X", "E=512,N=768,device_name=AMD_Instinct_MI300X_MI308X,dtype=int4_w4a16.json"),
])
def test_file_name_follows_vllm_rules(raw, expected):
    assert config_file_name(LING, raw) == expected


def test_nearest_key_lookup_prefers_the_first_key_on_ties():
    table = {1: {}, 4: {}, 16: {}}
    assert [lookup(table, m) for m in (1, 2, 3, 10, 11, 100)] == [1, 1, 4, 4, 16, 16]
    assert lookup({2: {}, 4: {}}, 3) == 2


def test_build_table_pins_both_sides_of_the_cuda_triton_boundary():
    table = build_table({1: CUDA_CFG, 256: CUDA_CFG, 4096: TRITON_CFG}, LING)
    assert table[384] == CUDA_CFG and table[385] == TRITON_CFG
    assert list(table) == sorted(table)
    assert unsafe_lookups(table, LING, GB10_SMEM_PER_BLOCK, 8192) == []


def test_unpinned_table_would_crash_some_batch_sizes():
    """Without boundary keys, M = 385..2176 reach the CUDA-only entry 256 (BLOCK_SIZE_N 1024 on Triton)."""
    raw = {1: CUDA_CFG, 256: CUDA_CFG, 4096: TRITON_CFG}
    bad = unsafe_lookups(raw, LING, GB10_SMEM_PER_BLOCK, 8192)
    assert bad and all(line.startswith("M=") for line in bad)
    assert any("entry 256" in line and "smem" in line for line in bad)  # BN 1024 on the Triton kernel


def test_a_side_never_tuned_gets_a_fallback_that_every_m_there_accepts():
    table = build_table({1: CUDA_CFG}, LING)
    assert table[385]["BLOCK_SIZE_M"] == 64 and table[385]["num_stages"] == 3  # vLLM's Triton default
    assert unsafe_lookups(table, LING, GB10_SMEM_PER_BLOCK, 8192) == []
    triton_only = build_table({4096: TRITON_CFG}, LING)
    assert triton_only[384]["BLOCK_SIZE_K"] == 128  # not vLLM's heuristic, which fails at M <= 2
    assert unsafe_lookups(triton_only, LING, GB10_SMEM_PER_BLOCK, 8192) == []


def test_written_file_round_trips_and_has_the_schema_vllm_reads(tmp_path):
    table = build_table({1: CUDA_CFG, 1024: TRITON_CFG}, LING)
    path = write_table(tmp_path, config_file_name(LING, "NVIDIA GB10"), table, "3.6.0")
    doc = json.loads(path.read_text())
    assert doc["triton_version"] == "3.6.0" and schema_errors(doc) == []
    assert [k for k in doc if k != "triton_version"] == [str(k) for k in sorted(table)]
    assert read_table(path) == table
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("doc, needle", [
    ({"triton_version": "3.6.0"}, "no batch-size entries"),
    ({"one": {"BLOCK_SIZE_M": 16}}, "not a positive integer"),
    ({"1": {"BLOCK_SIZE_N": 16}}, "BLOCK_SIZE_M"),
    ({"1": {"BLOCK_SIZE_M": 16, "SPLIT_K": 2}}, "SPLIT_K"),
    ({"1": {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_Q": 2}}, "unknown field"),
    ({"1": {"BLOCK_SIZE_M": "16"}}, "positive int"),
])
def test_schema_errors_name_the_problem(doc, needle):
    assert any(needle in e for e in schema_errors(doc))


def test_read_table_refuses_a_broken_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"1": {"BLOCK_SIZE_M": 16, "SPLIT_K": 4}}))
    with pytest.raises(ValueError, match="SPLIT_K"):
        read_table(p)
