"""`ling3` reasoning and tool-call parsers for vLLM versions that lack them (vLLM < 0.28).

Ling-3.0 writes GLM-4.7's format (ling3-architecture.md §9): `<think>`…`</think>` reasoning, on by
default, and calls `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`. vLLM's
declarative `Glm47MoeParser` engine, in 0.26 and 0.32 alike, does the parsing: thinking switch, implicit
reasoning end at `<tool_call>`, name validation, schema type coercion, streaming. This module names it
`ling3`, as vLLM 0.33 does, and changes what becomes of malformed output, which vLLM drops silently:

* a `<tool_call>` block is a call only if its name is complete and offered by the request; otherwise
  the block's exact text stays in the content (an unknown name is logged);
* a call cut off inside a value keeps that value, so the streamed arguments (already sent) and the
  final arguments are the same valid JSON;
* text after a tool call survives the non-streaming path too.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.parser.engine.adapters import ParserEngineReasoningAdapter, ParserEngineToolAdapter
from vllm.parser.engine.events import EventType, SemanticEvent
from vllm.parser.engine.parser_engine_config import ParserEngineConfig
from vllm.parser.engine.streaming_parser_engine import StreamingParserEngine
from vllm.parser.glm47_moe import _ARG_RE, ARG_VALUE_END, ARG_VALUE_START, Glm47MoeParser, glm47_moe_config

if TYPE_CHECKING:
    from vllm.tokenizers import TokenizerLike

logger = logging.getLogger(__name__)

NAME = "ling3"

_START, _NAME, _ARG, _END = (
    EventType.TOOL_CALL_START,
    EventType.TOOL_NAME,
    EventType.ARG_VALUE_CHUNK,
    EventType.TOOL_CALL_END,
)


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """On unless the request sets `thinking` or `enable_thinking` and neither is true (§9)."""
    kwargs = chat_template_kwargs or {}
    thinking, enable_thinking = kwargs.get("thinking"), kwargs.get("enable_thinking")
    if thinking is None and enable_thinking is None:
        return True
    return bool(thinking) or bool(enable_thinking)


@functools.cache
def ling3_config(thinking: bool) -> ParserEngineConfig:
    """GLM-4.7's engine config under our name; cached, so its lexer is compiled once per process."""
    return replace(glm47_moe_config(thinking=thinking), name=NAME)


def _tool_names(tools: Sequence[Any]) -> list[str]:
    """Names of chat (`tool.function.name`) and Responses (`tool.name`) tools, for log messages."""
    return sorted(str(getattr(getattr(t, "function", None), "name", None) or getattr(t, "name", "?")) for t in tools)


class _CallGate(StreamingParserEngine):
    """Holds each `<tool_call>` block until its name is complete, then passes it on as a call or as text.

    The name is complete at the block's first `<arg_key>` or at `</tool_call>`. A block cut off before
    that, or whose name `accept` refuses, becomes one TEXT_CHUNK of its exact text; later calls are
    renumbered so that tool indices stay dense. The engine closes a block cut off by the end of output
    with an empty TOOL_CALL_END; inside `<arg_value>` we first add the missing `</arg_value>`, so the
    final arguments keep the value that streaming has already sent.
    """

    def __init__(
        self,
        config: ParserEngineConfig,
        tokenizer: TokenizerLike,
        *,
        vocab: dict[str, int],
        accept: Callable[[str], bool],
    ) -> None:
        self._accept = accept
        super().__init__(config, tokenizer, vocab=vocab)

    def reset(self, initial_state=None) -> None:
        super().reset(initial_state=initial_state)
        self._held: list[SemanticEvent] | None = None  # the open block while its name is undecided
        self._text = ""  # the open block as written
        self._as_text = False  # the open block was refused
        self._refused = 0  # blocks refused so far: the shift of later tool indices

    def feed(self, delta_text: str, delta_token_ids: Sequence[int]) -> list[SemanticEvent]:
        return self._gate(super().feed(delta_text, delta_token_ids))

    def finish(self) -> list[SemanticEvent]:
        return self._gate(super().finish())

    def _gate(self, events: list[SemanticEvent]) -> list[SemanticEvent]:
        out: list[SemanticEvent] = []
        for ev in events:
            if ev.type not in (_START, _NAME, _ARG, _END):
                out.append(ev)
                continue
            if ev.type is _START:
                self._held, self._text = [], ""
            self._text += ev.value
            cut = ev.type is _END and not ev.value
            if self._held is not None:
                self._held.append(ev)
                if ev.type in (_ARG, _END):
                    out.extend(self._decide(cut))
            elif self._as_text:
                out.append(SemanticEvent(EventType.TEXT_CHUNK, ev.value))
            else:
                if cut and self._text.rfind(ARG_VALUE_START) > self._text.rfind(ARG_VALUE_END):
                    logger.warning(
                        "ling3: output ended inside a tool-call value; kept as written: %r", self._text[-200:]
                    )
                    out.append(self._renumber(replace(ev, type=_ARG, value=ARG_VALUE_END)))
                out.append(self._renumber(ev))
            if ev.type is _END:
                self._refused += self._as_text
                self._as_text = False
        return out

    def _decide(self, cut: bool) -> list[SemanticEvent]:
        held, self._held = self._held or [], None
        name = "".join(e.value for e in held if e.type is _NAME).strip()
        if not cut and self._accept(name):
            return [self._renumber(e) for e in held]
        self._as_text = True
        return [SemanticEvent(EventType.TEXT_CHUNK, self._text)]

    def _renumber(self, ev: SemanticEvent) -> SemanticEvent:
        return replace(ev, tool_index=ev.tool_index - self._refused) if self._refused else ev


class Ling3Parser(Glm47MoeParser):
    """vLLM's GLM-4.7 parser engine under the `ling3` name, behind the call gate above."""

    def __init__(self, tokenizer: TokenizerLike, tools: list[Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("parser_engine_config", ling3_config(thinking_enabled(kwargs.get("chat_template_kwargs"))))
        super().__init__(tokenizer, tools, **kwargs)
        self._engine = _CallGate(self.parser_engine_config, tokenizer, vocab=self.vocab, accept=self._accepts)

    def _accepts(self, name: str) -> bool:
        """A block is a call only if the request allows tool calls and offers a tool of that name."""
        if self._suppress_tool_calls or not self._tools:
            return False  # tool_choice='none' or no tools: the block is plain text
        if self._is_valid_tool_name(name):
            return True
        logger.warning(
            "ling3: the model called %r, which is not one of the request's tools %s; "
            "its <tool_call> block is returned as content",
            name,
            _tool_names(self._tools),
        )
        return False

    def _handle_tool_end(self, event: SemanticEvent, deltas: list) -> None:
        if 0 <= event.tool_index < len(self._tool_slots):
            slot = self._tool_slots[event.tool_index]
            if stray := _ARG_RE.sub("", slot.args).strip():
                logger.warning(
                    "ling3: ignored %r in the call to %r: arguments are "
                    "<arg_key>K</arg_key><arg_value>V</arg_value> pairs",
                    stray[:200],
                    slot.name.strip(),
                )
        super()._handle_tool_end(event, deltas)

    def _events_to_delta(self, events: list[SemanticEvent], finished: bool = False):
        """vLLM defers text that follows a call to the next delta; the last delta has no next one."""
        delta = super()._events_to_delta(events, finished)
        if not (finished and self._deferred_content):
            return delta
        tail = super()._events_to_delta([], finished=True)
        if delta is None or tail is None:
            return delta or tail
        delta.content = (delta.content or "") + (tail.content or "")
        return delta


class Ling3ReasoningParser(ParserEngineReasoningAdapter):
    """`--reasoning-parser ling3`."""

    _parser_engine_cls = Ling3Parser


class Ling3ToolParser(ParserEngineToolAdapter):
    """`--tool-call-parser ling3`."""

    _parser_engine_cls = Ling3Parser
    supports_required_and_named = False  # required/named tool_choice parse the XML too (no JSON mode)
    structural_tag_model = "glm_4_7"  # xgrammar's built-in grammar for this XML (strict tool calling)


# What vLLM's make_adapters() does: lets the serving layer find the adapters from the engine class.
Ling3Parser.reasoning_parser_cls = Ling3ReasoningParser
Ling3Parser.tool_parser_cls = Ling3ToolParser
