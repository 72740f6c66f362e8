"""Build vLLM layers outside an engine, on the CPU: a VllmConfig for the tiny checkpoint and a world of one.

vLLM's parallel layers read the tensor-parallel group and the current VllmConfig when constructed; an engine
sets both up. Tests of single layers (FP8 weights, the draft check, weight loaders) use this instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from ling_watchdog.ports import free_port


@contextlib.contextmanager
def vllm_layer_context(model_dir: str, dtype: torch.dtype = torch.bfloat16) -> Iterator[object]:
    """Yields the VllmConfig; layers built inside see it and a TP world of size 1 (gloo)."""
    from unittest import mock

    import vllm.plugins
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.engine.arg_utils import EngineArgs

    # Building a config loads vLLM's general plugins, ours among them, whose registrations (our config class in
    # transformers' AutoConfig, the ling3 parsers) would outlive this test in the pytest process; layer tests
    # need none of them (they import vllm_ling.fp8 themselves).
    with mock.patch.object(vllm.plugins, "load_general_plugins", lambda: None), \
            mock.patch("vllm.engine.arg_utils.load_general_plugins", lambda: None):
        config = EngineArgs(model=model_dir, dtype=str(dtype).removeprefix("torch."), skip_tokenizer_init=True,
                            enable_prefix_caching=False).create_engine_config()
    previous = torch.get_default_dtype()
    with set_current_vllm_config(config):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
            parallel_state.initialize_model_parallel(1, 1)
        torch.set_default_dtype(dtype)
        try:
            yield config
        finally:
            torch.set_default_dtype(previous)
