"""Diagnostic (not a test): run test_mtp_gpu.py's fixture and assertions on the CPU engine, before spending
device time on them. The CPU engine verifies drafts with our torch KDA path, not vLLM's CUDA kernels, so a pass
here says the test's plumbing and bf16 thresholds hold, not that the GPU path is right.

python3 tests/gpu/cpu_rehearsal.py [--dtype bfloat16] [--tokens 128] [--prompts 3,17,64,130,400]

It writes a copy of the test with the GPU-only settings swapped for the CPU engine's (env, oracle device, no
side-by-side KV sizing, a 128-token budget) into a scratch folder and runs pytest on it; the per-checkpoint
reports land there as JSON.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWAPS = {  # GPU setting in test_mtp_gpu.py -> CPU engine setting; each must be found exactly once
    "from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)":
        "from model_helpers import CPU_ENGINE_ENV as GPU_ENV\nfrom rehearsal_record import record",
    '"device": "cuda"': '"device": "cpu"',
    'SIDE_BY_SIDE = {"gpu_memory_utilization": 0.12, "engine_kwargs": {"kv_cache_memory_bytes": 2 << 30}}':
        "SIDE_BY_SIDE = {}",
    '"max_num_batched_tokens": 512': '"max_num_batched_tokens": 128',
}


def rehearse(dtype: str, tokens: int, prompts: str, out: Path) -> int:
    src = (HERE / "test_mtp_gpu.py").read_text()
    for gpu, cpu in SWAPS.items():
        if src.count(gpu) != 1:
            raise SystemExit(f"test_mtp_gpu.py changed: {gpu!r} is not there once; update SWAPS")
        src = src.replace(gpu, cpu)
    src = src.replace('"dtype": "bfloat16"', f'"dtype": "{dtype}"')
    src = src.replace("MAX_TOKENS = 128", f"MAX_TOKENS = {tokens}")
    src = src.replace("PROMPT_LENGTHS = [3, 17, 64, 130, 400]", f"PROMPT_LENGTHS = [{prompts}]")
    (out / "test_mtp_rehearsal.py").write_text(src)
    (out / "rehearsal_record.py").write_text(
        "import json\nfrom pathlib import Path\n\n\ndef record(name, data):\n"
        f"    (Path({str(out)!r}) / f'{{name}}.json').write_text(json.dumps(data, indent=1))\n")
    (out / "conftest.py").write_text(
        f"import sys\nsys.path[:0] = [{str(HERE)!r}, {str(HERE.parent / 'model')!r}]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(out), str(out)]
    return subprocess.call(cmd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", default="3, 17, 64, 130, 400")
    ap.add_argument("--out", help="scratch folder (default: a new temporary one)")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="mtp-rehearsal-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"rehearsal in {out}", flush=True)
    return rehearse(a.dtype, a.tokens, a.prompts, out)


if __name__ == "__main__":
    raise SystemExit(main())
