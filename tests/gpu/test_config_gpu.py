"""Config loading on a GPU engine: what a user's flags and folder make vLLM build (docs/architecture.md §Config).

Run on the device: LING_GPU_RESULTS=$OUT python -m pytest tests/gpu/test_config_gpu.py -q. Skips without
CUDA or vLLM. Every engine uses dummy weights and no tokenizer (prompt token ids in, token ids out):
- a tiny random Ling-2.5 (`BailingMoeV2_5ForCausalLM`, model_type bailing_hybrid: vLLM's lightning-attention
  model, GPU only) with vllm-ling installed: our config class parses it (the plugin registers it for
  bailing_hybrid), the model builds at config.json's head_dim and generates;
- the bundled full-size Ling-3.0-flash-int4 config (6 layers through hf_overrides, full widths) through vLLM's
  in-tree model: with our class (plugin on, either flag), with the checkpoint's class (a stand-in
  configuration_bailing_moe_v3.py, plugin off, --trust-remote-code), and with transformers' class (plugin off,
  no flag: head_dim 64, the half-width model the table in §Config predicts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
from gpu_helpers import record  # noqa: E402  (skips the module without CUDA; puts tests/model on sys.path)
from test_config_loading import LING25, STAND_IN_V3, class_label  # noqa: E402

from vllm_ling.configs import flash_config  # noqa: E402

LAYERS = 6  # the full-size config cut to one MLA group: full widths, a few GB of dummy INT4 experts
NO_PLUGINS = "none"  # a VLLM_PLUGINS allow-list naming no installed plugin: vLLM loads none (vllm-ling off)

ENGINE = r"""
import json, sys
from vllm import LLM, SamplingParams
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
          trust_remote_code=spec["trust_remote_code"], hf_overrides=spec.get("hf_overrides"),
          max_model_len=1024, gpu_memory_utilization=0.4, seed=0)
config = llm.llm_engine.model_config.hf_config
out = llm.generate([{"prompt_token_ids": [11, 12, 13, 14, 15, 16]}],
                   SamplingParams(max_tokens=4, temperature=0.0, detokenize=False))
print("RESULT " + json.dumps({"class": f"{type(config).__module__}.{type(config).__name__}",
                              "head_dim": config.head_dim, "tokens": list(out[0].outputs[0].token_ids)}))
"""


def run_engine(spec: dict, env: dict[str, str]) -> dict:
    """One engine in its own process (fresh vLLM, its own plugin set); its RESULT line."""
    run = subprocess.run([sys.executable, "-c", ENGINE, json.dumps(spec)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env})
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, (run.stdout + run.stderr)[-12000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def write_folder(path: Path, config: dict, module: str | None = None) -> str:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if module:
        (path / "configuration_bailing_moe_v3.py").write_text(module)
    return str(path)


def test_tiny_ling25_serves_with_vllm_ling_installed(tmp_path):
    folder = write_folder(tmp_path / "ling25", {k: v for k, v in LING25.items() if k != "auto_map"})
    result = run_engine({"model": folder, "trust_remote_code": False}, {"VLLM_LING_MODEL": "auto"})
    record("config_ling25", result)
    assert class_label(result["class"]) == "vllm-ling"
    assert result["head_dim"] == LING25["head_dim"]
    assert len(result["tokens"]) == 4


def cut_to_layers(config: dict, layers: int) -> dict:
    return {"num_hidden_layers": layers, "expert_swiglu_limit_list": config["expert_swiglu_limit_list"][-layers:],
            "share_expert_swiglu_limit_list": config["share_expert_swiglu_limit_list"][-layers:]}


CASES = {  # name: (stand-in module written, trust_remote_code, vLLM plugins, expected class, head_dim)
    "ours_no_flag": (False, False, None, "vllm-ling", 128),
    "ours_flag": (True, True, None, "vllm-ling", 128),
    "checkpoint_flag_no_plugin": (True, True, NO_PLUGINS, "checkpoint", 128),
    "transformers_no_flag_no_plugin": (False, False, NO_PLUGINS, "transformers", 64),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_full_size_config_builds_the_in_tree_model(case, tmp_path):
    module, flag, plugins, want_class, want_head_dim = CASES[case]
    config = flash_config()
    folder = write_folder(tmp_path / case, config, STAND_IN_V3 if module else None)
    env = {"VLLM_LING_MODEL": "vllm"} | ({"VLLM_PLUGINS": plugins} if plugins is not None else {})
    result = run_engine({"model": folder, "trust_remote_code": flag,
                         "hf_overrides": cut_to_layers(config, LAYERS)}, env)
    record(f"config_full_{case}", result)
    assert (class_label(result["class"]), result["head_dim"]) == (want_class, want_head_dim)
    assert len(result["tokens"]) == 4
