"""Bytes per decode step, counted from the bundled Ling-3.0-flash INT4 config (a projection, not a timing)."""

import json
from pathlib import Path

import pytest

from ling_bench.projection import _experts_touched, _int4_expert, decode_step_bytes, main, project

CONFIG = json.loads((Path(__file__).parents[2] / "vllm_ling/configs/ling-3.0-flash-int4/config.json").read_text())


def test_an_int4_expert_streams_3_32_mb_with_its_scales():
    assert _int4_expert(CONFIG) == pytest.approx(3 * 768 * 2560 / 2 + 3 * 768 * 80 * 2)
    assert _int4_expert(CONFIG) / 1e6 == pytest.approx(3.32, abs=0.01)


def test_one_token_touches_top_k_experts_and_more_tokens_touch_more():
    assert _experts_touched(512, 8, 1) == pytest.approx(8)
    assert 8 < _experts_touched(512, 8, 2) < 16


def test_step_bytes_near_the_public_8_4_gb_per_token():
    step = decode_step_bytes(CONFIG, context=4096)
    assert 7.0e9 < step.total < 9.0e9  # ops-facts W11: 8.40 GB/token
    assert step.parts["lm_head"] == 157184 * 2560 * 2


def test_context_and_mtp_add_bytes():
    short, long = decode_step_bytes(CONFIG, 1024), decode_step_bytes(CONFIG, 65536)
    assert long.total > short.total
    assert decode_step_bytes(CONFIG, 1024, tokens=2, mtp=True).total > short.total


def test_projection_reproduces_the_spark_peer_numbers_roughly():
    r = project(CONFIG, 4096, bandwidth_gbs=273, efficiency=0.7, acceptance=0.94)
    assert 18 < r["plain_tok_s"] < 30  # measured on a Spark: 22.9 tok/s (graphs, no MTP)
    assert 30 < r["mtp_tok_s"] < 48  # measured: 38.7-40.9 tok/s with MTP k=1


def test_cli_labels_it_a_projection(capsys):
    assert main(["--context", "2048"]) == 0
    assert "PROJECTION" in capsys.readouterr().out
