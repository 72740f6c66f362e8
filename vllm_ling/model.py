"""BailingMoeV3ForCausalLM (Ling-3.0-flash) for vLLM: a hybrid of KDA and gated-MLA layers over MoE MLPs.

Pre-norm blocks (docs/architecture.md §Layers): h = x + Attn(RMSNorm(x)); y = h + MLP(RMSNorm(h)); layer i is
MLA or KDA by `config.is_mla_layer`, dense MLP or MoE by `config.is_moe_layer`.
Logits = lm_head(RMSNorm(y)) with an untied head; `forward` returns the post-norm hidden state, which
the MTP draft (`vllm_ling.draft.mtp`) consumes. A DSpark drafter also reads the residual stream at chosen layers
(vLLM's aux-hidden-state interface, docs/dspark.md §Target): then `forward` returns (hidden, [aux, ...]).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import EagleModelMixin, HasInnerState, IsHybrid, SupportsEagle3
from vllm.model_executor.models.utils import WeightsMapper, maybe_prefix

from vllm_ling import compat
from vllm_ling.config import check_supported
from vllm_ling.layout import is_mla_layer, is_moe_layer, kda_head_dim
from vllm_ling.draft import check as draft_check
from vllm_ling.draft import dspark
from vllm_ling.kda import BailingMoeV3KDA
from vllm_ling.mla import BailingMoeV3MLA
from vllm_ling.moe import BailingMoeV3MLP, BailingMoeV3MoE, TorchRoutedExperts


def make_mlp(config, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> nn.Module:
    if not is_moe_layer(config, layer_idx):
        return BailingMoeV3MLP(config, config.intermediate_size, vllm_config.quant_config, prefix)
    return BailingMoeV3MoE(config, vllm_config.quant_config, layer_idx, prefix)


class BailingMoeV3DecoderLayer(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.is_mla = is_mla_layer(config, layer_idx)
        attn_cls = BailingMoeV3MLA if self.is_mla else BailingMoeV3KDA
        self.self_attn = attn_cls(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.mlp = make_mlp(config, vllm_config, layer_idx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.is_mla:
            hidden_states = self.self_attn(positions, hidden_states)
        else:
            hidden_states = self.self_attn(hidden_states)  # KDA has no positions (no RoPE)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class BailingMoeV3Model(nn.Module, EagleModelMixin):
    start_layer = 0  # no pipeline parallelism: this rank holds every layer (EagleModelMixin reads it)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        check_supported(config)
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleList(
            BailingMoeV3DecoderLayer(config, vllm_config, i, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """The post-norm hidden state; with aux layers set, also the residual stream h + r entering each of them.

        vLLM's aux id j means "before layer j" (= after layer j - 1; 0 is the embedding), as in its Kimi-K3
        model. The membership tests read a Python tuple, so with no aux layers (no drafter asks) the traced
        graph holds no extra op and no extra output.
        """
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        aux: list[torch.Tensor] = self._maybe_add_hidden_state([], 0, hidden_states, residual)
        for i, layer in enumerate(self.layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
            aux = self._maybe_add_hidden_state(aux, i + 1, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return (hidden_states, aux) if aux else hidden_states


# Checkpoint -> vLLM names. `.attention.` is also how the INT4 ignore list names modules.
HF_TO_VLLM = WeightsMapper(
    orig_to_new_substr={".attention.": ".self_attn.", ".gate.e_score_correction_bias": ".gate.expert_bias"},
    orig_to_new_prefix={"model.word_embeddings.": "model.embed_tokens."},
)
# (fused vLLM module, checkpoint module, shard id); tried only where the fused module exists, which
# tells KDA's q_proj and g_proj (parts of in_proj) from MLA's (modules of their own).
STACKED = [
    (".in_proj", ".q_proj", 0), (".in_proj", ".k_proj", 1), (".in_proj", ".v_proj", 2), (".in_proj", ".b_proj", 3),
    (".in_proj", ".f_proj", 4), (".in_proj", ".g_proj", 5),
    (".fused_qkv_a_proj", ".q_a_proj", 0), (".fused_qkv_a_proj", ".kv_a_proj_with_mqa", 1),
    (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1),
    (".conv1d", ".q_conv1d.weight", 0), (".conv1d", ".k_conv1d.weight", 1), (".conv1d", ".v_conv1d.weight", 2),
]


def layer_index(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (`model.layers.{i}....`), None outside the stack. Not
    vLLM's `extract_layer_index`: expert tensors carry a second integer (`...experts.{e}...`), which it refuses."""
    return int(name.split(".")[2]) if name.startswith("model.layers.") else None


def load_checkpoint_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], config, keep
) -> set[str]:
    """Load HF-named tensors into `module`; `keep(vllm_name)` says which tensors belong to it.

    Shared by the main model (all but the MTP layer) and the MTP draft (its layer, embedding, head).
    A kept tensor without a parameter raises: a silently skipped tensor is how wrong models produce
    fluent garbage.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    torch_experts = {f"{n}.": m for n, m in module.named_modules() if isinstance(m, TorchRoutedExperts)}
    expert_map = fused_moe_make_expert_params_mapping(
        module, ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
        ckpt_up_proj_name="up_proj", num_experts=config.num_experts,
    )
    loaded: set[str] = set()
    for name, tensor in HF_TO_VLLM.apply(weights):
        if not keep(name):
            continue
        target, args = name, ()
        owner = next((p for p in torch_experts if name.startswith(p)), None)
        if owner is not None:  # CPU: our own routed experts (dequantizing INT4)
            torch_experts[owner].load_expert(name.removeprefix(owner), tensor)
            loaded.update((owner + "w13", owner + "w2"))
            continue
        if ".mlp.experts." in name:
            for param_part, ckpt_part, expert_id, shard in expert_map:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, param_part)
                    args = (target, shard, expert_id)
                    break
        else:
            for fused, part, shard in STACKED:
                if part in name and name.replace(part, fused) in params:
                    target, args = name.replace(part, fused), (shard,)
                    break
        if target not in params:
            raise KeyError(f"vllm-ling: checkpoint tensor {name!r} has no parameter {target!r} in {type(module).__name__}")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if len(args) == 3:
            loader(param, tensor, args[0], shard_id=args[1], expert_id=args[2])
        else:
            loader(param, tensor, *args)
        loaded.add(target)
    for name, layer in module.named_modules():  # the KDA in_proj's padding shard is in no checkpoint
        if isinstance(layer, BailingMoeV3KDA) and f"{name}.in_proj.weight" in loaded:
            layer.load_in_proj_padding()
    return loaded


def kda_state_shape(vllm_config: VllmConfig):
    config = vllm_config.model_config.hf_config
    return compat.kda_state_shape(
        vllm_config.parallel_config.tensor_parallel_size, config.num_attention_heads, kda_head_dim(config),
        config.short_conv_kernel_size, compat.num_speculative_tokens(vllm_config),
    )


class BailingMoeV3ForCausalLM(nn.Module, HasInnerState, IsHybrid, SupportsEagle3):
    hf_to_vllm_mapper = HF_TO_VLLM
    packed_modules_mapping = {
        "in_proj": ["q_proj", "k_proj", "v_proj", "b_proj", "f_proj", "g_proj"],
        "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        dspark.check_speculative_config(vllm_config)  # a DSpark drafter that cannot serve us stops the start
        self.model = BailingMoeV3Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        # The LM head takes the quant config: `--quantization ling_fp8` gives it FP8 weights (vllm_ling.fp8).
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(config.vocab_size)
        draft_check.register_target(self)  # the MTP draft checks it shares this model's head and embedding

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return kda_state_shape(vllm_config)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return compat.kda_state_dtype(vllm_config.model_config.dtype, vllm_config.cache_config.mamba_cache_dtype)

    @classmethod
    def get_mamba_state_copy_func(cls):
        return compat.kda_state_copy_funcs()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The MTP layer (index >= num_hidden_layers) belongs to the draft model.
        last = self.config.num_hidden_layers
        return load_checkpoint_weights(self, weights, self.config, lambda n: (layer_index(n) or 0) < last)
