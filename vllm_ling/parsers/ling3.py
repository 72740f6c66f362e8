"""`--reasoning-parser ling3` and `--tool-call-parser ling3`: vLLM's own ling3 parsers, with our grammar on top.

Ling-3 writes GLM-4.7's format (docs/parsers.md §1-§2). vLLM's ling3 parsers (`vllm.parser.ling3`) stay the
contract: a request that declares no tools, a reasoning parser without our tool parser, and every token-id
question are answered by vLLM's own classes, unchanged. Our grammar (`grammar.OutputParser`: one linear pass,
the same for any chunking, nothing dropped, calls checked against their schema) reads a request only where
both our parsers serve it and it declares tools (docs/parsers.md §4):

* Streaming: the tool parser reads the whole output, reasoning included, because only it sees the
  request (tools, tool_choice) while streaming; the paired reasoning parser hands every delta over.
* Non-streaming: the reasoning parser is given the request, splits the output at the real end of
  reasoning and returns the rest verbatim; the tool parser reads that rest.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.parser.engine.parser_engine_config import ParserEngineConfig
from vllm.parser.glm47_moe import glm47_moe_config
from vllm.parser.ling3 import Ling3Parser, Ling3ParserReasoningAdapter
from vllm.tool_parsers.abstract_tool_parser import ToolParser
from vllm.tool_parsers.ling3_tool_parser import Ling3ToolParser as VllmLing3ToolParser

from vllm_ling import compat
from vllm_ling.compat import make_tool_call_id
from vllm_ling.parsers import pairing
from vllm_ling.parsers.grammar import Kind, OutputParser, Piece, Policy
from vllm_ling.parsers.schema import call_required, callable_tools

if TYPE_CHECKING:
    from vllm.tokenizers import TokenizerLike

_protocol = compat.openai_protocol()
DeltaFunctionCall, DeltaMessage, DeltaToolCall = _protocol.DeltaFunctionCall, _protocol.DeltaMessage, _protocol.DeltaToolCall
ExtractedToolCallInformation, FunctionCall, ToolCall = (
    _protocol.ExtractedToolCallInformation, _protocol.FunctionCall, _protocol.ToolCall)

NAME = "ling3"

# The private request flag with which an adjust_request tells vLLM (0.32-0.34) that its grammar starts at
# the first generated token, reasoning included. docs/parsers.md §5.
_FROM_FIRST_TOKEN_FLAG = "_grammar_from_parser"


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """On unless the request sets `thinking` or `enable_thinking` and neither is true (docs/parsers.md §1)."""
    kwargs = chat_template_kwargs or {}
    thinking, enable_thinking = kwargs.get("thinking"), kwargs.get("enable_thinking")
    if thinking is None and enable_thinking is None:
        return True
    return bool(thinking) or bool(enable_thinking)


def declares_tools(request: Any) -> bool:
    """Whether the request offers tools. Where it offers none, vLLM's own ling3 parsers answer (docs/parsers.md §4)."""
    return bool(getattr(request, "tools", None))


@functools.cache
def ling3_config(thinking: bool) -> ParserEngineConfig:
    """vLLM's ling3 engine config (GLM-4.7's under the name ling3), cached: its lexer is compiled once per process."""
    return replace(glm47_moe_config(thinking=thinking), name=NAME)


def _dropped_tokens(tokenizer: Any) -> frozenset[str]:
    """The tokenizer's special tokens: OutputParser drops those that are not Ling-3 markup, as the
    detokenizer would have (docs/parsers.md §3)."""
    try:
        return frozenset(tokenizer.all_special_tokens)
    except (AttributeError, NotImplementedError):
        return frozenset()


def _join(pieces: Sequence[Piece], kind: Kind) -> str:
    return "".join(p.raw for p in pieces if p.kind is kind)


class _Engine(Ling3Parser):
    """vLLM's ling3 engine with the cached config: answers token-id questions and backs vLLM's own parsers."""

    def __init__(self, tokenizer: TokenizerLike, tools: list[Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("parser_engine_config", ling3_config(thinking_enabled(kwargs.get("chat_template_kwargs"))))
        super().__init__(tokenizer, tools, **kwargs)


class _VllmToolParser(VllmLing3ToolParser):
    """vLLM's ling3 tool parser over the cached config: answers requests that declare no tools."""

    _parser_engine_cls = _Engine


class Ling3ReasoningParser(Ling3ParserReasoningAdapter):
    """`--reasoning-parser ling3`: vLLM's, except where our paired tool parser serves a request with tools."""

    _parser_engine_cls = _Engine

    def __init__(self, tokenizer: TokenizerLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.thinking = thinking_enabled(kwargs.get("chat_template_kwargs"))
        self.used = False  # parsed something: too late to be paired
        self.tool_parser: weakref.ref[Ling3ToolParser] | None = None  # set by the paired tool parser
        self._handed_over = False
        pairing.offer(self)

    def _partner(self) -> Ling3ToolParser | None:
        return self.tool_parser() if self.tool_parser is not None else None

    def _ours(self, request: Any) -> bool:
        """Our grammar reads the output only if our tool parser was built with us and the request has tools."""
        return self._partner() is not None and declares_tools(request)

    @property
    def _ours_streaming(self) -> bool:
        """While streaming the request is not passed here: the tools the paired tool parser was built with."""
        partner = self._partner()
        return partner is not None and partner.declared_tools

    def _parser(self, request: Any) -> OutputParser:
        tools = callable_tools(getattr(request, "tools", None), getattr(request, "tool_choice", None))
        return OutputParser(Policy(self.thinking, tools), _dropped_tokens(self.model_tokenizer))

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """The reasoning, and the output after it verbatim (from `</think>` or the call that ended it)."""
        self.used = True
        if not self._ours(request):
            return super().extract_reasoning(model_output, request)
        parser = self._parser(request)
        pieces = parser.feed(model_output) + parser.finish()
        end = parser.reasoning_end
        return _join(pieces, Kind.REASONING) or None, (model_output[end:] or None) if end is not None else None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        self.used = True
        if not self._ours_streaming:
            return super().extract_reasoning_streaming(
                previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids
            )
        self._handed_over = True  # the tool parser reads everything: hand this delta and all later ones over
        return DeltaMessage(content=delta_text) if delta_text else None

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._handed_over or super().has_engine_confirmed_reasoning_end()

    def finish_streaming(self) -> DeltaMessage | None:
        return None if self._handed_over else super().finish_streaming()

    def get_streaming_fallback_content(self, text: str, request: Any) -> str | None:
        if self._handed_over:
            return None  # unfinished reasoning stays reasoning, as in the non-streaming result
        return super().get_streaming_fallback_content(text, request)

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the reasoning text, as the parse that served the request splits it (usage statistics)."""
        partner = self._partner()
        if not (self._handed_over or self._ours_streaming) or partner is None:
            return super().count_reasoning_tokens(token_ids)
        if not token_ids:
            return 0
        parser = self._parser(partner.request)
        text = self.model_tokenizer.decode(list(token_ids), skip_special_tokens=False)
        reasoning = _join(parser.feed(text) + parser.finish(), Kind.REASONING)
        return len(self.model_tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


class Ling3ToolParser(ToolParser):
    """`--tool-call-parser ling3`: our grammar for a request that declares tools, vLLM's parser for one without."""

    engine_based_streaming = True  # vLLM hands it deltas, not the text so far
    supports_required_and_named = False  # required/named: parsed from the XML too (docs/parsers.md §5)
    structural_tag_model = "glm_4_7"  # the grammar of this XML (docs/parsers.md §5)
    skip_reasoning_parsing = False  # set by vLLM when no reasoning parser is configured

    def __init__(self, tokenizer: TokenizerLike, tools: list[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(tokenizer, tools)
        self.declared_tools = bool(tools)  # vLLM builds the parser with the request's tools
        self._reasoning = pairing.claim(tokenizer)
        if self._reasoning is not None:
            self._reasoning.tool_parser = weakref.ref(self)
        self.request: Any = None  # the last request seen (streaming passes it with every delta)
        self._stream: OutputParser | None = None
        self._vllm: VllmLing3ToolParser | None = None  # serves a request without tools
        self._calls = 0  # calls streamed so far: the next call's index
        self._grammar_covers_reasoning = False

    @property
    def _reads_reasoning(self) -> bool:
        """Streaming starts in reasoning if thinking is on and a Ling-3 reasoning parser was built with
        us; without one, reasoning markup is content to the client (vLLM's rule for a lone tool parser)."""
        return self._reasoning is not None and self._reasoning.thinking

    def _parser(self, request: Any, thinking: bool) -> OutputParser:
        tools = callable_tools(getattr(request, "tools", None) or self.tools, getattr(request, "tool_choice", None))
        return OutputParser(Policy(thinking, tools), _dropped_tokens(self.model_tokenizer))

    def _vllm_parser(self, request: Any) -> VllmLing3ToolParser:
        """vLLM's ling3 tool parser for this request, built once, with the thinking switch vLLM would pass it."""
        if self._vllm is None:
            thinking = (self._reasoning.thinking if self._reasoning is not None
                        else thinking_enabled(getattr(request, "chat_template_kwargs", None)))
            self._vllm = _VllmToolParser(self.model_tokenizer, None, chat_template_kwargs={"enable_thinking": thinking})
            self._vllm.skip_reasoning_parsing = self.skip_reasoning_parsing
        return self._vllm

    # ── Non-streaming: the text after reasoning (or the whole output without a reasoning parser) ──

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        self.request = request
        if not declares_tools(request):
            return self._vllm_parser(request).extract_tool_calls(model_output, request)
        parser = self._parser(request, thinking=False)
        pieces = parser.feed(model_output) + parser.finish()
        calls = [
            ToolCall(id=make_tool_call_id(), function=FunctionCall(name=p.name, arguments=p.arguments))
            for p in pieces
            if p.kind is Kind.CALL
        ]
        return ExtractedToolCallInformation(
            tools_called=bool(calls), tool_calls=calls, content=_join(pieces, Kind.CONTENT) or None
        )

    # ── Streaming: every delta of the output (reasoning included when paired) ──

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        self.request = request
        if self._stream is None and (self._vllm is not None or not declares_tools(request)):
            return self._vllm_parser(request).extract_tool_calls_streaming(
                previous_text, current_text, delta_text, previous_token_ids, current_token_ids, delta_token_ids, request
            )
        if self._stream is None:
            self._stream = self._parser(request, thinking=self._reads_reasoning)
        return self._delta(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        if self._vllm is not None:
            return self._vllm.finish_streaming()
        return self._delta(self._stream.finish()) if self._stream is not None else None

    def get_remaining_unstreamed_args(self) -> str:
        if self._vllm is not None:
            return self._vllm.get_remaining_unstreamed_args()
        return ""  # a call is streamed whole, once it is known to be valid

    def _delta(self, pieces: list[Piece]) -> DeltaMessage | None:
        calls = []
        for p in pieces:
            if p.kind is Kind.CALL:
                calls.append(
                    DeltaToolCall(
                        index=self._calls,
                        id=make_tool_call_id(),
                        type="function",
                        function=DeltaFunctionCall(name=p.name, arguments=p.arguments),
                    )
                )
                self._calls += 1
        reasoning, content = _join(pieces, Kind.REASONING) or None, _join(pieces, Kind.CONTENT) or None
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(reasoning=reasoning, content=content, tool_calls=calls)

    # ── Requests: the grammar when a call is required and thinking is on (docs/parsers.md §5) ──

    def adjust_request(self, request: Any) -> Any:
        request.skip_special_tokens = False  # the markup is special tokens: keep them in the text
        if self._grammar_covers_reasoning:
            setattr(request, _from_first_token_flag(request), True)
        return request

    def get_structural_tag(self, request: Any, *, reasoning: bool = False, **kwargs: Any) -> Any:
        """vLLM asks for the grammar of the part after reasoning. When a call must come and thinking is
        on, we give the grammar of the whole output instead (the reasoning, `</think>`, then at least one
        call), and adjust_request has vLLM apply it from the first token: the model cannot end its turn
        before a valid call. Where this vLLM has no flag for that, vLLM's own behaviour stays."""
        covers = (
            not reasoning
            and bool(getattr(request, "tools", None))
            and call_required(getattr(request, "tool_choice", None))
            and self._thinking_for_grammar(request)
            and _from_first_token_flag(request) is not None
        )
        tag = super().get_structural_tag(request, reasoning=reasoning or covers, **kwargs)
        self._grammar_covers_reasoning = covers and tag is not None
        return tag

    def _thinking_for_grammar(self, request: Any) -> bool:
        if self._reasoning is not None:
            return self._reasoning.thinking
        return thinking_enabled(getattr(request, "chat_template_kwargs", None))


def _from_first_token_flag(request: Any) -> str | None:
    private = getattr(type(request), "__private_attributes__", None) or {}
    return _FROM_FIRST_TOKEN_FLAG if _FROM_FIRST_TOKEN_FLAG in private else None
