# On the device, in the shell that runs your work:   source .devbundleNN/N/activate.sh   (N = the last chunk,
# carried in this call; the others stashed by earlier calls on this warm machine). First use ~60-90 s; later reused.
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_r=$(cat "$_here/RELEASE"); _stage=$HOME/v$_r-stage; _site=$HOME/v$_r-site
bash "$_here/stash.sh"
if [ ! -f $_site/.ok ]; then
  _missing=$(cd $_stage && while read -r f; do [ -e "$f" ] || echo "$f"; done < MANIFEST)
  if [ -n "$_missing" ]; then echo "missing chunks' files (stash the other chunks first): $_missing" >&2; return 1; fi
  mkdir -p $_site && cat $_stage/core.tar.gz.part* | gzip -d | tar xf - -C $_site || return 1
  (cd $_stage && for w in $(ls *.piece00 2>/dev/null); do cat "${w%.piece00}".piece* > "${w%.piece00}"; done)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $_site $_stage/*.whl 2>&1 | grep -v "already exists" || true
  python3 -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true  # built for the image's torch
  touch $_site/.ok
fi
export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
# pip --target does not run .pth files: the CuTe DSL's (nvidia_cutlass_dsl_packages.pth) puts `cutlass` on sys.path
[ -d $_site/nvidia_cutlass_dsl/dsl_packages ] && export PYTHONPATH="$PYTHONPATH:$_site/nvidia_cutlass_dsl/dsl_packages"
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
python3 -c "import vllm, transformers, torch, triton; print('vllm', vllm.__version__, '| transformers', transformers.__version__, '| torch', torch.__version__, '| triton', triton.__version__)"
