#!/usr/bin/env bash
# One device call = one step of the GPU plan. From the repo root on the H200, after the bundle's other
# chunks were stashed (../shared/device/README.md), with carry [".devbundle/4"]:
#   source .devbundle/4/activate.sh || exit 1; bash tests/gpu/run_on_device.sh STEP
# Steps (minutes on a warm machine, measured or estimated):
#   model       tiny model bf16 & INT4 vs the oracle (+ its bf16 floor), CUDA graphs (~6; bf16 alone ~4)
#   model_triton  the INT4 checkpoint through the Triton/CUDA wna16 MoE kernels        (~3)
#   kda         vLLM 0.26 KDA kernels fed our gate vs the fp32 recurrence, + kda_core   (~2)
#   kda_core    our CUDA glue (run_cuda) vs the CPU path on decode and verify batches    (~1)
#   mtp         MTP k=1 lossless + acceptance, for a draft built to agree (mtp_echo) and a random one
#               (stable_router): the four engines side by side, then both oracles     (~5, estimated; 8 when
#               each checkpoint's pair ran in turn)
#   tuning      ling-tune on the H200 + GB10-emulated, vLLM pickup, vs Marlin        (~7)
#   fullsize_eager | fullsize_graphs | fullsize_mtp   124B dummy weights, batch 1   (graphs 5, mtp 4 measured)
# Results land in $OUT (at most 8 files come back).
set -uo pipefail
: "${OUT:?run on the device: OUT is the folder that comes back}"
STEP=${1:?step: model | model_triton | kda | kda_core | mtp | tuning | fullsize_eager | fullsize_graphs | fullsize_mtp}
rm -rf /tmp/vllm-ling-src && mkdir /tmp/vllm-ling-src && tar --exclude=./.devbundle --exclude=./.git -cf - . | tar -xf - -C /tmp/vllm-ling-src
python3 -m pip install -q --upgrade --no-deps --no-build-isolation --no-index --target "$HOME/vllm-site" /tmp/vllm-ling-src \
    2>&1 | grep -v "already exists" || true
export VLLM_LING_GPU_RESULTS=$OUT
run() { timeout -k 10 "$1" "${@:2}" 2>&1 | tee -a "$OUT/$STEP.log" | grep -v " INFO \| WARNING " | tail -40; }
case $STEP in
    model) run 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py -k "not int4_triton" ;;
    model_triton) run 560 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_model_gpu.py -k int4_triton ;;
    kda) run 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kda_kernels_gpu.py tests/gpu/test_kda_core_gpu.py ;;
    kda_core) run 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kda_core_gpu.py ;;
    mtp) run 580 python3 -m pytest -q -p no:cacheprovider --durations=6 tests/gpu/test_mtp_gpu.py ;;
    tuning) bash tuning/device_run.sh ;;
    fullsize_*)
        python3 -m vllm_ling.tiny /tmp/flash --full-config --force >/dev/null
        run 560 python3 -m ling_bench.fullsize /tmp/flash --mode "${STEP#fullsize_}" --out "$OUT/$STEP.json" ;;
    *) echo "unknown step $STEP" >&2; exit 2 ;;
esac
