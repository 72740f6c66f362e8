"""Shared by the GPU engine tests: skip without CUDA/vLLM, run engine and oracle scripts, record results."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from model_helpers import run_script, run_scripts  # noqa: E402,F401

# In-process engine core (tests hook modules and read metrics); our plugin even where vLLM has Ling V3.
GPU_ENV = {"VLLM_LING_MODEL": "vllm-ling", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def record(name: str, data: dict) -> None:
    """Write a result as $VLLM_LING_GPU_RESULTS/<name>.json (the device run brings that folder back)."""
    out = os.environ.get("VLLM_LING_GPU_RESULTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=2))
