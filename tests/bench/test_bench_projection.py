"""Bytes per decode step, counted from the bundled Ling-3.0-flash INT4 config (a projection, not a timing).

Expected values are written by hand from the Flash shapes (docs/architecture.md §KDA, §MLA, §MoE), not
read from the tensor table the projection sums.
"""

import pytest

import json

from ling_bench.projection import (DSPARK_FILE_PARAMS, StepBytes, acceptance_for_length, break_even_length,
                                   decode_step_bytes, dspark_params, dspark_round_bytes, experts_touched, lane_rows,
                                   main, matrix_bytes, mean_accepted_length, mtp_round_bytes, narrow_block_length,
                                   project, round_rows)
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


def test_mtp_k1_round_is_the_verify_step_and_its_figures_are_unchanged():
    assert mtp_round_bytes(CONFIG, 4096, 1).total == 9_769_082_880
    r = project(CONFIG, 4096, 273, 0.7, 0.94)
    rows = round_rows(CONFIG, 4096, 273, 0.7, ["plain", "mtp"], [1], [], [0.94], [])
    bf16 = {row["method"]: row for row in rows if row["format"] == "bf16"}
    assert bf16["mtp"]["tok_s"] == pytest.approx(r["mtp_tok_s"]) and bf16["mtp"]["al"] == pytest.approx(1.94)
    assert bf16["plain"]["tok_s"] == pytest.approx(r["plain_tok_s"])


def test_mtp_rounds_grow_with_k_by_a_draft_step_and_a_wider_verify():
    plain = decode_step_bytes(CONFIG, 4096)
    draft = decode_step_bytes(CONFIG, 4096, tokens=2, mtp=True).parts["MTP draft"]
    rounds = [mtp_round_bytes(CONFIG, 4096, k) for k in (1, 2, 3)]
    assert rounds[0].total < rounds[1].total < rounds[2].total
    for k, r in zip((1, 2, 3), rounds):
        assert r.parts["MTP draft"] == pytest.approx(k * draft)
        assert r.parts["KDA weights"] == plain.parts["KDA weights"]  # dense matrices: once, however many tokens
        assert r.parts["MoE (router, shared, routed INT4)"] > plain.parts["MoE (router, shared, routed INT4)"]


def test_accepted_length_from_a_per_position_rate_and_back():
    assert mean_accepted_length(0.94, 1) == pytest.approx(1.94)
    assert mean_accepted_length(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert acceptance_for_length(mean_accepted_length(0.7, 3), 3) == pytest.approx(0.7, abs=1e-9)
    assert acceptance_for_length(6.5, 3) == 1.0


def test_the_drafter_is_the_cards_961m_parameters():
    assert dspark_params(CONFIG) == pytest.approx(DSPARK_FILE_PARAMS, rel=1e-3)
    assert dspark_params(CONFIG) + VOCAB * H == pytest.approx(1_363_707_905, rel=1e-3)  # the card's 1.36B


def test_dspark_round_is_drafter_plus_verify_and_the_parts_add_up():
    for fp8 in (False, True):
        r = dspark_round_bytes(CONFIG, 4096, 8, fp8=fp8)
        verify = decode_step_bytes(CONFIG, 4096, tokens=9, fp8=fp8)
        assert {k.removeprefix("verify: "): v for k, v in r.parts.items() if k.startswith("verify: ")} == verify.parts
        drafter = r.total - verify.total
        w2 = VOCAB * 256 + (VOCAB * 4 if fp8 else VOCAB * 256)  # FP8: 1 byte + a channel scale; BF16: 2 bytes
        head = VOCAB * H + (VOCAB * 4 if fp8 else VOCAB * H)
        kv_cache = 4096 * 5 * 2 * 32 * 128 * 2
        assert r.parts["Markov head (markov_w2 per position)"] == 8 * (w2 + 256 * 2)
        assert r.parts["drafter LM head (one pass, K positions)"] == head
        assert r.parts["drafter KV cache"] == kv_cache
        parts = ["drafter fc (target features)", "drafter context K/V (k_proj, v_proj again)", "drafter layers",
                 "drafter KV cache", "drafter LM head (one pass, K positions)",
                 "Markov head (markov_w2 per position)", "confidence head"]
        assert sum(r.parts[p] for p in parts) == pytest.approx(drafter)
    bf16 = dspark_round_bytes(CONFIG, 4096, 8)
    assert 157184 * 256 * 2 / 1e6 == pytest.approx(80.5, abs=0.1)  # the ~80 MB each position reads
    weights = sum(bf16.parts[p] for p in ["drafter fc (target features)", "drafter layers", "confidence head"])
    assert weights + VOCAB * 256 * 4 == pytest.approx(dspark_params(CONFIG) * 2, rel=1e-4)  # + w1, w2: all 2 B


def test_a_drafter_without_its_markov_head_reads_less():
    """The negative control: dropping a part changes the bytes (the sums above are not vacuous)."""
    r = dspark_round_bytes(CONFIG, 4096, 8)
    without = StepBytes({k: v for k, v in r.parts.items() if not k.startswith("Markov")})
    assert r.total - without.total == pytest.approx(8 * 80.5e6, rel=1e-2)
    assert dspark_round_bytes(CONFIG, 4096, 4).total < dspark_round_bytes(CONFIG, 4096, 8).total
    cut = dspark_round_bytes(CONFIG, 4096, 8, draft_vocab=32768)
    assert r.total - cut.total == pytest.approx(
        (1 - 32768 / VOCAB) * (r.parts["drafter LM head (one pass, K positions)"] + 8 * VOCAB * 256 * 2))


def test_accepted_length_is_capped_at_k_plus_one_and_tok_s_grows_with_it():
    rows = round_rows(CONFIG, 4096, 273, 0.7, ["dspark"], [], [4, 8], [], [1.5, 3.5, 5.3, 6.5, 9.0])
    for r in rows:
        assert r["al"] == min(r["al_given"], r["k"] + 1) and r["capped"] == (r["al_given"] > r["k"] + 1)
    for fmt in ("bf16", "fp8"):
        for k in (4, 8):
            speeds = [r["tok_s"] for r in rows if r["format"] == fmt and r["k"] == k]
            assert speeds == sorted(speeds) and len(set(speeds)) == (3 if k == 4 else 5)  # K = 4: 5.3, 6.5, 9 all cap at 5
    k8 = {r["al_given"]: r for r in rows if r["format"] == "bf16" and r["k"] == 8}
    assert k8[9.0]["tok_s"] == pytest.approx(k8[6.5]["tok_s"] * 9 / 6.5)


def test_cli_json_holds_every_row(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["--k", "1,2,3", "--block", "4,6,8", "--acceptance", "0.94,0.70",
                 "--acceptance-length", "3.5,3.7,5.3,6.5", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PROJECTED GB10 tok/s" in text and "dspark" in text
    rows = json.loads(out.read_text())["rows"]
    # per format: plain 1; MTP 3 k x 2 rates + the 2 ALs (3.5, 3.7) that k = 3 reaches; DSpark 3 K x 4 ALs
    assert len(rows) == 2 * (1 + 6 + 2 + 12)
    keys = {"method", "k", "format", "acceptance", "al", "al_given", "capped", "gb_per_round", "draft_gb",
            "verify_gb", "round_over_plain_bytes", "tok_s", "al_one_rate", "tok_s_one_rate"}
    assert all(set(r) == keys for r in rows)
    assert {(r["method"], r["k"], r["format"]) for r in rows if r["method"] == "dspark"} == {
        ("dspark", k, f) for k in (4, 6, 8) for f in ("bf16", "fp8")}
    for r in rows:
        assert r["gb_per_round"] == pytest.approx(r["draft_gb"] + r["verify_gb"])
        assert r["tok_s"] == pytest.approx(r["al"] * 273e9 * 0.7 / (r["gb_per_round"] * 1e9))
    assert main(["--method", "plain"]) == 0 and "dspark" not in capsys.readouterr().out


def test_lanes_share_the_dense_bytes_and_add_their_own_state_kv_and_experts():
    """Two sequences at 4096: one more copy of the 35 KDA states (32 x 128 x 128 fp32, read and written) and of the
    MLA KV, the experts two tokens touch, every other matrix once; one sequence is the batch-1 step exactly."""
    one, two = decode_step_bytes(CONFIG, 4096), decode_step_bytes(CONFIG, 4096, seqs=2)
    assert decode_step_bytes(CONFIG, 4096, seqs=1).total == one.total
    state = "KDA state (read + write)"
    assert two.parts[state] == 2 * one.parts[state] == 2 * 35 * 2 * HEADS * 128 * 128 * 4
    assert two.parts["MLA KV cache"] == 2 * one.parts["MLA KV cache"]
    assert two.parts["lm_head"] == one.parts["lm_head"] and two.parts["KDA weights"] == one.parts["KDA weights"]
    e, top_k = CONFIG["num_experts"], CONFIG["num_experts_per_tok"]
    routed_share = experts_touched(e, top_k, 2) / experts_touched(e, top_k, 1)
    assert one.parts["MoE (router, shared, routed INT4)"] < two.parts["MoE (router, shared, routed INT4)"] \
        < routed_share * one.parts["MoE (router, shared, routed INT4)"]  # shared experts and router are not doubled
    assert mtp_round_bytes(CONFIG, 4096, 1, seqs=2).total > mtp_round_bytes(CONFIG, 4096, 1).total


def test_lane_rows_trade_per_request_speed_for_aggregate():
    rows = lane_rows(CONFIG, 4096, 273.0, 0.7, [1, 2, 4, 8], 0.94)
    plain_fp8 = {r["lanes"]: r for r in rows if r["method"] == "plain" and r["format"] == "fp8"}
    single = round_rows(CONFIG, 4096, 273.0, 0.7, ["plain"], [1], [8], [0.94], [3.5])
    assert plain_fp8[1]["per_request_tok_s"] == pytest.approx(next(r["tok_s"] for r in single if r["format"] == "fp8"))
    for method in ("plain", "mtp"):
        for fmt in ("bf16", "fp8"):
            got = [r for r in rows if r["method"] == method and r["format"] == fmt]
            assert [r["lanes"] for r in got] == [1, 2, 4, 8]
            assert all(a["per_request_tok_s"] > b["per_request_tok_s"] for a, b in zip(got, got[1:]))
            assert all(a["aggregate_tok_s"] < b["aggregate_tok_s"] for a, b in zip(got, got[1:]))
            assert all(r["aggregate_tok_s"] == pytest.approx(r["lanes"] * r["per_request_tok_s"]) for r in got)
    mtp = next(r for r in rows if r["method"] == "mtp" and r["lanes"] == 1 and r["format"] == "fp8")
    assert mtp["al"] == pytest.approx(1.94) and mtp["per_request_tok_s"] == pytest.approx(
        1.94 * 273e9 * 0.7 / mtp_round_bytes(CONFIG, 4096, 1, fp8=True).total)


def test_the_cli_projects_lanes_when_asked(capsys, tmp_path):
    assert main(["--method", "plain", "--lanes", "1,2", "--json", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "Lanes (sequences decoding together" in out and "mtp k=1" in out
    assert [r["lanes"] for r in json.loads((tmp_path / "p.json").read_text())["lanes"]] == [1, 2, 1, 2] * 2
    main(["--method", "plain"])
    assert "Lanes" not in capsys.readouterr().out


def test_a_narrow_block_keeps_the_first_drafts_of_the_card_length_at_one_rate():
    """AL 6.5 at the drafter's block of 8 is one per-position rate a with 1 + a + ... + a^8 = 6.5; a 6-wide block of
    the same drafts gets 1 + a + ... + a^6. At K = 8 it is the given length; narrower blocks get less, never more."""
    assert narrow_block_length(6.5, 8) == pytest.approx(6.5)
    a = acceptance_for_length(6.5, 8)
    assert narrow_block_length(6.5, 6) == pytest.approx(sum(a ** i for i in range(7)))
    assert narrow_block_length(6.5, 4) < narrow_block_length(6.5, 6) < 6.5
    assert narrow_block_length(9.0, 4) == pytest.approx(5.0)  # every draft accepted: K + 1
    rows = round_rows(CONFIG, 4096, 273, 0.7, ["mtp", "dspark"], [1], [6, 8], [0.94], [5.3])
    assert all(r["al_one_rate"] is None and r["tok_s_one_rate"] is None for r in rows if r["method"] == "mtp")
    k6 = next(r for r in rows if r["method"] == "dspark" and r["k"] == 6 and r["format"] == "fp8")
    assert k6["al_one_rate"] < k6["al"] and k6["tok_s_one_rate"] == pytest.approx(
        k6["al_one_rate"] * 273e9 * 0.7 / (k6["gb_per_round"] * 1e9))


@pytest.mark.parametrize("method, k", [("mtp", 1), ("mtp", 3), ("dspark", 4), ("dspark", 8)])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_at_the_break_even_length_a_round_decodes_as_fast_as_plain_steps(method, k, fmt):
    """tok/s = AL x bandwidth / bytes: at AL = round bytes / plain bytes the round's tok/s equals a plain step's;
    a wider round needs more accepted tokens to pay (K = 8 above K = 4, k = 3 above k = 1)."""
    length = break_even_length(CONFIG, method, k, fmt == "fp8")
    rows = round_rows(CONFIG, 4096, 273.0, 0.7, ["plain", method], [k], [k], [], [length])
    plain = next(r["tok_s"] for r in rows if r["method"] == "plain" and r["format"] == fmt)
    spec = next(r for r in rows if r["method"] == method and r["format"] == fmt)
    assert spec["round_over_plain_bytes"] == pytest.approx(length) and spec["tok_s"] == pytest.approx(plain)
    assert 1 < length < k + 1  # within reach: a round that always accepted everything would pay
    wider = break_even_length(CONFIG, method, {"mtp": 3, "dspark": 8}[method], fmt == "fp8")
    assert wider >= length


def test_the_break_even_cli_prints_one_number_for_the_recipe(capsys):
    assert main(["--break-even", "dspark:8", "--format", "fp8", "--draft-format", "bf16"]) == 0
    assert float(capsys.readouterr().out) == pytest.approx(break_even_length(CONFIG, "dspark", 8, True,
                                                                             draft_fp8=False), abs=0.005)
    assert main(["--break-even", "mtp:1"]) == 0  # the target in FP8 by default, as the recipe serves on a GPU
    assert float(capsys.readouterr().out) == pytest.approx(break_even_length(CONFIG, "mtp", 1, True), abs=0.005)
    with pytest.raises(SystemExit):
        main(["--break-even", "eagle:3"])
    assert "expected mtp:K or dspark:K" in capsys.readouterr().err
    with pytest.raises(ValueError, match="mtp or dspark"):
        break_even_length(CONFIG, "plain", 1, True)
