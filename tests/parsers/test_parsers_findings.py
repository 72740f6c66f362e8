"""Regressions for the crafted-output findings against `ling3` (operator issue, items 1-6).

Each `parse(...)` also streams the text in token steps and character by character and fails unless
every stream adds up to the non-streaming result (conftest.py). Item 7 (linear streaming) is in
test_parsers_linear.py, item 8 (tool_choice="required") in test_parsers_tool_choice.py.
"""

from __future__ import annotations

import pytest


def call(name: str, *pairs: tuple[str, str], close: bool = True) -> str:
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs)
    return f"<tool_call>{name}{body}" + ("</tool_call>" if close else "")


# 1. A repeated key: vLLM streamed `{"city": "A` but parsed the whole output as {"city": "B"}.


def test_a_repeated_argument_key_makes_the_call_content_in_both_modes(parse):
    block = call("get_weather", ("city", "A"), ("city", "B"))
    turn = parse(f"r</think>{block}")
    assert (turn.content, turn.calls) == (block, [])


def test_a_call_after_a_refused_one_keeps_index_zero(parse):
    bad, good = call("get_weather", ("city", "A"), ("city", "B")), call("get_weather", ("city", "C"))
    turn = parse(f"r</think>{bad}{good}")
    assert (turn.content, turn.calls) == (bad, [("get_weather", {"city": "C"})])


# 2. `</think>` inside an argument value was dropped when not streaming.


def test_think_close_inside_an_argument_value_is_kept_in_the_content(parse):
    block = "<tool_call>echo<arg_key>text</arg_key><arg_value>a</think>b</arg_value></tool_call>"
    turn = parse(f"r</think>{block}")
    assert (turn.reasoning, turn.content, turn.calls) == ("r", block, [])


def test_think_close_inside_a_value_of_a_call_in_reasoning_still_ends_the_reasoning(parse):
    turn = parse("plan <tool_call>echo<arg_key>text</arg_key><arg_value>a</think>b</arg_value></tool_call>")
    assert turn.reasoning == "plan <tool_call>echo<arg_key>text</arg_key><arg_value>a"
    assert (turn.content, turn.calls) == ("b</arg_value></tool_call>", [])


# 3. An unknown tool called inside reasoning ended the reasoning early and dropped `</think>`.


def test_an_unknown_tool_call_inside_reasoning_stays_reasoning_until_think_close(parse):
    bogus = call("get_wether", ("city", "Paris"))
    turn = parse(f"Plan: {bogus} no, the tool is get_weather.</think>Answer.")
    assert turn.reasoning == f"Plan: {bogus} no, the tool is get_weather."
    assert (turn.content, turn.calls) == ("Answer.", [])


def test_a_known_tool_call_inside_reasoning_ends_it_and_later_think_close_is_content(parse):
    turn = parse(f"Plan.{call('get_weather', ('city', 'Paris'))} more</think>tail")
    assert (turn.reasoning, turn.content) == ("Plan.", " more</think>tail")
    assert turn.calls == [("get_weather", {"city": "Paris"})]


def test_a_call_inside_reasoning_stays_reasoning_when_tool_choice_is_none(parse):
    block = call("get_weather", ("city", "Paris"))
    turn = parse(f"Plan {block}.</think>Answer.", tool_choice="none")
    assert (turn.reasoning, turn.content, turn.calls) == (f"Plan {block}.", "Answer.", [])


# 4. Text after a nested `<arg_value>` close was lost; so was a truncated `<arg_key>ci` at the end.


def test_text_after_a_nested_arg_value_close_is_kept(parse):
    block = "<tool_call>echo<arg_key>x</arg_key><arg_value>a<arg_value>b</arg_value>c</arg_value></tool_call>"
    turn = parse(f"r</think>{block} after")
    assert (turn.content, turn.calls) == (f"{block} after", [])


def test_a_call_cut_inside_an_arg_key_is_returned_as_content(parse):
    cut = call("get_weather", ("city", "Paris"), close=False) + "<arg_key>ci"
    turn = parse(f"r</think>Let me check. {cut}")
    assert (turn.content, turn.calls) == (f"Let me check. {cut}", [])


# 5. `</think>` was removed from the content when thinking is off.


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"thinking": False}])
def test_think_close_is_content_when_thinking_is_off(parse, kwargs):
    turn = parse("No thinking here</think> but a stray tag.", chat_template_kwargs=kwargs)
    assert (turn.reasoning, turn.content) == (None, "No thinking here</think> but a stray tag.")


def test_think_tags_before_a_call_are_content_when_thinking_is_off(parse):
    turn = parse(f"<think>x</think>{call('get_weather', ('city', 'Paris'))}", chat_template_kwargs={"thinking": False})
    assert (turn.reasoning, turn.content) == (None, "<think>x</think>")
    assert turn.calls == [("get_weather", {"city": "Paris"})]


def test_a_second_think_close_after_reasoning_is_content(parse):
    turn = parse("r</think>a</think>b")
    assert (turn.reasoning, turn.content) == ("r", "a</think>b")


# 6. Values that violate the tool's JSON schema came back as a valid call.


@pytest.mark.parametrize(
    "block",
    [
        call("get_weather", ("city", "Paris"), ("days", "three")),
        call("get_weather", ("city", "Paris"), ("country", "FR")),
        call("book", ("nights", "2")),
        call("book", ("hotel", "Ritz"), ("nights", "0")),
        call("get_weather", ("units", "celsius")),
        call("now", ("tz", "UTC")),
        call("get_weather", ("", "Paris")),
    ],
    ids=[
        "string-for-an-integer",
        "undeclared-key",
        "missing-required-key",
        "below-the-minimum",
        "text-for-an-object",
        "argument-to-a-tool-without-parameters",
        "empty-key",
    ],
)
def test_a_call_that_violates_its_tool_schema_is_returned_as_content(parse, block):
    turn = parse(f"r</think>Calling. {block}")
    assert (turn.content, turn.calls) == (f"Calling. {block}", [])


def test_a_call_that_fits_its_schema_is_a_call(parse):
    turn = parse(f"r</think>{call('book', ('hotel', ' Ritz '), ('nights', ' 2 '))}")
    assert turn.calls == [("book", {"hotel": " Ritz ", "nights": 2})]
