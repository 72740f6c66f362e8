"""Ling's DSpark drafter on vLLM's Qwen3 DSpark runtime (docs/dspark.md).

The drafter's checkpoint names its architecture `LingDSparkModel`, a name vLLM 0.32-0.34 do not know: their
speculative config sends an unknown DSpark architecture down the DeepSeek-V4 branch. SGLang's `LingDSparkModel`
is a Qwen3 DSpark draft under another name, so `normalise_draft_config` renames it `Qwen3DSparkModel` and writes
its fields under the keys vLLM's `Qwen3DSparkForCausalLM` reads (compat installs it in front of vLLM's draft
config rewrite). `check_drafter` refuses, at start-up, a drafter that cannot serve this target. Built under its own
quantization ling_fp8 (the speculative config's), the drafter logs how many of its weights are FP8
(`log_own_quantization`, docs/dspark.md §Draft FP8).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from vllm_ling.draft import check as draft_check

logger = logging.getLogger("vllm_ling")

LING_DSPARK_ARCHS = ("LingDSparkModel",)
QWEN3_DSPARK_ARCH = "Qwen3DSparkModel"
SOURCE_KEY = "vllm_ling_dspark_source"  # the architecture the checkpoint named, kept after the rename
FIX = "serve the drafter trained for this target (inclusionAI/Ling-3.0-flash-dspark for Ling-3.0-flash)"
FIX_TARGET_MODEL = "Fix: serve vllm-ling's model (unset VLLM_LING_MODEL, or VLLM_LING_MODEL=vllm-ling)"

# vLLM's key <- the spellings drafter configs use, in SGLang's order of preference (its DSpark config parser), and
# the `dflash_config` nesting vLLM's own DFlash/DSpark config readers accept (a converted Qwen3 DSpark drafter nests
# markov_rank, markov_head_type and use_confidence_head there). vLLM's Qwen3 DSpark model reads the top-level keys.
ALIASES: dict[str, tuple[str, ...]] = {
    "block_size": ("dspark_block_size", "block_size", "dflash_config.block_size", "dspark_config.block_size"),
    "markov_rank": ("dspark_markov_rank", "markov_rank", "dflash_config.markov_rank", "dspark_config.markov_rank"),
    "markov_head_type": ("dspark_markov_head_type", "markov_head_type", "dflash_config.markov_head_type",
                         "dspark_config.markov_head_type"),
    "enable_confidence_head": ("enable_confidence_head", "use_confidence_head", "dflash_config.use_confidence_head",
                               "dflash_config.enable_confidence_head", "dspark_config.enable_confidence_head"),
    "confidence_head_with_markov": ("confidence_head_with_markov", "dflash_config.confidence_head_with_markov",
                                    "dspark_config.confidence_head_with_markov"),
    "dspark_target_layer_ids": ("dspark_target_layer_ids", "target_layer_ids", "dflash_config.target_layer_ids",
                                "dspark_config.target_layer_ids"),
    "mask_token_id": ("dspark_noise_token_id", "mask_token_id", "dflash_config.mask_token_id",
                      "dspark_config.mask_token_id"),
}


def _get(config: Any, key: str) -> Any:
    """`key` of a dict or a config object; "a.b" reads a nested dict."""
    head, _, rest = key.partition(".")
    value = config.get(head) if isinstance(config, dict) else getattr(config, head, None)
    if rest:
        return value.get(rest) if isinstance(value, dict) else None
    return value


def _set(config: Any, key: str, value: Any) -> None:
    if isinstance(config, dict):
        config[key] = value
    else:
        setattr(config, key, value)


def architecture(config: Any) -> str | None:
    archs = _get(config, "architectures") or [None]
    return archs[0]


def _normalised(config: Any) -> bool:
    return _get(config, SOURCE_KEY) is not None


def is_ling_dspark(config: Any) -> bool:
    """A Ling DSpark drafter, before or after `normalise_draft_config`."""
    return architecture(config) in LING_DSPARK_ARCHS or _get(config, SOURCE_KEY) in LING_DSPARK_ARCHS


def _resolve(config: Any, key: str) -> Any:
    """The one value the aliases of `key` give; two spellings that disagree are refused."""
    found = {alias: _get(config, alias) for alias in ALIASES[key]}
    found = {alias: value for alias, value in found.items() if value is not None}
    values = {repr(v) for v in found.values()}
    if len(values) > 1:
        raise ValueError(f"vllm-ling DSpark: the drafter's config gives {key} twice with different values "
                         f"({found}); {FIX}, or keep one spelling")
    return next(iter(found.values()), None)


def normalise_draft_config(config: Any) -> Any:
    """Rewrite a Ling DSpark drafter's config in place into vLLM's Qwen3 DSpark form; any other config is
    returned untouched. Returns `config` (a dict or a transformers config)."""
    if architecture(config) not in LING_DSPARK_ARCHS or _normalised(config):
        return config
    resolved = {key: _resolve(config, key) for key in ALIASES}
    _set(config, SOURCE_KEY, architecture(config))
    # Ours first (the registry takes the first name it knows), vLLM's second (0.32/0.33 route by that name).
    _set(config, "architectures", [LING_DSPARK_ARCHS[0], QWEN3_DSPARK_ARCH])
    for key, value in resolved.items():
        if value is not None:
            _set(config, key, list(value) if key == "dspark_target_layer_ids" else value)
    if resolved["mask_token_id"] is not None:  # vLLM's DFlash backbone reads dflash_config first
        _set(config, "dflash_config", {**(_get(config, "dflash_config") or {}),
                                       "mask_token_id": resolved["mask_token_id"]})
    if _get(config, "use_aux_hidden_state") is None:
        _set(config, "use_aux_hidden_state", True)  # the drafter reads the target's layers (its fc)
    return config


def _layer_id_problems(ids: Any, num_layers: int) -> list[str]:
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) for i in ids):
        return [f"dspark_target_layer_ids={ids!r} is not a non-empty list of layer indices"]
    problems = []
    outside = [i for i in ids if not -1 <= i < num_layers]
    if outside:
        problems.append(f"dspark_target_layer_ids={list(ids)} holds {outside}, outside [-1, {num_layers - 1}] for "
                        f"a target of num_hidden_layers={num_layers} (-1: the embedding; i: the stream after "
                        f"layer i)")
    if list(ids) != sorted(set(ids)):
        problems.append(f"dspark_target_layer_ids={list(ids)} is not strictly increasing")
    return problems


def drafter_problems(target: Any, draft: Any, num_speculative_tokens: int | None = None) -> list[str]:
    """Why `draft` (a normalised drafter config) cannot draft for `target` (our model's config); [] if it can."""
    problems = []
    for key in ("hidden_size", "vocab_size"):  # the drafter reads the target's stream, embedding and LM head
        if _get(draft, key) != _get(target, key):
            problems.append(f"{key}: the drafter has {_get(draft, key)}, the target {_get(target, key)}")
    target_hidden = _get(draft, "target_hidden_size")
    if target_hidden is not None and target_hidden != _get(target, "hidden_size"):
        problems.append(f"target_hidden_size: the drafter expects {target_hidden}, the target has "
                        f"hidden_size={_get(target, 'hidden_size')}")
    problems += _layer_id_problems(_get(draft, "dspark_target_layer_ids"), _get(target, "num_hidden_layers"))
    rank = _get(draft, "markov_rank")
    if not isinstance(rank, int) or rank <= 0:
        problems.append(f"markov_rank={rank!r}: a DSpark drafter needs its Markov head (markov_rank > 0)")
    head_type = _get(draft, "markov_head_type")
    if head_type not in (None, "vanilla"):
        problems.append(f"markov_head_type={head_type!r}: vLLM's DSpark Markov head is 'vanilla' only")
    block = _get(draft, "block_size")
    if not isinstance(block, int) or block <= 0:
        problems.append(f"block_size={block!r}: a DSpark drafter needs its block size (a positive integer)")
    elif num_speculative_tokens is not None and not 1 <= num_speculative_tokens <= block:
        problems.append(f"num_speculative_tokens={num_speculative_tokens} is outside 1..block_size={block}")
    return problems


def check_drafter(target: Any, draft: Any, num_speculative_tokens: int | None = None) -> None:
    """Raise ValueError naming every field a drafter gets wrong for this target, the values and the fix."""
    problems = drafter_problems(target, draft, num_speculative_tokens)
    if problems:
        raise ValueError(f"vllm-ling: the DSpark drafter cannot serve this target: {'; '.join(problems)}. Fix: {FIX}.")


def check_speculative_config(vllm_config: Any) -> None:
    """Start-up check, from the target model's constructor: with method "dspark", the drafter must fit."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or getattr(spec, "method", None) != "dspark" or spec.draft_model_config is None:
        return
    check_drafter(vllm_config.model_config.hf_config, spec.draft_model_config.hf_config,
                  spec.num_speculative_tokens)


def required_tensors(draft: Any) -> list[str]:
    """The tensors a Qwen3 DSpark drafter's checkpoint must hold (vLLM's loader skips absent ones silently and
    leaves those parameters unset). Embedding and LM head are the target's: not required."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight",
             "markov_head.markov_w1.weight", "markov_head.markov_w2.weight"]
    for i in range(_get(draft, "num_hidden_layers")):
        names += [f"layers.{i}.{n}.weight" for n in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    if _get(draft, "enable_confidence_head"):
        names += ["confidence_head.proj.weight", "confidence_head.proj.bias"]
    return names


def check_drafter_tensors(draft: Any, names: Iterable[str]) -> None:
    """Raise ValueError naming the tensors a drafter's checkpoint lacks (a Markov head left out, ...), or holding a
    confidence head its config turns off: vLLM would drop those tensors without a word, and adaptive verification
    would then run on its own acceptance estimate instead of the trained head (a config spelling we misread)."""
    have = set(names)
    missing = [n for n in required_tensors(draft) if n not in have]
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ValueError(f"vllm-ling: the DSpark drafter's checkpoint lacks {shown}. Fix: {FIX}.")
    unread = sorted(n for n in have if n.startswith("confidence_head."))
    if unread and not _get(draft, "enable_confidence_head"):
        raise ValueError(f"vllm-ling: the DSpark drafter's checkpoint holds {', '.join(unread)}, and its config "
                         f"turns the confidence head off (none of {', '.join(ALIASES['enable_confidence_head'])} is "
                         f"true). Fix: set \"enable_confidence_head\": true in the drafter's config.json, or {FIX}.")


def check_draft_shares_target(draft: Any) -> str:
    """Raise unless the drafter's LM head and embedding compute what the target's do: the very modules (what
    vLLM's DSpark loader installs when the drafter's checkpoint holds neither) or equal ones under the same
    quantization method (vllm_ling.draft.check: FP8 bytes read through a BF16 method accept ~nothing, silently).
    Logs and returns the verdict line."""
    return draft_check.check_draft_shares_target(
        draft, label="DSpark drafter", subject="the DSpark drafter's",
        fix="Fix: serve a drafter checkpoint without lm_head / embed_tokens tensors, so it runs on the target's.")


KV_BLOCK_ALIGN = 16  # FlashAttention's kernel block sizes are multiples of 16 tokens


def draft_kv_block(per_token_bytes: int, block: int, target_page_bytes: int | None) -> int:
    """The drafter's own KV block: the largest multiple of KV_BLOCK_ALIGN tokens, at most `block`, whose page
    fits the hybrid target's page, or `block` where that is not needed or not possible.

    On a hybrid target vLLM grows the attention block until an attention page holds a KDA state (256 tokens for
    the tiny model, ~1,900 at full size) and pads the KDA page to equal the MLA page. The drafter's dense layers
    take that block too, and their page (2 x heads x head_dim x 2 B a token: 16 KiB for the released drafter,
    14x MLA's 1,152 B) is then the largest; vLLM must grow every other page to it, and an MLA page that does not
    divide it can be neither grown nor padded (0.34 `unify_kv_cache_spec_page_size` raises NotImplementedError).
    With its page no larger than the target's, the drafter's page is the one vLLM pads (or grows by a whole
    ratio), which it does for non-MLA attention. A block dividing the target's keeps the scheduler's common block
    (the least common multiple of the groups' blocks, which prefix-cache hits are whole multiples of) at the
    target's: 128 for both the tiny (256) and the full-size target (1,920: MLA rounds it to a multiple of 128).
    `target_page_bytes` is vLLM's `mamba_page_size_padded`."""
    if target_page_bytes is None or per_token_bytes * block <= target_page_bytes:
        return block
    fitting = range(KV_BLOCK_ALIGN, min(block, target_page_bytes // per_token_bytes) + 1, KV_BLOCK_ALIGN)
    dividing = [b for b in fitting if block % b == 0]
    return max(dividing or fitting, default=block)


def _own_kv_block(attn: Any) -> None:
    """Give one drafter attention layer its own KV block (`draft_kv_block`) in the spec vLLM plans the cache
    from; the layer's kernels read the block size from its cache group, so nothing else changes."""
    default = attn.get_kv_cache_spec

    def get_kv_cache_spec(vllm_config: Any) -> Any:
        spec = default(vllm_config)
        if spec is None or type(spec).__name__ != "FullAttentionSpec":
            return spec
        per_token = spec.page_size_bytes // spec.block_size
        block = draft_kv_block(per_token, spec.block_size, vllm_config.cache_config.mamba_page_size_padded)
        return spec if block == spec.block_size else spec.copy_with_new_block_size(block)

    attn.get_kv_cache_spec = get_kv_cache_spec


def log_own_quantization(drafter: Any) -> str | None:
    """Log, and return, the start-up line of a drafter built with its own quantization `ling_fp8` (the
    speculative config's `quantization`, vllm_ling.fp8): how many of its linears are FP8 and whether its Markov
    head is; None under any other quantization. vLLM's DSpark backbone keeps the config its layers were built
    with as `model.quant_config` (0.32-0.34)."""
    from vllm_ling import fp8

    quant = getattr(getattr(drafter, "model", None), "quant_config", None)
    if not isinstance(quant, fp8.LingFp8Config):
        return None
    line = quant.dspark_summary()
    logger.info("%s", line)
    return line


def _draft_class() -> type:
    """vLLM's Qwen3 DSpark drafter with two checks: the checkpoint holds every tensor (vLLM's loader skips an
    absent Markov head silently), and the first draft logits run on the target's head and embedding."""
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    class LingDSparkForCausalLM(Qwen3DSparkForCausalLM):
        _shares_checked = False

        def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:  # vLLM passes what the signature names
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            for module in self.modules():
                if hasattr(module, "get_kv_cache_spec") and hasattr(module, "attn_type"):
                    _own_kv_block(module)
            log_own_quantization(self)

        def load_weights(self, weights: Iterable[tuple[str, Any]]):
            names: list[str] = []

            def noting() -> Iterable[tuple[str, Any]]:
                for name, tensor in weights:
                    names.append(name)
                    yield name, tensor

            loaded = super().load_weights(noting())
            check_drafter_tensors(self.config, names)
            return loaded

        def _check_shares_once(self) -> None:
            if not self._shares_checked:  # a Python flag: nothing for a CUDA graph to capture after the first call
                check_draft_shares_target(self)  # logs its verdict line
                self._shares_checked = True

        def compute_draft_logits(self, hidden_states):
            self._check_shares_once()
            return super().compute_draft_logits(hidden_states)

        def compute_draft_logits_local(self, hidden_states):  # 0.34's tensor-parallel path
            self._check_shares_once()
            return super().compute_draft_logits_local(hidden_states)

    LingDSparkForCausalLM.__qualname__ = LingDSparkForCausalLM.__name__  # pickled by reference, via __getattr__
    LingDSparkForCausalLM.__module__ = __name__
    return LingDSparkForCausalLM


def __getattr__(name: str) -> Any:
    """`LingDSparkForCausalLM`, built on first access: vLLM's registry imports it by name, while importing this
    module (the target model does) stays free of vLLM's draft model code."""
    if name == "LingDSparkForCausalLM":
        cls = _draft_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
