"""Where one `ling_bench.fullsize --kernels` profile spends GPU time that another does not, by kernel family.

Each profile lists its 80 costliest kernels (µs and launches per decoded token) and their totals. An MTP run's
figures are per generated token; `--per-step` turns them into per verify step (x tokens a step, the first
acceptance phase's `decode_tokens / verify_steps_per_request`), the unit the MTP target "verify step <= 1.25x a
plain step" is stated in. BENCHMARKS.md (2026-12-02) did this by hand (expert GEMMs +372 µs, router +315, FP8
GEMMs +276, ...); this makes it one command:

    python -m ling_bench.kernel_diff results/.../fs_rg.json results/.../fs_mtprg.json --per-step
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

# (family, pattern on the lower-cased kernel name): the first match wins. Written from every kernel in the profiles
# under results/ (2026-12-01 to 2026-12-02); Inductor names a fused kernel after the ops it swallowed, hence the order.
FAMILIES = [
    ("norms + FP8 activation quant (Inductor)", r"^triton_.*amax"),
    ("FP8 GEMM (CUTLASS, our GEMV)", r"cutlass.*fp8|_fp8_gemv|scaled_mm"),
    ("routed experts (Humming / Marlin / Triton MoE)", r"humming|marlin|moe_wna16|fused_moe_kernel"
                                                       r"|process_input_kernel|moe_fused_mul_sum"),
    ("MoE token layout", r"moe_align|count_and_sort"),
    ("router GEMM (fp32)", r"_router_gemm_kernel|gemvx|gemmsn"),
    ("routing (top-k, groups)", r"_ling_route|grouped_topk"),
    ("KDA (recurrence, conv, gate)", r"kda|delta_rule|causal_conv"),
    ("sampling", r"sampl|gumbel|top_?k_?top_?p|argmax"),
    ("MLA / attention", r"flash|mla|attention|rotary|concat_and_cache"),
    ("BF16 GEMM (cuBLAS, CUTLASS)", r"nvjet|splitkreduce|gemm|cutlass|xmma"),
    ("norms, elementwise (Inductor / Triton / torch)", r"^triton_|fused|elementwise"),
    ("copies, other", r""),
]


def family(name: str) -> str:
    lowered = name.lower()
    return next(f for f, pattern in FAMILIES if re.search(pattern, lowered))


def tokens_per_step(run: dict) -> float:
    """Generated tokens per target step: 1 for a plain run; an MTP run's first acceptance phase's tokens per verify
    step (its profile was taken at that phase's setting; the profiled request's own count is not recorded, so this
    is the phase's average: launch counts of 2026-12-02 put it within 0.5%)."""
    phases = run.get("by_acceptance") or []
    if not phases:
        return 1.0
    steps = phases[0].get("verify_steps_per_request")
    if not steps:
        raise ValueError(f"{run.get('_path', 'run')}: an MTP run without verify steps counted; per-step figures "
                         "need them (leave out --per-step for per-token figures)")
    return run["decode_tokens"] / steps


def by_family(run: dict, per_step: bool) -> tuple[Counter, dict[str, float]]:
    """(µs per family, the profile's totals), per token or per target step; kernels past the profile's list
    are 'unlisted'."""
    kernels = run.get("kernels") or {}
    if "top" not in kernels or "gpu_us_per_step" not in kernels:
        raise ValueError(f"{run.get('_path', 'run')}: no kernel profile (run ling_bench.fullsize with --kernels)")
    scale = tokens_per_step(run) if per_step else 1.0
    us = Counter()
    for k in kernels["top"]:
        us[family(k["name"])] += k["us"] * scale
    totals = {key: kernels[key] * scale for key in ("gpu_us_per_step", "gpu_busy_us_per_step", "kernels_per_step")
              if key in kernels}
    us["unlisted"] = totals["gpu_us_per_step"] - sum(us.values())
    return us, totals


def report(a: dict, b: dict, per_step: bool) -> str:
    (fa, ta), (fb, tb) = by_family(a, per_step), by_family(b, per_step)
    unit = "per target step" if per_step else "per generated token"
    width = max(len(f) for f in [*fa, *fb, "GPU busy (kernel-interval union)"])
    lines = [f"µs {unit}: A = {a['_path']}, B = {b['_path']}",
             f"{'':{width}}  {'A':>9}  {'B':>9}  {'B - A':>9}"]
    for f in sorted(set(fa) | set(fb), key=lambda f: -abs(fb[f] - fa[f])):
        lines.append(f"{f:{width}}  {fa[f]:9.1f}  {fb[f]:9.1f}  {fb[f] - fa[f]:+9.1f}")
    for key, label in (("gpu_us_per_step", "kernel time summed"), ("gpu_busy_us_per_step",
                                                                  "GPU busy (kernel-interval union)"),
                       ("kernels_per_step", "kernels (count)")):
        if key in ta and key in tb:
            lines.append(f"{label:{width}}  {ta[key]:9.1f}  {tb[key]:9.1f}  {tb[key] - ta[key]:+9.1f}"
                         + (f"  (B/A {tb[key] / ta[key]:.3f})" if ta[key] else ""))
    return "\n".join(lines)


def load(path: str) -> dict:
    run = json.loads(Path(path).read_text())
    if not isinstance(run, dict):
        raise ValueError(f"{path}: not a ling_bench.fullsize result (a JSON object)")
    run["_path"] = path
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", help="a ling_bench.fullsize --kernels result (JSON), e.g. the plain recipe")
    ap.add_argument("b", help="another, e.g. the same recipe with --mode mtp")
    ap.add_argument("--per-step", action="store_true",
                    help="per target step (an MTP run's verify step) instead of per generated token")
    args = ap.parse_args(argv)
    try:
        print(report(load(args.a), load(args.b), args.per_step))
    except (OSError, ValueError, KeyError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
