"""One pass over a Ling-3 output: reasoning, content and tool calls, the same for any chunking.

The grammar (docs/parsers.md §3) in short:

* With thinking on the output starts in reasoning (the prompt opened `<think>`); `</think>` ends it.
  A `<think>` as the very first token repeats the opener and is markup; anywhere else it is text.
* `<tool_call>` opens a candidate call wherever calls are possible (the request offers tools and
  allows calls). A candidate is `<tool_call>NAME (<arg_key>K</arg_key> <arg_value>V</arg_value>)*
  </tool_call>` with only whitespace between the parts, no other markup inside, a NAME the request
  allows and arguments that fit the tool's schema. It becomes a call at its `</tool_call>`; a call in
  reasoning also ends the reasoning. At its first violation (or at the end of the output) it is
  refused: its text so far goes out verbatim as reasoning or content, and the token that broke it is
  read again as reasoning or content, so a `</think>` or a later `<tool_call>` keeps its meaning.
* Everything else is text of the current part. Special tokens of the tokenizer that are not Ling-3
  markup are control tokens that vLLM's detokenizer would have skipped: they are dropped.

Every decision depends only on the text up to the token being read, so a whole output and any split of
it into chunks give the same pieces. `Piece.raw` keeps each piece's source text: the pieces of an
output concatenate back to it exactly (nothing is lost), which the tests check.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from vllm_ling.parsers.markup import (
    CALL_END,
    CALL_START,
    KEY_END,
    KEY_START,
    TAGS,
    THINK_END,
    THINK_START,
    VALUE_END,
    VALUE_START,
    Lexer,
    Token,
)
from vllm_ling.parsers.schema import ToolSchema, Violation

logger = logging.getLogger(__name__)

_RUNS = re.compile(r"\s+|\S+")


class Kind(Enum):
    REASONING = auto()
    CONTENT = auto()
    MARKUP = auto()  # a tag acting as markup, or a dropped special token: in no output field
    CALL = auto()


@dataclass(frozen=True, slots=True)
class Piece:
    kind: Kind
    raw: str  # the output text this piece came from
    name: str = ""  # CALL only
    arguments: str = ""  # CALL only: a JSON object


@dataclass(frozen=True)
class Policy:
    """What one request allows: thinking on or off, and the tools a call may name (none: no calls)."""

    thinking: bool
    tools: Mapping[str, ToolSchema] = field(default_factory=dict)


class _At(Enum):
    """Where a candidate call is: after `<tool_call>`, between pairs, in a key, before a value, in a value."""

    NAME = auto()
    BETWEEN = auto()
    KEY = auto()
    BEFORE_VALUE = auto()
    VALUE = auto()


class _Candidate:
    """A `<tool_call>` block being read; `take` answers None (go on), a CALL piece, or a Violation."""

    def __init__(self, tools: Mapping[str, ToolSchema], opener: str) -> None:
        self._tools = tools
        self.raw: list[Token] = [Token(opener, tag=True)]
        self._at = _At.NAME
        self._name = ""  # non-blank name characters so far
        self._name_ended = False  # whitespace followed the name
        self._tool: ToolSchema | None = None
        self._key: list[str] = []
        self._value: list[str] = []
        self._args: dict[str, Any] = {}

    def take(self, tok: Token) -> Piece | Violation | None:
        """Read one more token. A Violation leaves `tok` out of `raw`: the caller reads it again."""
        try:
            closed = self._step(tok)
        except Violation as v:
            return v
        self.raw.append(tok)
        if not closed:
            return None
        assert self._tool is not None
        return Piece(
            Kind.CALL,
            "".join(t.text for t in self.raw),
            name=self._tool.name,
            arguments=json.dumps(self._args, ensure_ascii=False),
        )

    def _step(self, tok: Token) -> bool:
        """Advance on `tok`; True when `tok` closed a valid call, Violation when it broke the block."""
        tag = tok.text if tok.tag else None
        if tag is not None and tag not in TAGS:
            return False  # a dropped special token: kept in raw, in no field
        at = self._at
        if at is _At.NAME and tag is None:
            self._read_name(tok.text)
        elif at is _At.NAME and tag in (KEY_START, CALL_END):
            self._tool = self._named_tool()
            self._at = _At.KEY
            return tag == CALL_END and self._close()
        elif at in (_At.BETWEEN, _At.BEFORE_VALUE) and tag is None:
            if tok.text.strip():
                raise Violation(f"text {tok.text.strip()[:40]!r} inside a tool call, {at.name.lower()}")
        elif at is _At.BETWEEN and tag in (KEY_START, CALL_END):
            self._at = _At.KEY
            return tag == CALL_END and self._close()
        elif at is _At.KEY and tag is None:
            self._key.append(tok.text)
            self._check_key_prefix()
        elif at is _At.KEY and tag == KEY_END:
            key = "".join(self._key).strip()
            self._tool_().check_key(key, self._args)
            self._key = [key]
            self._at = _At.BEFORE_VALUE
        elif at is _At.BEFORE_VALUE and tag == VALUE_START:
            self._at = _At.VALUE
        elif at is _At.VALUE and tag is None:
            self._value.append(tok.text)
        elif at is _At.VALUE and tag == VALUE_END:
            key = self._key[0]
            self._args[key] = self._tool_().read_value(key, "".join(self._value))
            self._key, self._value = [], []
            self._at = _At.BETWEEN
        else:
            raise Violation(f"{tag} inside a tool call, {at.name.lower()}")
        return False

    def _read_name(self, text: str) -> None:
        """Names have no blanks: blanks may surround the name; text after them breaks the block."""
        for run in _RUNS.findall(text):
            if run.isspace():
                self._name_ended = bool(self._name)
                continue
            if self._name_ended:
                raise Violation(f"text {run[:40]!r} after the tool name {self._name!r}")
            self._name += run
            if not any(n.startswith(self._name) for n in self._tools):
                raise Violation(f"no tool of the request is named {self._name[:40]!r}; tools: {sorted(self._tools)}")

    def _check_key_prefix(self) -> None:
        tool = self._tool_()
        if tool.closed and not tool.key_could_be("".join(self._key)):  # keys of a closed schema are short
            raise Violation(f"tool {tool.name!r}: no argument key starts {''.join(self._key).strip()[:40]!r}")

    def _named_tool(self) -> ToolSchema:
        tool = self._tools.get(self._name)
        if tool is None:
            raise Violation(
                f"the call names {self._name!r}, which is not one of the request's tools {sorted(self._tools)}"
            )
        return tool

    def _tool_(self) -> ToolSchema:
        assert self._tool is not None
        return self._tool

    def _close(self) -> bool:
        self._tool_().check_arguments(self._args)
        return True


class OutputParser:
    """Incremental reader of one output: `feed` chunks, then `finish`; both return `Piece`s in order.

    `drop` are special-token strings to discard. `reasoning_end` is the offset in the output where the
    part after reasoning starts (after `</think>`, or at the `<tool_call>` of a call that ended it).
    """

    def __init__(self, policy: Policy, drop: Iterable[str] = ()) -> None:
        self._policy = policy
        self._drop = frozenset(drop) - TAGS
        self._lexer = Lexer(TAGS | self._drop)
        self._reasoning = policy.thinking
        self._first = True
        self._candidate: _Candidate | None = None
        self._candidate_at = 0
        self._offset = 0
        self.reasoning_end: int | None = None if policy.thinking else 0
        self.refusals: list[str] = []  # why each refused candidate was refused, for logs and tests

    @property
    def scanned(self) -> int:
        """Characters the lexer examined: the linear-time check's counter."""
        return self._lexer.scanned

    def feed(self, text: str) -> list[Piece]:
        return self._read(self._lexer.feed(text))

    def finish(self) -> list[Piece]:
        out = self._read(self._lexer.finish())
        if self._candidate is not None:
            out += self._refuse(Violation("the output ended inside a tool call"))
        return out

    def _read(self, tokens: list[Token]) -> list[Piece]:
        out: list[Piece] = []
        for tok in tokens:
            out += self._token(tok)
            self._offset += len(tok.text)
        return out

    def _token(self, tok: Token) -> list[Piece]:
        out: list[Piece] = []
        if self._candidate is not None:
            verdict = self._candidate.take(tok)
            if verdict is None:
                return out
            if isinstance(verdict, Piece):
                self._candidate = None
                if self._reasoning:
                    self._reasoning = False
                    self.reasoning_end = self._candidate_at
                return [verdict]
            out += self._refuse(verdict)
        first, self._first = self._first, False
        if tok.tag and tok.text in self._drop:
            out.append(Piece(Kind.MARKUP, tok.text))
        elif tok.text == CALL_START and tok.tag and self._policy.tools:
            self._candidate = _Candidate(self._policy.tools, tok.text)
            self._candidate_at = self._offset
        elif self._reasoning and tok.tag and tok.text == THINK_END:
            self._reasoning = False
            self.reasoning_end = self._offset + len(tok.text)
            out.append(Piece(Kind.MARKUP, tok.text))
        elif self._reasoning and tok.tag and tok.text == THINK_START and first:
            out.append(Piece(Kind.MARKUP, tok.text))
        else:
            out.append(self._text(tok.text))
        return out

    def _text(self, text: str) -> Piece:
        return Piece(Kind.REASONING if self._reasoning else Kind.CONTENT, text)

    def _refuse(self, why: Violation) -> list[Piece]:
        candidate, self._candidate = self._candidate, None
        assert candidate is not None
        self.refusals.append(str(why))
        logger.warning(
            "ling3: a <tool_call> block is returned as text (%s): %r", why, "".join(t.text for t in candidate.raw)[:200]
        )
        out: list[Piece] = []
        for tok in candidate.raw:
            out.append(Piece(Kind.MARKUP, tok.text) if tok.tag and tok.text in self._drop else self._text(tok.text))
        return out
