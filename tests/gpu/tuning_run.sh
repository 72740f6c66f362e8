#!/usr/bin/env bash
# Every GPU step of ling_tuning on the H200, in about 7 minutes. From the repository root:
#   source .devbundle/N/activate.sh || exit 1; bash tests/gpu/tuning_run.sh
# (carry [".devbundle/N"], N the bundle's last chunk; each other chunk K stashed first on the same warm machine
# by its own call, carry [".devbundle/K"], command `bash .devbundle/K/stash.sh`: tests/gpu/run_on_device.sh's
# header has the whole procedure).
# It imports ling_tuning from this checkout (a symlink shim on PYTHONPATH), so no install is needed
# and a stale installed copy cannot shadow it. Knobs: LING_TUNE_BUDGET_MIN (2.0), LING_TUNE_MAX_CANDIDATES (16),
# LING_TUNE_ENGINE_BACKENDS (none; e.g. marlin,humming,triton races them in the engine after tuning, ~2-3 min each).
#
# $OUT gets at most 8 files, each written as soon as its step ends:
#   log.txt          everything printed
#   pytest_gpu.txt   tests/gpu/test_tuning_gpu.py (runner correctness, compiled smem vs estimate, vLLM lookup, guard probe)
#   steps.json       per step: ok, seconds, error + traceback
#   summary.md       the tables: per-M search, default vs tuned vs Marlin with GB/s, vLLM proof, backend choice
#   tune_h200.json   ling-tune report, native limit (232,448 B)
#   tune_gb10emu.json  the same with --smem-limit 101376
#   tuned_tables.json  both tuned tables (their '=' file names cannot come back as files) + backend choices
#   kda_guard.json   vLLM's vendored KDA autotuners guarded to 101,376 B: kept / dropped / chosen configs
set -uo pipefail
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIM="$(mktemp -d)"
trap 'rm -rf "$SHIM"' EXIT
ln -s "$REPO/tuning" "$SHIM/ling_tuning"
ln -s "$REPO/vllm_ling" "$SHIM/vllm_ling"
ln -s "$REPO/bench" "$SHIM/ling_bench"  # the engine race profiles with ling_bench.fullsize
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_PRINT_AUTOTUNING=0
exec > >(tee -a "$OUT/log.txt") 2>&1
cd "$REPO"
t0=$SECONDS

echo "== environment"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 || true
python3 - <<'PY' || echo "environment check failed"
import torch, triton, ling_tuning
p = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__} triton {triton.__version__} | {p.name} sm_{p.major}{p.minor} "
      f"{p.multi_processor_count} SMs smem/block opt-in {getattr(p, 'shared_memory_per_block_optin', '?')} B | "
      f"ling_tuning from {ling_tuning.__path__[0]}")
PY

echo "== 1/2 GPU tests (limit 150 s)"
timeout -k 10 150 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu/test_tuning_gpu.py \
    > "$OUT/pytest_gpu.txt" 2>&1
echo "pytest rc=$? at $((SECONDS - t0)) s"
tail -n 15 "$OUT/pytest_gpu.txt"

echo "== 2/2 ling-tune (native, then GB10 emulated), vLLM proof, default/tuned/Marlin, KDA guard (limit 360 s)"
timeout -k 15 360 python3 tests/gpu/tuning_steps.py --out "$OUT"
echo "tuning_steps rc=$? at $((SECONDS - t0)) s"
sed -n '1,200p' "$OUT/summary.md" 2>/dev/null || echo "no summary.md"
echo "== done in $((SECONDS - t0)) s; files: $(ls "$OUT" | tr '\n' ' ')"
