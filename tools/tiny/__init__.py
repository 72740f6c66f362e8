"""Tiny random-weight Ling-3.0 (BailingMoeV3) checkpoints: the test fixtures and the README's default model.

The tiny model keeps every structural feature of Ling-3.0-flash at toy width (docs/tiny-checkpoints.md):
KDA layers with the MLA layer every ``layer_group_size``-th, a dense first layer, grouped sigmoid routing
with a correction bias, shared + routed experts with per-layer SwiGLU clamps, and one MTP layer. Names,
shapes and the INT4 layout are those of the real checkpoints (`ling_tools.tensors`, docs/architecture.md
§Tensors, §INT4); the config is the bundled full-size Flash config with smaller values, so the field set
is the real one. Same seed, same bytes.

    ling-make-tiny OUT [--seed N] [--int4] [--variant qlora] [--force]   # write a checkpoint to OUT
    ling-make-tiny [--int4]               # build once into the cache (ensure_tiny) and print its path
    ling-make-tiny OUT --full-config      # full-size Flash INT4 config.json for --load-format dummy
    ling-make-tiny OUT --full-config --tokenizer   # ... with the tiny tokenizer: a dummy server that takes text
    ling-make-tiny OUT --dequantize INT4  # INT4 checkpoint -> BF16 (the oracle's input)

Modules: `config` (tiny values), `weights` (random init, variants), `int4` (the INT4 format),
`tokenizer` (BPE, chat template), `writer` (files), `cache`, `cli`.
"""

from vllm_ling.configs import flash_config as full_config
from ling_tools.tensors import TensorSpec, param_counts, tensor_specs
from ling_tools.tiny.cache import default_tiny_dir, ensure_tiny
from ling_tools.tiny.cli import main
from ling_tools.tiny.config import QLORA_VALUES, TINY_VALUES, VARIANTS, tiny_config
from ling_tools.tiny.int4 import INT4_GROUP_SIZE, int4_ignore_list, int4_scheme, quantize_experts
from ling_tools.tiny.tokenizer import SPECIAL_TOKENS, build_tokenizer, chat_template, corpus
from ling_tools.tiny.weights import ECHO_DAMPING, STABLE_BIAS_GAIN, make_draft_agree, random_weights
from ling_tools.tiny.writer import (GENERATOR_VERSION, STAMP_FILE, dequantize_checkpoint, make_tiny_checkpoint,
                                   write_full_config)

__all__ = [
    "ECHO_DAMPING", "GENERATOR_VERSION", "INT4_GROUP_SIZE", "QLORA_VALUES", "SPECIAL_TOKENS", "STABLE_BIAS_GAIN",
    "STAMP_FILE", "TINY_VALUES", "VARIANTS", "TensorSpec", "build_tokenizer", "chat_template", "corpus",
    "default_tiny_dir", "dequantize_checkpoint", "ensure_tiny", "full_config", "int4_ignore_list", "int4_scheme",
    "main", "make_draft_agree", "make_tiny_checkpoint", "param_counts", "quantize_experts", "random_weights",
    "tensor_specs", "tiny_config", "write_full_config",
]
