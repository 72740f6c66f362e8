"""ling_bench.kernel_diff on the profiles the H200 wrote (results/), and on a run that has none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ling_bench.kernel_diff import FAMILIES, by_family, family, load, main, report, tokens_per_step

RUN = Path(__file__).resolve().parents[2] / "results" / "h200-2026-12-02-router-gemm"
PLAIN, MTP = str(RUN / "fs_rg.json"), str(RUN / "fs_mtprg.json")


@pytest.mark.parametrize("name, expected", [
    ("triton_red_fused__to_copy_abs_add_amax_clamp_cutlass_scaled_mm_div_fused_add_rms_norm_mul", "norms + FP8"),
    ("void cutlass::device_kernel<vllm::cutlass_3x_gemm_sm90_fp8<cutlass::float_e4m3_t", "FP8 GEMM"),
    ("void humming<MmaOpClass, Shape<0u, 1536u, 2560u>", "routed experts"),
    ("void process_input_kernel<Config, TuningConfig, (ProcessInputQuantizationPhase)0>", "routed experts"),
    ("void vllm::moe::count_and_sort_expert_tokens_kernel<int>(int const*", "MoE token layout"),
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 2, 2, true", "router GEMM"),
    ("_router_gemm_kernel", "router GEMM"),
    ("_ling_route_kernel", "routing"),
    ("fused_recurrent_kda_packed_decode_kernel", "KDA"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple", "MLA / attention"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "BF16 GEMM"),
    ("triton_red_fused__to_copy_fused_add_rms_norm_1", "norms, elementwise"),
    ("_gumbel_sample_kernel", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::silu_kernel", "norms, elementwise"),
    ("memcpy32_post", "copies, other"),
])
def test_each_kernel_seen_on_the_h200_lands_in_its_family(name, expected):
    assert family(name).startswith(expected)


def test_every_name_has_a_family():
    assert FAMILIES[-1][1] == "" and family("a kernel nobody has seen") == FAMILIES[-1][0]


def test_an_mtp_profile_per_verify_step_is_per_token_times_tokens_a_step():
    """A recorded verify step: 128 tokens over 66.3 verify steps; the families and 'unlisted' add up to the total."""
    plain, mtp = load(PLAIN), load(MTP)
    assert tokens_per_step(plain) == 1.0 and tokens_per_step(mtp) == pytest.approx(128 / 66.333, rel=1e-3)
    per_token, _ = by_family(mtp, per_step=False)
    per_step, totals = by_family(mtp, per_step=True)
    assert 0 <= per_step["unlisted"] < 0.1 * totals["gpu_us_per_step"]  # the 30 kernels named cover >90% of it
    assert per_step["router GEMM (fp32)"] == pytest.approx(per_token["router GEMM (fp32)"] * tokens_per_step(mtp))
    text = report(plain, mtp, per_step=True)
    assert "per target step" in text and "(B/A 1.213)" in text  # summed kernel time, verify over plain


@pytest.mark.parametrize("content, says", [
    ([1, 2], "not a ling_bench.fullsize result"),
    ({"decode_tokens": 128, "kernels": {"top": [], "gpu_us_per_step": 1.0},
      "by_acceptance": [{"verify_steps_per_request": 0}]}, "without verify steps"),
])
def test_a_file_it_cannot_read_per_step_is_refused_with_the_reason(tmp_path, capsys, content, says):
    run = tmp_path / "odd.json"
    run.write_text(json.dumps(content))
    with pytest.raises(SystemExit) as e:
        main([PLAIN, str(run), "--per-step"])
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_run_without_a_profile_is_refused_by_name(tmp_path, capsys):
    run = tmp_path / "plain.json"
    run.write_text(json.dumps({"decode_tokens": 128, "kernels": {"error": "RuntimeError: no CUDA"}}))
    with pytest.raises(SystemExit) as e:
        main([str(run), MTP])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "plain.json: no kernel profile" in err and "--kernels" in err
