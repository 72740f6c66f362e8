"""`--reasoning-parser ling3` and `--tool-call-parser ling3`: vLLM's parser interfaces over our grammar.

Ling-3 writes GLM-4.7's format (docs/parsers.md §1-§2). The reading itself is `grammar.OutputParser`
(one linear pass, the same for any chunking, nothing dropped, calls checked against their schema). These
classes only fit it into vLLM's `DelegatingParser` (docs/parsers.md §4):

* Streaming: the tool parser reads the whole output, reasoning included, because only it sees the
  request (tools, tool_choice) while streaming. The reasoning parser, when a Ling-3 tool parser was
  built with it, hands every delta over at once; alone, it reads reasoning itself (no calls possible).
* Non-streaming: the reasoning parser is given the request, splits the output at the real end of
  reasoning and returns the rest verbatim; the tool parser reads that rest.
* Token-id questions (where reasoning ends, for structured outputs in the engine core) are answered
  by vLLM's GLM-4.7 engine, which matches the same `</think>` / `<tool_call>` tokens.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from vllm.parser.engine.adapters import ParserEngineReasoningAdapter
from vllm.parser.engine.parser_engine_config import ParserEngineConfig
from vllm.parser.glm47_moe import Glm47MoeParser, glm47_moe_config
from vllm.tool_parsers.abstract_tool_parser import ToolParser

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

# Private request flags with which an adjust_request tells vLLM that its grammar starts at the first
# generated token (reasoning included): vLLM >= 0.28, then 0.26. docs/parsers.md §5.
_FROM_FIRST_TOKEN_FLAGS = ("_grammar_from_parser", "_grammar_from_tool_parser")


def thinking_enabled(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """On unless the request sets `thinking` or `enable_thinking` and neither is true (docs/parsers.md §1)."""
    kwargs = chat_template_kwargs or {}
    thinking, enable_thinking = kwargs.get("thinking"), kwargs.get("enable_thinking")
    if thinking is None and enable_thinking is None:
        return True
    return bool(thinking) or bool(enable_thinking)


@functools.cache
def ling3_config(thinking: bool) -> ParserEngineConfig:
    """GLM-4.7's engine config under our name; cached, so its lexer is compiled once per process."""
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


class _TokenIdEngine(Glm47MoeParser):
    """vLLM's GLM-4.7 engine under our name: answers where reasoning ends in token ids."""

    def __init__(self, tokenizer: TokenizerLike, tools: list[Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("parser_engine_config", ling3_config(thinking_enabled(kwargs.get("chat_template_kwargs"))))
        super().__init__(tokenizer, tools, **kwargs)


class Ling3ReasoningParser(ParserEngineReasoningAdapter):
    """`--reasoning-parser ling3`."""

    _parser_engine_cls = _TokenIdEngine

    def __init__(self, tokenizer: TokenizerLike, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        self.thinking = thinking_enabled(kwargs.get("chat_template_kwargs"))
        self.used = False  # parsed something: too late to be paired
        self.tool_parser: weakref.ref[Ling3ToolParser] | None = None  # set by the paired tool parser
        self._stream: OutputParser | None = None  # reading alone (no Ling-3 tool parser)
        self._fed: list[str] = []
        self._handed_over = False
        self._ended = False
        pairing.offer(self)

    @property
    def _paired(self) -> bool:
        return self.tool_parser is not None and self.tool_parser() is not None

    def _parser(self, request: Any) -> OutputParser:
        """Calls are possible only with a Ling-3 tool parser to return them."""
        tools = callable_tools(getattr(request, "tools", None), getattr(request, "tool_choice", None))
        return OutputParser(Policy(self.thinking, tools if self._paired else {}), _dropped_tokens(self.model_tokenizer))

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        """The reasoning, and the output after it verbatim (from `</think>` or the call that ended it)."""
        self.used = True
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
        if self._paired:  # the tool parser reads everything: hand this delta and all later ones over
            self._handed_over = True
            return DeltaMessage(content=delta_text) if delta_text else None
        if self._stream is None:
            self._stream = OutputParser(Policy(self.thinking), _dropped_tokens(self.model_tokenizer))
        self._fed.append(delta_text)
        reasoning = _join(self._stream.feed(delta_text), Kind.REASONING) or None
        end = self._stream.reasoning_end
        if end is None or self._ended:
            return DeltaMessage(reasoning=reasoning) if reasoning else None
        self._ended = True  # vLLM passes every later delta through as content, verbatim
        tail, self._fed = "".join(self._fed)[end:] or None, []
        return DeltaMessage(reasoning=reasoning, content=tail) if reasoning or tail else None

    def has_engine_confirmed_reasoning_end(self) -> bool:
        return self._handed_over or self._ended

    def finish_streaming(self) -> DeltaMessage | None:
        if self._stream is None or self._handed_over or self._ended:
            return None
        reasoning = _join(self._stream.finish(), Kind.REASONING)
        return DeltaMessage(reasoning=reasoning) if reasoning else None

    def get_streaming_fallback_content(self, text: str, request: Any) -> str | None:
        return None  # unfinished reasoning stays reasoning, as in the non-streaming result

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the reasoning text, as our parse of `token_ids` splits it (usage statistics)."""
        if not token_ids:
            return 0
        tool_parser = self.tool_parser() if self.tool_parser is not None else None
        parser = self._parser(tool_parser.request if tool_parser is not None else None)
        text = self.model_tokenizer.decode(list(token_ids), skip_special_tokens=False)
        reasoning = _join(parser.feed(text) + parser.finish(), Kind.REASONING)
        return len(self.model_tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0


class Ling3ToolParser(ToolParser):
    """`--tool-call-parser ling3`."""

    engine_based_streaming = True  # vLLM hands it deltas, not the text so far
    supports_required_and_named = False  # required/named: parsed from the XML too (docs/parsers.md §5)
    structural_tag_model = "glm_4_7"  # the grammar of this XML (docs/parsers.md §5)
    skip_reasoning_parsing = False  # set by vLLM >= 0.28 when no reasoning parser is configured

    def __init__(self, tokenizer: TokenizerLike, tools: list[Any] | None = None, **kwargs: Any) -> None:
        super().__init__(tokenizer, tools)
        self._reasoning = pairing.claim(tokenizer)
        if self._reasoning is not None:
            self._reasoning.tool_parser = weakref.ref(self)
        self.request: Any = None  # the last request seen (streaming passes it with every delta)
        self._stream: OutputParser | None = None
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

    # ── Non-streaming: the text after reasoning (or the whole output without a reasoning parser) ──

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        self.request = request
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
        if self._stream is None:
            self._stream = self._parser(request, thinking=self._reads_reasoning)
        return self._delta(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        return self._delta(self._stream.finish()) if self._stream is not None else None

    def get_remaining_unstreamed_args(self) -> str:
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
    return next((flag for flag in _FROM_FIRST_TOKEN_FLAGS if flag in private), None)
