"""The draft vocabulary file: what `python3 -m ling_tools.draft_vocab` writes and the MTP draft reads
(vllm_ling/draft/vocab.py, through VLLM_LING_DRAFT_VOCAB). Standard library only, so the tool runs without torch.

    {"format": FORMAT, "version": VERSION, "token_ids": [...], ...}   (the tool adds counts, coverage, sources)

`token_ids` must be unique ints in [0, vocab_size); the rest is for people.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

ENV = "VLLM_LING_DRAFT_VOCAB"  # path to a draft vocabulary file; unset: the draft reads the whole head
FORMAT = "vllm-ling draft vocabulary"
VERSION = 1


def document(token_ids: list[int], **fields) -> dict:
    """The file's contents for `token_ids` (and the writer's own `fields`: counts, coverage, sources)."""
    return {"format": FORMAT, "version": VERSION, "token_ids": token_ids, **fields}


def requested_path(env: Mapping[str, str] = os.environ) -> str | None:
    """The file VLLM_LING_DRAFT_VOCAB names in `env` (this process's environment unless given), or None if unset."""
    from vllm_ling import envs

    return envs.read(ENV, env)


def load_ids(path: str | os.PathLike, vocab_size: int) -> list[int]:
    """The file's `token_ids`: unique ints in [0, vocab_size). Anything else is refused, naming the rule."""
    safe = f"rebuild it with `python3 -m ling_tools.draft_vocab MODEL --text ... --out {path}`, or unset {ENV}"
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"vllm-ling: {ENV}={path}: cannot read a draft vocabulary there ({e}); {safe}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"vllm-ling: {ENV}={path} is not a draft vocabulary file (format {FORMAT!r}); {safe}")
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"vllm-ling: {ENV}={path}: token_ids must be a non-empty list of ints; {safe}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"vllm-ling: {ENV}={path}: {len(bad)} ids outside this model's vocabulary [0, {vocab_size})"
                         f" (first {bad[:5]}); the file was made for another tokenizer: {safe}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"vllm-ling: {ENV}={path}: token_ids repeat ({len(ids) - len(set(ids))} duplicates); {safe}")
    return ids
