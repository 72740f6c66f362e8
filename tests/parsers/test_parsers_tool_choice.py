"""tool_choice="required" and a named tool with `ling3` (operator issue, item 8; docs/parsers.md §5).

With thinking on, vLLM applies the call grammar only after reasoning ends, so a model that stops (or
runs out of tokens) while reasoning returned HTTP 200 with no call. Our tool parser gives the grammar of
the whole output instead and has vLLM apply it from the first token. These tests build the request as
vLLM's server does (DelegatingParser.adjust_request) and run the grammar with xgrammar on CPU.
"""

from __future__ import annotations

import json

import pytest
from parsers_harness import PROMPT_THINKING, Ling3, make_request

xgr = pytest.importorskip("xgrammar")

REASONING = "The user wants the weather in Paris; I will call the tool."
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def adjusted(tokenizer, **request_kwargs):
    request = make_request(**request_kwargs)
    parser = Ling3(tokenizer, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})
    return parser, parser.adjust_request(request)


def matcher(tokenizer, request):
    tag = request.structured_outputs.structural_tag
    assert tag, "tool_choice that requires a call must come with a structural tag"
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(json.loads(tag)))


def accepts(tokenizer, request, text: str, then_eos: bool = False) -> bool:
    m = matcher(tokenizer, request)
    ok = m.accept_string(text)
    return ok and (m.accept_token(tokenizer.eos_token_id) if then_eos else True)


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_required_call_with_thinking_on_is_grammar_from_the_first_token_through_reasoning(
    special_tokenizer, tool_choice
):
    parser, request = adjusted(special_tokenizer, tool_choice=tool_choice)
    prompt = special_tokenizer.encode(PROMPT_THINKING, add_special_tokens=False)
    assert request.resolve_reasoning_ended(parser, prompt) is True  # what the server passes to the engine
    assert accepts(special_tokenizer, request, REASONING), "the model may reason first"
    assert not accepts(special_tokenizer, request, REASONING, then_eos=True), "it may not stop while reasoning"
    assert not accepts(special_tokenizer, request, REASONING + "</think>", then_eos=True), "nor before a call"
    assert accepts(special_tokenizer, request, REASONING + "</think>" + CALL, then_eos=True)


def test_a_named_tool_choice_grammar_admits_only_that_tool(special_tokenizer):
    _, request = adjusted(special_tokenizer, tool_choice=NAMED)
    assert not accepts(special_tokenizer, request, REASONING + "</think><tool_call>now</tool_call>")


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_required_call_with_thinking_off_keeps_vllms_grammar_of_the_answer(special_tokenizer, tool_choice):
    parser, request = adjusted(special_tokenizer, tool_choice=tool_choice, chat_template_kwargs={"thinking": False})
    assert not accepts(special_tokenizer, request, "</think>"), "no reasoning block in the grammar"
    assert accepts(special_tokenizer, request, CALL, then_eos=True)
    assert not getattr(request, "_grammar_from_parser", False)


def test_auto_tool_choice_leaves_the_grammar_to_vllm(special_tokenizer):
    _, request = adjusted(special_tokenizer, tool_choice="auto")
    assert request.structured_outputs is None or not request.structured_outputs.structural_tag
    assert not getattr(request, "_grammar_from_parser", False)


def test_adjust_request_keeps_special_tokens_in_the_text(special_tokenizer):
    _, request = adjusted(special_tokenizer, tool_choice="required")
    assert request.skip_special_tokens is False


# What the parser returns under these tool_choices (the grammar makes the first case the only one).


def test_a_named_tool_choice_turns_a_call_to_another_tool_into_content(parse):
    other = "<tool_call>now</tool_call>"
    turn = parse(f"r</think>{other}{CALL}", tool_choice=NAMED)
    assert (turn.content, turn.calls) == (other, [("get_weather", {"city": "Paris"})])


def test_a_required_call_is_parsed_like_an_automatic_one(parse):
    turn = parse(f"{REASONING}</think>{CALL}", tool_choice="required")
    assert (turn.reasoning, turn.calls) == (REASONING, [("get_weather", {"city": "Paris"})])


def test_an_output_cut_off_while_reasoning_keeps_its_reasoning_under_required(parse):
    """Only max_tokens can still end the turn without a call; the text is returned, not dropped."""
    turn = parse(REASONING, tool_choice="required")
    assert (turn.reasoning, turn.content, turn.calls) == (REASONING, None, [])
