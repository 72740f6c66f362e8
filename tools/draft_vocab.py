"""Build a draft vocabulary: the N most frequent token ids of a corpus, for the MTP draft's LM head.

    python3 -m ling_tools.draft_vocab MODEL_DIR --text FILE [FILE ...] [--jsonl-field FIELD] \\
        [--size 32768] --out PATH

As in FR-Spec (Zhao et al. 2025), the draft proposes its next token only among these N ids, so its LM-head
pass reads N rows instead of vocab_size (157,184 for Ling-3.0-flash). The target still verifies every token:
the output is unchanged, and what a subset can cost is acceptance, when the right token lies outside it.
The served side (vllm_ling/draft/vocab_file.py, `load_ids`) reads the file VLLM_LING_DRAFT_VOCAB names and validates
it itself (docs/speed.md §MTP); this module imports neither vLLM nor torch.

MODEL_DIR holds the model's tokenizer.json and config.json (vocab_size; eos_token_id, an int or a list;
bos/pad when set). Without --jsonl-field each FILE is one plain-text document (UTF-8). With it, each FILE is
JSON Lines: every line an object whose FIELD is a string, or an OpenAI-style chat (a list of
{"role", "content"} messages, every content string counted). Tokens are counted with the model's own
tokenizer (add_special_tokens=False), in batches; a plain-text file larger than PIECE_CHARS is cut into
pieces after a line end that a word follows, where byte-level BPE splits anyway (a file with no such line
end is cut between words, where a tokenizer that merges across spaces could count one token differently).

The file: {"format", "version", "token_ids", "size", "vocab_size", "counted_tokens", "distinct_tokens_seen",
"coverage", "tokenizer_sha256", "sources"}. token_ids lists the special ids first (config.json's eos/bos/pad,
then the tokenizer's added tokens marked special), then the most frequent ids (descending count, ties to the
smaller id), then, if fewer than N ids were seen, the smallest unseen ids (byte-level BPE ids roughly follow
merge order, so small ids are the common merges). Exactly N unique ids, each < vocab_size. coverage is the
fraction of counted tokens whose id is in token_ids. The file is written atomically (temp file, os.replace).

Bad input (a missing file, a size outside 1..vocab_size, no tokens, a bad JSON line) exits 2 with the rule,
the values and what to do instead, and writes nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vllm_ling.draft.vocab_file import document  # the file's one definition (the served side reads it)

DEFAULT_SIZE = 32768
PIECE_CHARS = 1 << 18  # a plain-text file is encoded in pieces of at most this many characters
BATCH_CHARS = 1 << 21  # characters per encode_batch call: bounds the memory the encodings take
BATCH_DOCS = 1024


class BadInput(Exception):
    """Input the tool refuses: exit 2, the message names the rule, the values and the safe alternative."""


# ---------------------------------------------------------------------------------------------- the model


def read_model(model_dir: Path) -> tuple[Path, int, list[int]]:
    """(tokenizer.json path, config.json's vocab_size, config.json's eos/bos/pad ids in that order)."""
    tok_path, cfg_path = model_dir / "tokenizer.json", model_dir / "config.json"
    if not model_dir.is_dir():
        raise BadInput(f"MODEL_DIR {str(model_dir)!r} is not a directory; pass the checkpoint folder that "
                       "holds tokenizer.json and config.json")
    if not tok_path.is_file():
        raise BadInput(f"no tokenizer.json in MODEL_DIR {str(model_dir)!r}: the vocabulary must be counted with "
                       "the model's own tokenizer; pass the checkpoint folder (the one vLLM serves) that holds it")
    if not cfg_path.is_file():
        raise BadInput(f"no config.json in MODEL_DIR {str(model_dir)!r}: its vocab_size bounds the ids; pass the "
                       "checkpoint folder that holds it")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInput(f"{cfg_path} is not readable JSON ({e}); pass an intact checkpoint folder") from e
    vocab_size = config.get("vocab_size") if isinstance(config, dict) else None
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise BadInput(f"{cfg_path}: vocab_size must be a positive integer, got {vocab_size!r}; pass the "
                       "checkpoint folder of the model the draft vocabulary is for")
    specials: list[int] = []
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = config.get(key)
        for tid in (value if isinstance(value, list) else [value]):
            if tid is None:
                continue
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size:
                raise BadInput(f"{cfg_path}: {key}={value!r} must be token ids in 0..{vocab_size - 1} "
                               f"(vocab_size {vocab_size}); fix config.json or pass the matching checkpoint")
            specials.append(tid)
    return tok_path, vocab_size, specials


def tokenizer_specials(tok_path: Path, vocab_size: int) -> tuple[list[int], list[int]]:
    """(ids of tokenizer.json's added tokens marked special, ascending and < vocab_size; those >= vocab_size)."""
    try:
        data = json.loads(tok_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise BadInput(f"{tok_path} is not readable JSON ({e}); pass an intact checkpoint folder") from e
    ids = sorted({t["id"] for t in data.get("added_tokens") or []
                  if isinstance(t, dict) and t.get("special") and isinstance(t.get("id"), int)})
    return [i for i in ids if i < vocab_size], [i for i in ids if i >= vocab_size]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- the texts


def _cut(text: str, limit: int) -> int:
    """Where to cut `text` at or before `limit`: after a line end followed by a non-space (byte-level BPE
    pre-tokenizers split there anyway, so the counts stay those of the whole text), else before a single
    space between two words, else at `limit`."""
    i = limit
    while (i := text.rfind("\n", 0, i)) >= 0:
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1
    i = limit
    while (i := text.rfind(" ", 0, i)) > 0:
        if i + 1 < len(text) and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i
    return limit


def _plain_pieces(path: Path) -> Iterator[str]:
    """The file's text in pieces of at most PIECE_CHARS characters, cut where `_cut` says."""
    try:
        with open(path, encoding="utf-8", newline="") as f:  # newline="": the text as it is, \r\n included
            carry = ""
            while True:
                block = f.read(PIECE_CHARS)
                carry += block
                while len(carry) > PIECE_CHARS or (carry and not block):
                    cut = _cut(carry, PIECE_CHARS) if len(carry) > PIECE_CHARS else len(carry)
                    yield carry[:cut]
                    carry = carry[cut:]
                if not block:
                    return
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text ({e}); convert it (e.g. iconv -t UTF-8) or leave it out") from e


def _message_texts(value: list, where: str, field: str) -> Iterator[str]:
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise BadInput(f"{where}: {field}[{i}] is {type(message).__name__}, but a chat must be a list of "
                           '{"role", "content"} objects; fix the line or pick another --jsonl-field')
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):  # OpenAI content parts: count the text ones
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    yield part["text"]
        elif content is not None:
            raise BadInput(f"{where}: {field}[{i}].content is {type(content).__name__}, not a string; fix the "
                           "line or pick another --jsonl-field")


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise BadInput(f"{where}: not a JSON object ({e}); with --jsonl-field every non-blank line "
                                   "must be one JSON object; fix or drop the line, or pass the file without "
                                   "--jsonl-field to count it as plain text") from e
                if not isinstance(obj, dict) or field not in obj:
                    has = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
                    raise BadInput(f"{where}: no field {field!r} (the line has {has}); every line needs "
                                   f"--jsonl-field {field}: fix the line or pass the field the file uses")
                value = obj[field]
                if isinstance(value, str):
                    yield value
                elif isinstance(value, list):
                    yield from _message_texts(value, where, field)
                elif value is not None:
                    raise BadInput(f"{where}: {field} is {type(value).__name__}; it must be a string or a list "
                                   'of {"role", "content"} messages; fix the line or pick another --jsonl-field')
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}: not UTF-8 text ({e}); convert it (e.g. iconv -t UTF-8) or leave it out") from e


def iter_texts(paths: Sequence[Path], jsonl_field: str | None) -> Iterator[str]:
    for path in paths:
        yield from (_jsonl_texts(path, jsonl_field) if jsonl_field else _plain_pieces(path))


def _batches(texts: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in texts:
        if not text:
            continue
        batch.append(text)
        chars += len(text)
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def count_tokens(tokenizer: Any, texts: Iterable[str], progress: Any = None) -> Counter:
    """Token id -> count over `texts`, encoded in batches with add_special_tokens=False."""
    counts: Counter = Counter()
    for batch in _batches(texts):
        for enc in tokenizer.encode_batch(batch, add_special_tokens=False):
            counts.update(enc.ids)
        if progress is not None:
            progress.update(sum(len(t) for t in batch))
    return counts


# ---------------------------------------------------------------------------------------------- the choice


def select_ids(counts: Counter, specials: Sequence[int], size: int, vocab_size: int) -> list[int]:
    """`specials` (deduplicated, in order), then ids by descending count (ties: smaller id), then the smallest
    unseen ids; exactly `size` unique ids, all < vocab_size."""
    if not 1 <= size <= vocab_size:
        raise BadInput(f"--size {size} must be in 1..vocab_size ({vocab_size}); pass a size in that range "
                       f"(leave --size out for {min(DEFAULT_SIZE, vocab_size)})")
    chosen = list(dict.fromkeys(specials))
    if len(chosen) > size:
        raise BadInput(f"--size {size} is smaller than the {len(chosen)} special ids that must be in it "
                       f"({chosen}); pass --size {len(chosen)} or more")
    taken = set(chosen)
    ranked = sorted((tid for tid, n in counts.items() if n > 0 and tid not in taken and 0 <= tid < vocab_size),
                    key=lambda tid: (-counts[tid], tid))
    for tid in ranked[:size - len(chosen)]:
        chosen.append(tid)
        taken.add(tid)
    tid = 0
    while len(chosen) < size:  # fewer ids seen than asked for: the smallest unseen ones
        if tid not in taken:
            chosen.append(tid)
            taken.add(tid)
        tid += 1
    return chosen


def coverage(counts: Counter, ids: Iterable[int]) -> float:
    total = sum(counts.values())
    return sum(counts.get(tid, 0) for tid in set(ids)) / total if total else 0.0


# ---------------------------------------------------------------------------------------------- the file


def write_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to a temp file beside `path`, then os.replace it in: never a partial file at path."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


# ---------------------------------------------------------------------------------------------- the command


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="counting", disable=None, file=sys.stderr)


def build(model_dir: Path, texts: Sequence[Path], out: Path, size: int | None = None,
          jsonl_field: str | None = None, log=None) -> dict[str, Any]:
    """Check every input, count, choose, write `out`; return the written object. BadInput writes nothing.
    `size` None: DEFAULT_SIZE, or vocab_size if that is smaller."""
    log = log or (lambda line: print(line, file=sys.stderr))
    tok_path, vocab_size, cfg_specials = read_model(model_dir)
    if size is None:
        size = min(DEFAULT_SIZE, vocab_size)
        if size < DEFAULT_SIZE:
            log(f"note: vocab_size {vocab_size:,} is below the default size {DEFAULT_SIZE:,}; using {size:,}")
    if not 1 <= size <= vocab_size:
        raise BadInput(f"--size {size} must be in 1..vocab_size ({vocab_size}); pass a size in that range "
                       f"(leave --size out for {min(DEFAULT_SIZE, vocab_size)})")
    if not texts:
        raise BadInput("no --text FILE given; pass at least one text or .jsonl file")
    missing = [str(p) for p in texts if not p.is_file()]
    if missing:
        raise BadInput(f"--text: not a file: {', '.join(missing)}; pass existing text or .jsonl files")
    if jsonl_field is not None and not jsonl_field:
        raise BadInput("--jsonl-field is empty; pass the name of the field that holds the text (e.g. text or "
                       "messages), or leave --jsonl-field out to read the files as plain text")
    if out.is_dir():
        raise BadInput(f"--out {str(out)!r} is a directory; pass a file path, e.g. {str(out / 'draft_vocab.json')!r}")
    if not out.parent.is_dir():
        raise BadInput(f"--out {str(out)!r}: its directory {str(out.parent)!r} does not exist; create it first "
                       "(mkdir -p) or write elsewhere")
    unique: list[Path] = []
    seen: set[Path] = set()
    for p in texts:
        if p.resolve() in seen:
            log(f"note: {p} given twice, counted once")
            continue
        seen.add(p.resolve())
        unique.append(p)
        if jsonl_field is None and p.suffix == ".jsonl":
            log(f"note: {p} is read as plain text (JSON syntax included); pass --jsonl-field FIELD to count "
                "only its text")

    tok_specials, beyond = tokenizer_specials(tok_path, vocab_size)
    if beyond:
        log(f"note: the tokenizer's special ids {beyond} are >= vocab_size {vocab_size}, left out")
    specials = list(dict.fromkeys(cfg_specials + tok_specials))
    if len(specials) > size:
        raise BadInput(f"--size {size} is smaller than the {len(specials)} special ids that must be in it; "
                       f"pass --size {len(specials)} or more")

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tok_path))
    bar = _progress(sum(p.stat().st_size for p in unique))
    try:
        counts = count_tokens(tokenizer, iter_texts(unique, jsonl_field), bar)
    finally:
        if bar is not None:
            bar.close()
    total = sum(counts.values())
    if total == 0:
        raise BadInput(f"no tokens counted in {', '.join(str(p) for p in unique)}"
                       + (f" (field {jsonl_field!r})" if jsonl_field else "")
                       + "; pass files with text in them" + ("" if jsonl_field else
                                                             ", or --jsonl-field FIELD for JSON Lines"))
    ids = select_ids(counts, specials, size, vocab_size)
    result = document(ids, size=size, vocab_size=vocab_size, counted_tokens=total, distinct_tokens_seen=len(counts),
                      coverage=coverage(counts, ids), tokenizer_sha256=sha256_file(tok_path),
                      sources=[p.name for p in unique])
    try:
        write_atomic(out, result)
    except OSError as e:
        raise BadInput(f"cannot write --out {str(out)!r} ({e}); pass a path in a writable directory") from e

    log(f"counted {total:,} tokens, {len(counts):,} distinct (vocab_size {vocab_size:,}) in {len(unique)} file(s)")
    hints = []
    for n in (size // 2, size, min(2 * size, vocab_size)):
        if n >= max(1, len(specials)) and n not in {h[0] for h in hints}:
            hints.append((n, coverage(counts, ids if n == size else select_ids(counts, specials, n, vocab_size))))
    log("coverage: " + ", ".join(f"{c:.2%} at {n:,}" + (" (this file)" if n == size else "") for n, c in hints))
    unseen = sum(1 for tid in ids if tid not in counts)
    if len(counts) < size:
        log(f"note: only {len(counts):,} distinct ids seen, fewer than --size {size:,}: {unseen:,} of the ids "
            "were never seen (specials, then the smallest unseen ids)")
    log(f"wrote {size:,} ids ({len(specials)} special first) to {out}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m ling_tools.draft_vocab",
        description="Build a draft vocabulary (the N most frequent token ids of your text) for the MTP draft; "
                    "serve it with VLLM_LING_DRAFT_VOCAB=PATH.")
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=Path,
                        help="checkpoint folder with tokenizer.json and config.json")
    parser.add_argument("--text", nargs="+", required=True, type=Path, metavar="FILE",
                        help="plain-text files (one document each), or .jsonl files with --jsonl-field")
    parser.add_argument("--jsonl-field", metavar="FIELD", default=None,
                        help="read FILEs as JSON Lines; FIELD holds a string or a list of chat messages")
    parser.add_argument("--size", type=int, default=None,
                        help=f"number of ids N, specials included (default {DEFAULT_SIZE}, or vocab_size if smaller)")
    parser.add_argument("--out", required=True, type=Path, metavar="PATH", help="the JSON file to write")
    args = parser.parse_args(argv)
    try:
        build(args.model_dir, args.text, args.out, size=args.size, jsonl_field=args.jsonl_field)
    except BadInput as e:
        print(f"ling_tools.draft_vocab: error: {e}; nothing written", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
