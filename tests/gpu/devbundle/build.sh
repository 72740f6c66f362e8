#!/usr/bin/env bash
# Build a vLLM bundle for the device H200 (no network there; a call carries <= 64 MiB).
# vLLM 0.33 and 0.34 need torch 2.14.0+cu130, triton 3.8 and NCCL >= 2.30, none of which the device image has
# (torch 2.11, NCCL 2.28), so they travel too, with the small packages in deps-RELEASE.txt.
# Usage, from the project root:  bash tests/gpu/devbundle/build.sh 0.34|0.33 [OUTDIR]
#   default OUTDIR ~/.cache/vllm-ling/devbundle34 (33) (outside the work tree, so it survives a fresh checkout);
#   then  ln -sfn ~/.cache/vllm-ling/devbundle34 .devbundle34  and carry ".devbundle34/K" (a path through the
#   link travels). ~10 min on 2 cores (mostly the download; gzip -1), once: the bundle does not change.
set -euo pipefail
RELEASE=${1:?usage: build.sh 0.34|0.33 [OUTDIR]}
case $RELEASE in 0.33|0.34) ;; *) echo "build.sh: release '$RELEASE' is not 0.33 or 0.34" >&2; exit 2 ;; esac
R=${RELEASE#0.}
ROOT=$PWD; OUT="${2:-$HOME/.cache/vllm-ling/devbundle$R}"; [[ $OUT = /* ]] || OUT="$ROOT/$OUT"
HERE="$(cd "$(dirname "$0")" && pwd)"
[ -f "$OUT/MANIFEST" ] && { echo "bundle already at $OUT ($(ls -d "$OUT"/[0-9]* | wc -l) chunks)"; exit 0; }
DL="$(mktemp -d)"; trap 'rm -rf "$DL"' EXIT
PLAT=""; for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
  manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do PLAT="$PLAT --platform $p"; done
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
echo "[1/4] downloading vllm $RELEASE.0, torch 2.14.0, triton 3.8.0 and the small packages (cp312, x86_64)"
mkdir -p $DL/big $DL/parts
python3 -m pip download -q --no-deps $PLAT -d $DL/big vllm==$RELEASE.0 torch==2.14.0 triton==3.8.0 2>&1 | grep -v "^WARNING: Location" || true
python3 -m pip download -q --no-deps $PLAT -d $DL/parts -r "$HERE/deps-$RELEASE.txt" 2>&1 | grep -v "^WARNING: Location" || true
echo "[2/4] unpacking and slimming (FA2 kernels, Rust frontend, DeepGEMM, sm100 headers, triton's AMD backend)"
mkdir -p $DL/x && cd $DL/x && for w in $DL/big/*.whl; do python3 -m zipfile -e "$w" .; done
rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs torch/bin/protoc*
rm -rf vllm/third_party/deep_gemm vllm/third_party/fmha_sm100 triton/backends/amd \
  triton/backends/nvidia/lib/cupti-blackwell/*.a triton/backends/nvidia/lib/cupti/*.a
sed -i '/amd/d' triton-*.dist-info/entry_points.txt           # the AMD backend is gone: do not advertise it
chmod +x triton/backends/nvidia/bin/* torch/bin/* 2>/dev/null || true   # zipfile drops the run bits
cp -r "$HERE/torchvision-stub/"* .   # vLLM/transformers import torchvision names; the image's is for torch 2.11
echo "[3/4] compressing (gzip -1: xz -6 took over an hour on 2 busy cores)"; tar cf - . | gzip -1 > $DL/core.tar.gz
split -b 55M -d $DL/core.tar.gz $DL/parts/core.tar.gz.part
echo "[4/4] packing into carry-sized chunks"; cd "$ROOT"
python3 - "$DL/parts" "$OUT" "$HERE" "$R" <<'PY'
import os, shutil, sys
src, out, here, release = sys.argv[1:]
cap = 58 * 2**20
for f in list(os.listdir(src)):  # a big wheel (NCCL, the CuTe DSL's cu13 libraries) travels in pieces
    path = os.path.join(src, f)
    if os.path.getsize(path) > cap:
        with open(path, "rb") as fh:
            for i, piece in enumerate(iter(lambda: fh.read(52 * 2**20), b"")):
                open(f"{path}.piece{i:02d}", "wb").write(piece)
        os.remove(path)
files = sorted(os.listdir(src), key=lambda f: -os.path.getsize(os.path.join(src, f)))
bins = []
for f in files:  # first fit, largest first
    size = os.path.getsize(os.path.join(src, f))
    for b in bins:
        if b[0] + size <= cap: b[0] += size; b[1].append(f); break
    else: bins.append([size, [f]])
manifest = "\n".join(sorted(files)) + "\n"
for i, (_, fs) in enumerate(bins, 1):
    d = os.path.join(out, str(i)); os.makedirs(d)
    for f in fs: shutil.move(os.path.join(src, f), d)
    for s in ("stash.sh", "activate.sh"): shutil.copy(os.path.join(here, s), d)
    open(os.path.join(d, "MANIFEST"), "w").write(manifest)
    open(os.path.join(d, "RELEASE"), "w").write(release + "\n")
open(os.path.join(out, "MANIFEST"), "w").write(manifest)
print(f"{len(bins)} chunks:", ", ".join(f"{i}={b[0] >> 20} MiB" for i, b in enumerate(bins, 1)))
PY
echo "done: $OUT. Link it: ln -sfn $OUT .devbundle$R; keep '/.devbundle$R' out of git (.git/info/exclude)."
