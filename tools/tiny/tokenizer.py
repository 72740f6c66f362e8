"""The tiny tokenizer: a ~1000-token byte-level BPE trained here on `corpus.txt`, with Ling's special
tokens and a GLM-like chat template (`chat_template.jinja`) using Ling's `<role>` markers.

Thinking is on unless `enable_thinking`/`thinking` is false: the generation prompt then opens the
think block, as Ling-3.0's template does (docs/tiny-checkpoints.md).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from vllm_ling.parsers import markup

# Order matters: it fixes the token ids, hence the tiny checkpoints' bytes. The eight markup tags are the parsers'.
SPECIAL_TOKENS = (
    "<|endoftext|>",  # eos
    "<|pad|>",
    "<role>",
    "</role>",
    "<|role_end|>",
    markup.THINK_START,
    markup.THINK_END,
    markup.CALL_START,
    markup.CALL_END,
    markup.KEY_START,
    markup.KEY_END,
    markup.VALUE_START,
    markup.VALUE_END,
)
TOKENIZER_VOCAB = 1000


def corpus() -> str:
    """The BPE's training text: plain English and a little Python/JSON/SQL, written for this project."""
    return files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def chat_template() -> str:
    return files(__package__).joinpath("chat_template.jinja").read_text(encoding="utf-8").removesuffix("\n")


def build_tokenizer():
    """Train the BPE on `corpus()`, one line per example; special tokens are appended after the merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus().strip().split("\n"), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def write_tokenizer(out_dir: Path, max_length: int) -> tuple[int, int, int]:
    """Write tokenizer.json + tokenizer_config.json; return (eos_id, pad_id, number of tokens)."""
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                        "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "chat_template": chat_template(),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>"), tok.get_vocab_size()
