"""Bytes per decode step, counted from the bundled Ling-3.0-flash INT4 config (a projection, not a timing).

Expected values are written by hand from the Flash shapes (docs/architecture.md §KDA, §MLA, §MoE), not
read from the tensor table the projection sums.
"""

import pytest

from ling_bench.projection import decode_step_bytes, experts_touched, main, matrix_bytes, project
from vllm_ling.configs import flash_config
from ling_tools.tensors import TensorSpec

CONFIG = flash_config()
H, P, HEADS, VOCAB = 2560, 4096, 32, 157184


def test_an_int4_expert_streams_3_32_mb_with_its_scales():
    expert = sum(matrix_bytes("x", TensorSpec(shape, "expert")) for shape in [(768, H), (768, H), (H, 768)])
    assert expert == 3 * 768 * H / 2 + 3 * 768 * (H // 32) * 2
    assert expert / 1e6 == pytest.approx(3.32, abs=0.01)


def test_one_token_touches_top_k_experts_and_more_tokens_touch_more():
    assert experts_touched(512, 8, 1) == pytest.approx(8)
    assert 8 < experts_touched(512, 8, 2) < 16


def test_bf16_steps_are_the_numbers_findings_quotes():
    """FINDINGS.md §6: 7.78 GB plain, 9.77 GB verify at context 4096 (Spark owners: 8.40 GB per token, docs/ops-walls.md)."""
    plain = decode_step_bytes(CONFIG, context=4096)
    assert plain.total == 7_780_761_600
    assert decode_step_bytes(CONFIG, 4096, tokens=2, mtp=True).total == 9_769_082_880
    assert plain.parts["lm_head"] == VOCAB * H * 2
    assert plain.parts["KDA weights"] == 35 * ((6 * P * H + HEADS * H) * 2 + 3 * P * 4 * 4)


def test_fp8_reads_one_byte_plus_a_channel_scale_for_bf16_matrices():
    bf16, fp8 = decode_step_bytes(CONFIG, 4096), decode_step_bytes(CONFIG, 4096, fp8=True)
    kda_matrices = {(P, H): 5, (H, P): 1, (HEADS, H): 1}  # q k v f g, o, b
    kda = sum(n * (out * inp + out * 4) for (out, inp), n in kda_matrices.items()) + 3 * P * 4 * 4  # conv fp32
    assert fp8.parts["KDA weights"] == 35 * kda
    assert fp8.parts["lm_head"] == VOCAB * H + VOCAB * 4
    mla_fp8 = sum(out * inp + out * 4 for out, inp in [(6144, H), (576, H), (HEADS, H), (H, P)])
    assert fp8.parts["MLA weights"] == 7 * (mla_fp8 + 8192 * 512 * 2)  # kv_b_proj stays BF16
    shared_saved = 3 * 768 * H - 4 * (768 + 768 + H)  # router fp32 and routed INT4 unchanged
    assert bf16.parts["MoE (router, shared, routed INT4)"] - fp8.parts["MoE (router, shared, routed INT4)"] == (
        pytest.approx(40 * shared_saved))
    assert fp8.parts["KDA state (read + write)"] == bf16.parts["KDA state (read + write)"]
    assert fp8.parts["MLA KV cache"] == bf16.parts["MLA KV cache"]


def test_fp8_keeps_the_drafts_eh_proj_in_bf16():
    bf16 = decode_step_bytes(CONFIG, 4096, tokens=2, mtp=True).parts["MTP draft"]
    fp8 = decode_step_bytes(CONFIG, 4096, tokens=2, mtp=True, fp8=True).parts["MTP draft"]
    mla_saved = sum(out * inp - out * 4 for out, inp in [(6144, H), (576, H), (HEADS, H), (H, P)])
    shared_saved = 3 * 768 * H - 4 * (768 + 768 + H)
    lm_head_saved = VOCAB * H - VOCAB * 4
    assert bf16 - fp8 == pytest.approx(mla_saved + shared_saved + lm_head_saved)  # eh_proj [H, 2H] unchanged


def test_context_and_mtp_add_bytes():
    short, long = decode_step_bytes(CONFIG, 1024), decode_step_bytes(CONFIG, 65536)
    assert long.total > short.total
    assert decode_step_bytes(CONFIG, 1024, tokens=2, mtp=True).total > short.total


def test_projection_reproduces_the_spark_peer_numbers_roughly():
    r = project(CONFIG, 4096, bandwidth_gbs=273, efficiency=0.7, acceptance=0.94)
    assert 18 < r["plain_tok_s"] < 30  # measured on a Spark: 22.9 tok/s (graphs, no MTP)
    assert 30 < r["mtp_tok_s"] < 48  # measured: 38.7-40.9 tok/s with MTP k=1


def test_cli_labels_it_a_projection_and_prints_both_formats_at_both_acceptances(capsys):
    assert main(["--context", "4096"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PROJECTION (arithmetic, not a measurement)")
    assert "bf16 today" in out and "fp8" in out
    plain = next(line for line in out.splitlines() if "plain decode step" in line).split()
    verify = next(line for line in out.splitlines() if "verify step" in line).split()
    assert plain[-2] == "7.78" and verify[-2] == "9.77"
    assert "94% acceptance" in out and "70% acceptance" in out


def test_fullsize_roofline_counts_the_weight_format_it_served(tmp_path):
    from ling_bench.fullsize import roofline
    from ling_tools.tiny import write_full_config

    model = str(write_full_config(tmp_path / "flash"))
    bf16, fp8 = (roofline(model, "graphs", 4096, 0.01, None, 0.0, fp8=f)["bytes_per_step_gb"] for f in (False, True))
    assert bf16 == pytest.approx(7.7808, abs=1e-4) and fp8 == pytest.approx(4.65, abs=0.01)


def test_a_draft_vocabulary_cuts_only_the_drafts_head_pass_in_proportion():
    c = flash_config()
    vocab = c["vocab_size"]
    for fp8 in (False, True):
        whole = decode_step_bytes(c, 4096, tokens=2, mtp=True, fp8=fp8)
        same = decode_step_bytes(c, 4096, tokens=2, mtp=True, fp8=fp8, draft_vocab=vocab)
        cut = decode_step_bytes(c, 4096, tokens=2, mtp=True, fp8=fp8, draft_vocab=32768)
        head = whole.parts["lm_head"]  # the target's pass, which a draft vocabulary leaves whole
        assert same.parts == whole.parts and cut.parts["lm_head"] == head
        assert cut.parts["MTP draft"] == pytest.approx(whole.parts["MTP draft"] - head * (1 - 32768 / vocab))
    assert project(c, 4096, 273, 0.7, 0.94, fp8=True, draft_vocab=32768)["mtp_tok_s"] > \
        project(c, 4096, 273, 0.7, 0.94, fp8=True)["mtp_tok_s"]
