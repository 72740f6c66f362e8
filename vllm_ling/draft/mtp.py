"""The MTP draft of Ling-3.0: checkpoint layer `model.layers.{num_hidden_layers}` (docs/architecture.md §MTP).

To propose token t+2 from token t+1 and the target's post-norm hidden state h_t:
  z = W_eh [RMSNorm_e(embed(t+1)) ; RMSNorm_h(h_t)]     (embedding first)
  z = z + MLA(RMSNorm_in(z)) at the position of t;  z = z + MoE(RMSNorm_post(z))   (no SwiGLU clamps)
  logits = lm_head(RMSNorm_final(z))
The draft has no embedding or head of its own: vLLM's proposer hands it the target's (we also load
`model.word_embeddings` / `lm_head` so the draft works standalone and the self-check can compare).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.utils import maybe_prefix

from vllm_ling import compat
from vllm_ling.layout import num_mtp_layers
from vllm_ling.draft import check as draft_check
from vllm_ling.draft import vocab as draft_vocab
from vllm_ling.mla import BailingMoeV3MLA
from vllm_ling.model import HF_TO_VLLM, BailingMoeV3ForCausalLM, layer_index, load_checkpoint_weights
from vllm_ling.moe import BailingMoeV3MoE


class BailingMoeV3MTPLayer(nn.Module):
    def __init__(self, config, vllm_config: VllmConfig, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False, quant_config=None, prefix=f"{prefix}.eh_proj")
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.self_attn = BailingMoeV3MLA(config, vllm_config, prefix=f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.mlp = BailingMoeV3MoE(config, vllm_config.quant_config, layer_idx, f"{prefix}.mlp")
        self.final_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        z, _ = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1))
        z = z + self.self_attn(positions, self.input_layernorm(z))
        z = z + self.mlp(self.post_attention_layernorm(z))
        return self.final_layernorm(z)


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "hidden_states": 0, "inputs_embeds": 0})
class BailingMoeV3MTPStack(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = compat.draft_hf_config(vllm_config)
        self.first = config.num_hidden_layers
        self.count = num_mtp_layers(config)
        if self.count < 1:
            raise ValueError("speculative method 'mtp' needs num_nextn_predict_layers >= 1 in config.json")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   prefix=maybe_prefix(prefix, "embed_tokens"))
        self.layers = nn.ModuleDict(
            {str(i): BailingMoeV3MTPLayer(config, vllm_config, i, f"{prefix}.layers.{i}")
             for i in range(self.first, self.first + self.count)}
        )

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None, spec_step_idx: int = 0) -> torch.Tensor:
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        layer = self.layers[str(self.first + spec_step_idx % self.count)]  # k > 1 reuses the layer
        return layer(positions, embeds, hidden_states)


class BailingMoeV3MTPModel(nn.Module):
    hf_to_vllm_mapper = HF_TO_VLLM
    packed_modules_mapping = BailingMoeV3ForCausalLM.packed_modules_mapping

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = compat.draft_hf_config(vllm_config)
        self.model = BailingMoeV3MTPStack(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size,
                                      quant_config=vllm_config.quant_config, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.config.vocab_size)
        self.checked = False
        self.draft_vocab = _draft_vocab(vllm_config, self.config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(
        self, input_ids, positions, hidden_states, intermediate_tensors=None, inputs_embeds=None, spec_step_idx: int = 0
    ) -> torch.Tensor:
        if not self.checked:  # first call: after vLLM's proposer has shared the target's head and embedding
            draft_check.check_draft_shares_target(self)
            if self.draft_vocab is not None:
                self.draft_vocab.bind(self.lm_head)
            self.checked = True
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0) -> torch.Tensor:
        return self.logits_processor(self.lm_head, hidden_states)

    def get_top_tokens(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """vLLM's greedy draft without logits (speculative_config `use_local_argmax_reduction`): the top token
        over the draft vocabulary when one is set (vllm_ling/draft/vocab.py), over the whole head otherwise."""
        if self.draft_vocab is not None:
            return self.draft_vocab.top_tokens(hidden_states)
        return self.logits_processor.get_top_tokens(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        first, count = self.model.first, self.model.count

        def keep(name: str) -> bool:
            idx = layer_index(name)
            if idx is not None:
                return first <= idx < first + count
            return name in ("model.embed_tokens.weight", "lm_head.weight")

        return load_checkpoint_weights(self, weights, self.config, keep)


def _draft_vocab(vllm_config: VllmConfig, vocab_size: int) -> draft_vocab.DraftVocab | None:
    """VLLM_LING_DRAFT_VOCAB's vocabulary, read at start-up; it serves only where vLLM asks for top tokens."""
    vocab = draft_vocab.from_env(vocab_size)
    if vocab is None:
        return None
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(f"vllm-ling: {draft_vocab.ENV} is for one GPU (the head's rows are gathered whole); this "
                         f"engine has tensor_parallel_size {vllm_config.parallel_config.tensor_parallel_size}. "
                         f"Unset {draft_vocab.ENV} with TP")
    if not compat.draft_top_tokens_on(vllm_config):
        key = compat.draft_top_tokens_key()
        raise ValueError(f"vllm-ling: {draft_vocab.ENV} is set, but vLLM asks the draft for top tokens only with "
                         + (f"speculative_config {{\"{key}\": true}}, which this engine lacks: add it" if key else
                            f"a speculative_config key this vLLM ({compat.vllm_version()}) does not have") +
                         f", or unset {draft_vocab.ENV}")
    return vocab
