"""How our two parsers share one request (docs/parsers.md §4), and how each behaves alone."""

from __future__ import annotations

import pytest
from vllm.parser.abstract_parser import DelegatingParser
from parsers_harness import (
    TOOLS,
    Ling3,
    Ling3ReasoningOnly,
    Ling3ToolsOnly,
    VllmLing3ReasoningParser,
    client_view,
    make_request,
    make_tokenizer,
    parse_full,
    parse_text_chunks,
)

from vllm_ling.parsers.ling3 import Ling3ReasoningParser, Ling3ToolParser

CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


def both_ways(tokenizer, cls, text, **request_kwargs):
    full = parse_full(tokenizer, text, make_request(**request_kwargs), cls)
    streamed = parse_text_chunks(tokenizer, list(text), make_request(**request_kwargs), cls)
    assert client_view(streamed) == client_view(full)
    return full


def test_the_tool_parser_built_after_a_reasoning_parser_is_its_partner(special_tokenizer):
    parser = Ling3(special_tokenizer, make_request().tools)
    assert parser.tool_parser._reasoning is parser.reasoning_parser
    assert parser.reasoning_parser.tool_parser() is parser.tool_parser


def test_a_reasoning_parser_is_not_claimed_once_used_or_with_another_tokenizer(special_tokenizer):
    Ling3ReasoningParser(special_tokenizer).extract_reasoning("x</think>y", make_request())
    assert Ling3ToolParser(special_tokenizer)._reasoning is None
    Ling3ReasoningParser(special_tokenizer)
    assert Ling3ToolParser(make_tokenizer(arg_tags_special=True))._reasoning is None


class VllmReasoningOnly(DelegatingParser):
    reasoning_parser_cls = VllmLing3ReasoningParser


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_a_reasoning_parser_alone_is_vllms(special_tokenizer, tools):
    """Alone it never sees the request's tools while streaming, so it is vLLM's ling3 reasoning parser."""
    text = f"Plan {CALL} more.</think>Answer {CALL}"
    for parse in (parse_full, lambda tok, t, req, cls: parse_text_chunks(tok, list(t), req, cls)):
        turn = parse(special_tokenizer, text, make_request(tools=tools), Ling3ReasoningOnly)
        assert turn == parse(special_tokenizer, text, make_request(tools=tools), VllmReasoningOnly)
        assert turn.reasoning == "Plan" and turn.calls == []


def test_a_tool_parser_alone_reads_reasoning_markup_as_content(special_tokenizer):
    turn = both_ways(special_tokenizer, Ling3ToolsOnly, f"Plan.</think>Answer.{CALL}")
    assert (turn.reasoning, turn.content) == (None, "Plan.</think>Answer.")
    assert turn.calls == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text, expected",
    [("Four words of reasoning.</think>Answer.", "Four words of reasoning."), ("No end to it", "No end to it")],
)
def test_usage_counts_the_tokens_of_the_reasoning(special_tokenizer, text, expected):
    parser = Ling3(special_tokenizer, make_request().tools)
    ids = special_tokenizer.encode(text, add_special_tokens=False)
    assert parser.count_reasoning_tokens(ids) == len(special_tokenizer.encode(expected, add_special_tokens=False))
