import json

import pytest
from ling_tuning.choice import CHOICE_FILE, decide, recommended_backend, write_choice
from ling_tuning.compare import Row, Timing


def row(m: int, triton: float | None, marlin: float | None) -> Row:
    t = Timing(us=triton) if triton else Timing(error="RuntimeError: boom")
    mm = Timing(us=marlin) if marlin else Timing(error="RuntimeError: boom")
    return Row(m=m, kernel="cuda_wna16", experts=8.0, tuned=t, default=Timing(error="x"), marlin=mm)


def test_marlin_keeps_the_job_unless_triton_beats_it_by_the_margin():
    assert decide([row(1, 98.0, 100.0), row(8, 97.0, 100.0)], margin=0.05)[0] == "marlin"
    assert decide([row(1, 80.0, 100.0), row(8, 85.0, 100.0)], margin=0.05)[0] == "triton"


def test_geomean_over_decode_sizes_only():
    rows = [row(1, 50.0, 100.0), row(4, 50.0, 100.0), row(1024, 900.0, 100.0)]  # prefill loss ignored
    backend, why = decide(rows, decode_max_m=64)
    assert backend == "triton" and "2.00x" in why and "1024" not in why


def test_a_backend_that_fails_at_any_decode_size_loses():
    assert decide([row(1, None, 100.0), row(4, 10.0, 100.0)])[0] == "marlin"
    assert decide([row(1, 100.0, None), row(4, 100.0, 50.0)])[0] == "triton"
    assert decide([row(1, None, None)])[0] is None
    assert decide([row(1024, 1.0, 2.0)], decode_max_m=64)[0] is None


def test_written_choice_is_read_back_and_checked_against_the_device(tmp_path):
    doc = write_choice(tmp_path, "NVIDIA GB10", [row(1, 50.0, 100.0)])
    assert doc["moe_backend"] == "triton" and doc["env"]["VLLM_TUNED_CONFIG_FOLDER"] == str(tmp_path.resolve())
    assert doc["evidence"][0] == {"M": 1, "kernel": "cuda_wna16", "triton_us": 50.0, "marlin_us": 100.0,
                                  "default_us": None, "default_error": "x", "triton_error": None, "marlin_error": None}
    assert recommended_backend(tmp_path) == "triton"
    assert recommended_backend(tmp_path, device_name="NVIDIA GB10") == "triton"
    assert recommended_backend(tmp_path, device_name="NVIDIA H200") is None


@pytest.mark.parametrize("content", ["not json", json.dumps([1]), json.dumps({"moe_backend": "cutlass"}),
                                     json.dumps({"moe_backend": None})])
def test_unusable_choice_files_give_no_recommendation(tmp_path, content):
    (tmp_path / CHOICE_FILE).write_text(content)
    assert recommended_backend(tmp_path) is None


def test_missing_folder_gives_no_recommendation(tmp_path):
    assert recommended_backend(tmp_path / "nowhere") is None
