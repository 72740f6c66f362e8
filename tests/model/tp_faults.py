"""Deliberately wrong tensor-parallel shards, for the negative controls of test_tp.py and test_tp_sharding.py.

`patches(name)` are loader patches under which each rank loads its *neighbour's* slice of one tensor family
(bf16 expert down_proj; KDA A_log, dt_bias and conv); the rest of the model stays correct. At TP = 1 every
fault is a no-op (the neighbour is the rank itself), so a fault shows only what TP sharding would get wrong.
engine_runner.py installs the fault named by $LING_TP_FAULT at import, which is also how it reaches the
multiprocess executor's spawned workers (spawn re-imports the parent's main script before the worker starts).
"""

from __future__ import annotations

from typing import Callable

import torch

FAULT_ENV = "LING_TP_FAULT"
FAULTS = ("expert_down_neighbour", "kda_heads_neighbour")


def _neighbour_slice(tensor: torch.Tensor, dim: int, local: int) -> torch.Tensor:
    """Rolled so that narrowing [rank·local, (rank+1)·local) yields the next rank's slice instead."""
    return tensor.roll(-local, dims=dim)


def patches(name: str) -> list[tuple[object, str, Callable]]:
    """The (owner, attribute, replacement) patches that make fault `name`."""
    if name == "expert_down_neighbour":  # routed experts: down_proj columns of the other rank, gate/up right
        from vllm_ling.moe import TorchRoutedExperts

        original = TorchRoutedExperts.load_expert

        def load_expert(self, expert_name: str, tensor: torch.Tensor) -> None:
            if expert_name.endswith("down_proj.weight"):
                tensor = _neighbour_slice(tensor, 1, self.w2.shape[-1])
            original(self, expert_name, tensor)

        return [(TorchRoutedExperts, "load_expert", load_expert)]
    if name == "kda_heads_neighbour":  # KDA per-head params (A_log, dt_bias, conv) of the other rank's heads
        from vllm_ling import kda

        original_loader, original_conv = kda._load_head_sharded, kda._load_conv_shard

        def load_head_sharded(param: torch.Tensor, loaded: torch.Tensor) -> None:
            original_loader(param, _neighbour_slice(loaded.reshape(-1), 0, param.shape[0]))

        def load_conv_shard(param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
            rows = loaded.reshape(-1, param.shape[1])
            original_conv(param, _neighbour_slice(rows, 0, param.shape[0] // 3), shard)

        return [(kda, "_load_head_sharded", load_head_sharded), (kda, "_load_conv_shard", load_conv_shard)]
    raise ValueError(f"unknown TP fault {name!r}; known: {FAULTS}")


def install(name: str) -> None:
    """Apply fault `name` for the rest of this process (an engine worker)."""
    for owner, attribute, replacement in patches(name):
        setattr(owner, attribute, replacement)
