"""TP = 2 sharding below the engine: each rank's parameters, loaded by the real loaders, against TP = 1's.

The model (and the MTP draft) is built in this process under a fake tensor-parallel world (vLLM's
`get_tp_group` patched to report rank r of 2; nothing is communicated, only construction and weight loading
run) and loaded from the tiny checkpoint by vLLM's default loader, which calls our `load_weights`, hence
`_load_head_sharded`, `TorchRoutedExperts.load_expert` and vLLM's parallel-layer loaders. For every
parameter, `SHARDING` says how TP splits it; rank 0 ⊕ rank 1 along that dimension (fused projections piece
by piece) must equal the parameter of the TP = 1 build, and a replicated one must equal it on both ranks.
Every parameter must be classified, so a new one cannot go unchecked. Also: each KDA layer's state shape.
Negative control: the wrong-shard loaders of `tp_faults` fail the comparison exactly where they act.
test_tp.py runs the same sharding through a real TP = 2 engine against the oracle.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import tp_faults

pytest.importorskip("vllm")

TP = 2
ENV = {"VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1"}  # the CPU engine recipe (model_helpers.CPU_ENGINE_ENV)

# (parameter-name pattern, dim along which ranks concatenate or None = replicated, fused pieces of the full
# tensor along that dim, from the config; None = one piece). First match wins.
Pieces = Callable[[object], list[int]] | None
SHARDING: list[tuple[str, int | None, Pieces]] = [
    (r"(embed_tokens|lm_head)\.weight$", 0, None),  # vocab-parallel
    # KDA
    (r"self_attn\.in_proj\.weight$", 0, lambda c: [_kda_proj(c)] * 3 + [c.num_attention_heads] + [_kda_proj(c)] * 2),
    (r"self_attn\.o_proj\.weight$", 1, None),
    (r"self_attn\.(A_log|dt_bias)$", 0, None),
    (r"self_attn\.conv1d$", 0, lambda c: [_kda_proj(c)] * 3),  # q | k | v conv kernels, fused
    (r"self_attn\.o_norm\.weight$", None, None),  # one RMSNorm weight shared by all heads
    # MLA
    (r"self_attn\.(q_proj|q_b_proj|kv_b_proj|g_proj)\.weight$", 0, None),
    (r"self_attn\.dense\.weight$", 1, None),
    (r"self_attn\.(kv_a_proj_with_mqa|fused_qkv_a_proj)\.weight$", None, None),  # the latent: every rank needs it
    (r"self_attn\.(kv_a_layernorm|q_a_layernorm)\.weight$", None, None),
    (r"self_attn\.attn\.(q|k|v|prob)_(scale|zero_point)$", None, None),  # KV-cache quant params (INT4 build)
    # MLPs: dense layers and shared experts by intermediate dim
    (r"mlp\.gate_up_proj\.weight$", 0, lambda c: [c.intermediate_size] * 2),
    (r"mlp\.shared_experts\.gate_up_proj\.weight$", 0,
     lambda c: [c.moe_shared_expert_intermediate_size * c.num_shared_experts] * 2),
    (r"mlp\.(shared_experts\.)?down_proj\.weight$", 1, None),
    # routed experts (CPU: TorchRoutedExperts) by intermediate dim; router replicated
    (r"mlp\.experts\.w13$", 1, lambda c: [c.moe_intermediate_size] * 2),
    (r"mlp\.experts\.w2$", 2, None),
    (r"mlp\.gate\.(weight|expert_bias)$", None, None),
    # norms, MTP's input projection
    (r"(layernorm|norm|enorm|hnorm)\.weight$", None, None),
    (r"eh_proj\.weight$", None, None),
]


def _kda_proj(config) -> int:
    from vllm_ling.layout import kda_head_dim

    return config.num_attention_heads * kda_head_dim(config)


def rule_for(name: str) -> tuple[int | None, Pieces]:
    for pattern, dim, pieces in SHARDING:
        if re.search(pattern, name):
            return dim, pieces
    raise KeyError(f"{name}: no TP sharding rule; add one to SHARDING")


def assemble(ranks: list[torch.Tensor], dim: int, pieces: list[int] | None) -> torch.Tensor:
    """The full tensor from the ranks' slices along `dim`; a fused projection holds each piece's slice in turn."""
    if pieces is None:
        return torch.cat(ranks, dim)
    split = [r.split([p // len(ranks) for p in pieces], dim) for r in ranks]
    return torch.cat([torch.cat([s[i] for s in split], dim) for i in range(len(pieces))], dim)


def unpad(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor | None:
    """The first `rows` along `dim`, if what follows is fewer than 16 zero rows: a fused projection may be padded
    with zero rows to a multiple of 16 per rank (vLLM's Kimi layer pads its own so; nothing loads them). None if
    the extra is not such padding."""
    extra = t.narrow(dim, rows, t.shape[dim] - rows)
    if extra.shape[dim] >= 16 or bool(extra.any()) or (rows + extra.shape[dim]) % 16 and extra.shape[dim]:
        return None
    return t.narrow(dim, 0, rows)


def mismatches(full: dict[str, torch.Tensor], ranks: list[dict[str, torch.Tensor]], config) -> list[str]:
    """Names whose rank tensors do not make up the TP = 1 tensor (or are not sharded as SHARDING says)."""
    bad = []
    for name, want in full.items():
        dim, pieces = rule_for(name)
        got = [r[name] for r in ranks]
        if dim is None:
            ok = all(torch.equal(g, want) for g in got)
        else:
            parts = pieces(config) if pieces else None
            if parts is not None:  # fused: drop each build's zero padding first
                want = unpad(want, dim, sum(parts))
                got = [unpad(g, dim, sum(parts) // len(got)) for g in got]
            ok = want is not None and all(g is not None for g in got) and \
                all(g.shape[dim] * len(got) == want.shape[dim] for g in got) and \
                torch.equal(assemble(got, dim, parts), want)
        if not ok:
            bad.append(name)
    return bad


@contextmanager
def fake_tp(rank: int, world_size: int) -> Iterator[None]:
    """vLLM's TP rank/size queries answer (rank, world_size); enough to build and load a model, not to run it."""
    import vllm.distributed.parallel_state as parallel_state

    with mock.patch.object(parallel_state, "get_tp_group",
                           return_value=SimpleNamespace(rank_in_group=rank, world_size=world_size)):
        yield


def build(model_dir: str, rank: int, world_size: int, draft: bool = False):
    """(our model class or the MTP draft for TP rank `rank` of `world_size`, fp32; the VllmConfig it was built
    with). Built and loaded as vLLM's default loader does (`initialize_model`, which also maps the INT4 ignore
    list to our module names, then the loader's `load_weights`), without the CPU's post-load repacking, which
    would take the linear weights out of their parameters."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_ling.model import BailingMoeV3ForCausalLM
    from vllm_ling.draft.mtp import BailingMoeV3MTPModel

    with fake_tp(rank, world_size):
        config = EngineArgs(model=model_dir, dtype="float32", tensor_parallel_size=world_size, max_model_len=512,
                            enforce_eager=True, distributed_executor_backend="mp" if world_size > 1 else "uni",
                            ).create_engine_config()
        with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(config, model_class=BailingMoeV3MTPModel if draft else BailingMoeV3ForCausalLM)
            get_model_loader(config.load_config).load_weights(model, config.model_config)
    return model, config


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def env():
    from vllm_ling import compat
    from vllm_ling.config import BailingMoeV3Config

    with pytest.MonkeyPatch.context() as patch:
        for key, value in ENV.items():
            patch.setenv(key, value)
        compat.register_config_class(BailingMoeV3Config)  # config.json's fields, as the plugin registers them
        yield


@pytest.fixture(scope="module")
def tiny(env) -> dict[str, str]:
    from ling_tools.tiny import ensure_tiny

    return {"bf16": str(ensure_tiny()), "int4": str(ensure_tiny(int4=True)), "qlora": str(ensure_tiny(variant="qlora"))}


@pytest.fixture(scope="module")
def loaded(tiny) -> Callable[[str, bool], tuple[object, dict, list[dict]]]:
    """(checkpoint, draft) -> (config, TP = 1 parameters, [rank r's parameters at TP = 2]), built once each."""
    cache: dict[tuple[str, bool], tuple[object, dict, list[dict]]] = {}

    def load(checkpoint: str, draft: bool = False) -> tuple[object, dict, list[dict]]:
        if (checkpoint, draft) not in cache:
            full, _ = build(tiny[checkpoint], 0, 1, draft)
            ranks = [parameters(build(tiny[checkpoint], r, TP, draft)[0]) for r in range(TP)]
            cache[checkpoint, draft] = (full.config, parameters(full), ranks)
        return cache[checkpoint, draft]

    return load


@pytest.mark.parametrize("checkpoint", ["bf16", "int4", "qlora"])
def test_tp2_ranks_concatenate_to_every_tp1_parameter(loaded, checkpoint):
    config, full, ranks = loaded(checkpoint)
    assert all(r.keys() == full.keys() for r in ranks)
    assert mismatches(full, ranks, config) == []


def test_tp2_mtp_draft_ranks_concatenate_to_its_tp1_parameters(loaded):
    config, full, ranks = loaded("bf16", True)
    assert any(".mlp.experts.w13" in n for n in full) and any("self_attn.kv_b_proj" in n for n in full)
    assert mismatches(full, ranks, config) == []


def test_every_sharding_rule_is_exercised(loaded):
    """Each rule of SHARDING matches a parameter of the default, INT4, qlora or MTP-draft model: none is dead."""
    names = [n for key in (("bf16", False), ("int4", False), ("qlora", False), ("bf16", True)) for n in loaded(*key)[1]]
    for pattern, _, _ in SHARDING:
        assert any(re.search(pattern, n) for n in names), pattern


def test_kda_state_shape_at_tp2_holds_this_ranks_heads(tiny):
    """Each KDA layer declares conv state 3·H·d/TP channels and recurrent state [H/TP, d, d] at TP = 2, the same
    as the model's classmethod (what vLLM sizes the cache by) and compat.kda_state_shape."""
    from vllm_ling import compat
    from vllm_ling.kda import BailingMoeV3KDA

    model, vllm_config = build(tiny["bf16"], 1, TP)
    c = model.config
    h, d, k = c.num_attention_heads, _kda_proj(c) // c.num_attention_heads, c.short_conv_kernel_size
    layers = [m for m in model.modules() if isinstance(m, BailingMoeV3KDA)]
    assert len(layers) == 4
    for layer in layers:
        conv, rec = layer.get_state_shape()
        assert sorted(conv) == sorted([3 * h * d // TP, k - 1]) and tuple(rec) == (h // TP, d, d)
        assert (conv, rec) == compat.kda_state_shape(TP, h, d, k, 0)
        assert (conv, rec) == type(model).get_mamba_state_shape_from_config(vllm_config)


FAULTED = {"expert_down_neighbour": r"mlp\.experts\.w2$",
           "kda_heads_neighbour": r"self_attn\.(A_log|dt_bias|conv1d)$"}  # what each fault corrupts


@pytest.mark.parametrize("fault, family", list(FAULTED.items()))
def test_comparison_catches_a_wrong_shard(loaded, tiny, fault, family, monkeypatch):
    """Under each `tp_faults` loader exactly the family it corrupts mismatches; at TP = 1 the fault is a no-op."""
    config, full, _ = loaded("bf16")
    for owner, attribute, replacement in tp_faults.patches(fault):
        monkeypatch.setattr(owner, attribute, replacement)
    assert mismatches(full, [parameters(build(tiny["bf16"], 0, 1)[0])], config) == []
    bad = mismatches(full, [parameters(build(tiny["bf16"], r, TP)[0]) for r in range(TP)], config)
    assert bad and bad == [n for n in full if re.search(family, n)]


def test_every_shard_of_a_merged_projection_is_loaded(tiny):
    """vLLM 0.34's loader refuses a model in which a shard of a stacked projection was never loaded
    (`StackedColumnParallelLinear.pop_missing_shards`, checked for unquantized models): the KDA in_proj's zero
    padding shard is in no checkpoint, so the model loads it itself. The CPU release does not check; this records
    which shards each `MergedColumnParallelLinear` received at TP = 1 and on a rank of TP = 2."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    seen: dict[int, set[int]] = {}

    def recording(loader):  # vLLM's layers hand their parameters weight_loader or weight_loader_v2
        def record(self, param, loaded_weight, loaded_shard_id=None):
            shards = range(len(self.output_sizes)) if loaded_shard_id is None else (
                loaded_shard_id if isinstance(loaded_shard_id, tuple) else (loaded_shard_id,))
            seen.setdefault(id(self), set()).update(shards)
            return loader(self, param, loaded_weight, loaded_shard_id)
        return record

    with mock.patch.object(MergedColumnParallelLinear, "weight_loader",
                           recording(MergedColumnParallelLinear.weight_loader)), \
            mock.patch.object(MergedColumnParallelLinear, "weight_loader_v2",
                              recording(MergedColumnParallelLinear.weight_loader_v2)):
        for rank, world_size in ((0, 1), (1, TP)):
            seen.clear()
            model, _ = build(tiny["bf16"], rank, world_size)
            merged = {n: m for n, m in model.named_modules() if isinstance(m, MergedColumnParallelLinear)}
            assert any(m.output_sizes[-1] and n.endswith("in_proj") and len(m.output_sizes) == 7
                       for n, m in merged.items()), "the tiny checkpoint's KDA in_proj should carry a padding shard"
            missing = {n: sorted(set(range(len(m.output_sizes))) - seen.get(id(m), set())) for n, m in merged.items()}
            assert {n: s for n, s in missing.items() if s} == {}, f"rank {rank} of {world_size}"
