#!/usr/bin/env bash
# Build the vLLM 0.33.0 bundle for the lent H200 (no network there; a call carries <= 64 MiB).
# 0.33.0 is the current release (in-tree Ling V3, Humming MoE); it needs torch 2.14.0+cu130, triton 3.8 and
# NCCL >= 2.30, none of which the device image has (torch 2.11, NCCL 2.28), so they travel too.
# Usage, from the project root:  bash tests/gpu/devbundle/vllm033/build.sh [OUTDIR]
#   default OUTDIR ~/.cache/vllm-ling/devbundle33 (outside the work tree, so it survives a fresh checkout);
#   then  ln -sfn ~/.cache/vllm-ling/devbundle33 .devbundle33  and carry ".devbundle33/K" (a path through the
#   link travels). ~10 min on 2 cores (mostly the download; gzip -1), once: the bundle does not change.
set -euo pipefail
ROOT=$PWD; OUT="${1:-$HOME/.cache/vllm-ling/devbundle33}"; [[ $OUT = /* ]] || OUT="$ROOT/$OUT"
HERE="$(cd "$(dirname "$0")" && pwd)"
[ -f "$OUT/MANIFEST" ] && { echo "bundle already at $OUT ($(ls -d "$OUT"/[0-9]* | wc -l) chunks)"; exit 0; }
DL="$(mktemp -d)"; trap 'rm -rf "$DL"' EXIT
PLAT=""; for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do PLAT="$PLAT --platform $p"; done
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
echo "[1/4] downloading vllm 0.33.0, torch 2.14.0, triton 3.8.0 and the small packages (cp312, x86_64)"
mkdir -p $DL/big $DL/parts
python3 -m pip download -q --no-deps $PLAT -d $DL/big vllm==0.33.0 torch==2.14.0 triton==3.8.0 2>&1 | grep -v "^WARNING: Location" || true
python3 -m pip download -q --no-deps $PLAT -d $DL/parts -r "$HERE/deps.txt" 2>&1 | grep -v "^WARNING: Location" || true
echo "[2/4] unpacking and slimming (FA2 kernels, Rust frontend, DeepGEMM, sm100 headers, triton's AMD backend)"
mkdir -p $DL/x && cd $DL/x && for w in $DL/big/*.whl; do python3 -m zipfile -e "$w" .; done
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs torch/bin/protoc*
rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 triton/backends/amd \
  triton/backends/nvidia/lib/cupti-blackwell/*.a triton/backends/nvidia/lib/cupti/*.a
sed -i '/amd/d' triton-*.dist-info/entry_points.txt           # the AMD backend is gone: do not advertise it
chmod +x triton/backends/nvidia/bin/* torch/bin/* 2>/dev/null || true   # zipfile drops the run bits
cp -r "$HERE/torchvision-stub/"* .   # vLLM 0.33/transformers import torchvision names; the image's is for torch 2.11
echo "[3/4] compressing (gzip -1: xz -6 took over an hour on 2 busy cores)"; tar cf - . | gzip -1 > $DL/core.tar.gz
split -b 55M -d $DL/core.tar.gz $DL/parts/core.tar.gz.part
echo "[4/4] packing into carry-sized chunks"; cd "$ROOT"
python3 - "$DL/parts" "$OUT" "$HERE" <<'PY'
import os, shutil, sys
src, out, here = sys.argv[1:]
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
cap, bins = 58 * 2**20, []
for f in files:
    size = os.path.getsize(os.path.join(src, f))
    if size > cap:  # a big wheel (NCCL) travels in pieces; activate.sh joins them
        with open(os.path.join(src, f), "rb") as fh:
            for i, piece in enumerate(iter(lambda: fh.read(52 * 2**20), b"")):
                open(os.path.join(src, f"{f}.piece{i:02d}"), "wb").write(piece)
        os.remove(os.path.join(src, f))
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
for f in files:
    size = os.path.getsize(os.path.join(src, f))
    for b in bins:
        if b[0] + size <= cap: b[0] += size; b[1].append(f); break
    else: bins.append([size, [f]])
for i, (_, fs) in enumerate(bins, 1):
    d = os.path.join(out, str(i)); os.makedirs(d)
    for f in fs: shutil.move(os.path.join(src, f), d)
    for s in ("stash.sh", "activate.sh"): shutil.copy(os.path.join(here, s), d)
open(os.path.join(out, "MANIFEST"), "w").write("\n".join(sorted(files)) + "\n")
for i in range(1, len(bins) + 1): shutil.copy(os.path.join(out, "MANIFEST"), os.path.join(out, str(i)))
print(f"{len(bins)} chunks:", ", ".join(f"{i}={b[0] >> 20} MiB" for i, b in enumerate(bins, 1)))
PY
echo "done: $OUT. Link it: ln -sfn $OUT .devbundle33; keep '/.devbundle33' out of git (.git/info/exclude)."
