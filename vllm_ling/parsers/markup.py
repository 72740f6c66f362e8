"""Ling-3's markup strings, and a lexer that finds them in streamed text in linear time.

The markup is GLM-4.7's (docs/parsers.md §1): eight tags, each one special token of the tokenizer. The
lexer works on text, not token ids, so that a whole output and the same output cut into any chunks
(tokens, characters, MTP steps) give the same tokens. It holds back at most one possible tag prefix
(shorter than the longest literal) between feeds; every character is examined a bounded number of times.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
KEY_START = "<arg_key>"
KEY_END = "</arg_key>"
VALUE_START = "<arg_value>"
VALUE_END = "</arg_value>"

TAGS = frozenset({THINK_START, THINK_END, CALL_START, CALL_END, KEY_START, KEY_END, VALUE_START, VALUE_END})


@dataclass(frozen=True, slots=True)
class Token:
    """A run of plain text, or one whole markup string (`tag=True`)."""

    text: str
    tag: bool = False


@dataclass(frozen=True)
class _Shape:
    """What a Lexer needs to know about its literals; built once per set of literals."""

    literal: re.Pattern[str]  # any literal, longest first
    start: re.Pattern[str]  # any character a literal starts with
    prefixes: frozenset[str]  # proper prefixes of the literals
    longest: int


@functools.cache
def _shape(literals: frozenset[str]) -> _Shape:
    lits = sorted((s for s in literals if s), key=len, reverse=True)
    if not lits:
        raise ValueError("Lexer needs at least one non-empty literal to recognise")
    return _Shape(
        literal=re.compile("|".join(re.escape(s) for s in lits)),
        start=re.compile("[" + "".join(re.escape(c) for c in sorted({s[0] for s in lits})) + "]"),
        prefixes=frozenset(s[:i] for s in lits for i in range(1, len(s))),
        longest=len(lits[0]),
    )


class Lexer:
    """Splits text fed in arbitrary chunks into `Token`s; `literals` are the strings to recognise.

    `scanned` counts the characters examined (fed text plus held-back prefixes re-read), so tests can
    check that the work is linear in the output length without timing anything.
    """

    def __init__(self, literals: Iterable[str]) -> None:
        self._shape = _shape(frozenset(literals))
        self._held = ""
        self.scanned = 0

    def feed(self, text: str) -> list[Token]:
        """Tokens that `text` completes; a possible literal prefix at its end waits for the next feed."""
        return self._scan(self._held + text, final=False)

    def finish(self) -> list[Token]:
        """The rest: a held prefix that no literal completed is plain text."""
        return self._scan(self._held, final=True)

    def _scan(self, buf: str, final: bool) -> list[Token]:
        shape, self._held = self._shape, ""
        self.scanned += len(buf)
        out: list[Token] = []
        text_from = pos = 0
        while (m := shape.start.search(buf, pos)) is not None:
            i = m.start()
            if not final and len(buf) - i < shape.longest and buf[i:] in shape.prefixes:
                self._held = buf[i:]  # may still become a literal (or a longer one)
                buf = buf[:i]
                break
            if (lit := shape.literal.match(buf, i)) is None:
                pos = i + 1
                continue
            if i > text_from:
                out.append(Token(buf[text_from:i]))
            out.append(Token(lit.group(), tag=True))
            text_from = pos = lit.end()
        if len(buf) > text_from:
            out.append(Token(buf[text_from:]))
        return out
