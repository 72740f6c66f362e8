"""vllm-ling: serve Ling-3.0-flash (BailingMoeV3ForCausalLM) with stock vLLM.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in every process (API server,
engine core, workers), so it is idempotent, cheap and touches no CUDA: heavy modules are registered
as lazy "module:Class" strings.
"""

from __future__ import annotations


def register() -> None:
    from vllm_ling.plugin import register as _register

    _register()
