"""Behaviour of our `ling3` parsers (docs/parsers.md) on crafted model output.

Every `parse(...)` call runs the text both non-streaming and streamed step by step, and fails if the
concatenated deltas differ from the non-streaming result (see conftest.py and parsers_harness.py)."""

from __future__ import annotations

import logging

import pytest

from vllm_ling.parsers.ling3 import Ling3ReasoningParser, thinking_enabled

CALL_WEATHER = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


@pytest.mark.parametrize("opening", ["", "<think>"], ids=["prompt-opens-think", "model-repeats-think"])
def test_thinking_is_on_by_default_and_ends_at_close_tag(parse, opening):
    turn = parse(f"{opening}The user greets me.</think>Hello! How can I help?")
    assert (turn.reasoning, turn.content, turn.calls) == ("The user greets me.", "Hello! How can I help?", [])


@pytest.mark.parametrize("kwargs", [{"thinking": False}, {"enable_thinking": False}])
def test_thinking_off_via_chat_template_kwargs_makes_everything_content(parse, kwargs):
    turn = parse("No reasoning here, just the answer.", chat_template_kwargs=kwargs)
    assert (turn.reasoning, turn.content, turn.calls) == (None, "No reasoning here, just the answer.", [])


@pytest.mark.parametrize(
    "kwargs", [{"thinking": True}, {"enable_thinking": True}, {"thinking": False, "enable_thinking": True}]
)
def test_thinking_stays_on_when_any_flag_is_true(parse, kwargs):
    turn = parse("Plan.</think>Answer.", chat_template_kwargs=kwargs)
    assert (turn.reasoning, turn.content) == ("Plan.", "Answer.")


def test_thinking_switch_rule():
    assert thinking_enabled(None) and thinking_enabled({}) and thinking_enabled({"other": 1})
    assert not thinking_enabled({"thinking": False})
    assert not thinking_enabled({"enable_thinking": False})
    assert thinking_enabled({"thinking": False, "enable_thinking": True})


def test_tool_call_with_thinking_off(parse):
    turn = parse(f"Let me check.{CALL_WEATHER}", chat_template_kwargs={"enable_thinking": False})
    assert (turn.reasoning, turn.content) == (None, "Let me check.")
    assert turn.calls == [("get_weather", {"city": "Paris"})]


def test_tool_call_ends_reasoning_without_close_tag(parse):
    turn = parse(f"I need the forecast.{CALL_WEATHER}")
    assert (turn.reasoning, turn.content) == ("I need the forecast.", None)
    assert turn.calls == [("get_weather", {"city": "Paris"})]


def test_tool_call_after_reasoning_and_content(parse):
    turn = parse(f"Need weather.</think>Checking Paris.\n{CALL_WEATHER}")
    assert (turn.reasoning, turn.content) == ("Need weather.", "Checking Paris.\n")  # verbatim
    assert turn.calls == [("get_weather", {"city": "Paris"})]


def test_arguments_are_coerced_to_the_schema_types(parse):
    args = {
        "city": "Paris",
        "days": "3",
        "threshold": "0.5",
        "hourly": "true",
        "units": '{"temp": "C"}',
        "fields": '["rain", "wind"]',
        "note": "null",
    }
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>" for k, v in args.items())
    turn = parse(f"ok</think><tool_call>get_weather\n{body}</tool_call>")
    assert turn.calls == [
        (
            "get_weather",
            {
                "city": "Paris",
                "days": 3,
                "threshold": 0.5,
                "hourly": True,
                "units": {"temp": "C"},
                "fields": ["rain", "wind"],
                "note": None,
            },
        )
    ]


def test_arguments_stay_strings_without_a_schema(parse):
    turn = parse(
        "ok</think><tool_call>echo<arg_key>n</arg_key><arg_value>3</arg_value><arg_key>b</arg_key> <arg_value>true</arg_value></tool_call>"
    )
    assert turn.calls == [("echo", {"n": "3", "b": "true"})]


def test_string_argument_keeps_its_text_verbatim(parse):
    turn = parse(
        'ok</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>  "São Paulo"\n(BR) </arg_value></tool_call>'
    )
    assert turn.calls == [("get_weather", {"city": '  "São Paulo"\n(BR) '})]


def test_zero_argument_call(parse):
    turn = parse("What time is it?</think><tool_call>now</tool_call>")
    assert turn.calls == [("now", {})]


def test_several_calls_in_one_turn_keep_their_order(parse):
    turn = parse(
        "Two cities.</think>"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>\n"
        "<tool_call>now</tool_call>\n"
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Berlin</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    )
    assert turn.content is None
    assert turn.calls == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
        ("get_weather", {"city": "Berlin", "days": 2}),
    ]


def test_text_between_and_after_calls_is_kept(parse):
    # vLLM's own GLM/ling3 engine drops "B" and "C" when not streaming.
    turn = parse("r</think>A<tool_call>now</tool_call>B<tool_call>now</tool_call>C")
    assert turn.content == "ABC"
    assert turn.calls == [("now", {}), ("now", {})]


def test_unknown_tool_stays_in_content_and_is_logged(parse, caplog):
    bogus = "<tool_call>get_wether<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
    with caplog.at_level(logging.WARNING, logger="vllm_ling.parsers"):
        turn = parse(f"Checking.</think>Let me see.{bogus} Done.")
    assert turn.calls == []
    assert turn.content == f"Let me see.{bogus} Done."
    assert "'get_wether'" in caplog.text and "get_weather" in caplog.text


def test_unknown_tool_does_not_shift_the_next_calls_index(parse):
    turn = parse(f"r</think><tool_call>nope</tool_call>{CALL_WEATHER}")
    assert turn.calls == [("get_weather", {"city": "Paris"})]  # streamed as index 0 (conftest checks density)
    assert turn.content == "<tool_call>nope</tool_call>"


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>get_weather for Paris please</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
        "<tool_call></tool_call>",
    ],
    ids=["prose-name", "json-body", "empty"],
)
def test_garbage_call_stays_in_content(parse, block):
    turn = parse(f"r</think>Before {block} after")
    assert (turn.content, turn.calls) == (f"Before {block} after", [])


def test_stray_text_between_arguments_makes_the_block_content_and_is_logged(parse, caplog):
    block = (
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>oops"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
    )
    with caplog.at_level(logging.WARNING, logger="vllm_ling.parsers"):
        turn = parse(f"r</think>{block}")
    assert (turn.content, turn.calls) == (block, [])
    assert "'oops'" in caplog.text


def test_unclosed_call_cut_inside_the_name_stays_in_content(parse):
    turn = parse("r</think>Let me call <tool_call>get_wea")
    assert (turn.content, turn.calls) == ("Let me call <tool_call>get_wea", [])


@pytest.mark.parametrize(
    "cut",
    [
        "<tool_call>get_weather<arg_key>days</arg_key><arg_value>4</arg_value><arg_key>city</arg_key><arg_value>Par",
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>",
    ],
    ids=["inside-a-value", "after-complete-arguments"],
)
def test_a_call_cut_off_before_its_close_tag_is_returned_as_content(parse, caplog, cut):
    """A call is a whole <tool_call>...</tool_call> block; one cut off (max_tokens) is not executed."""
    with caplog.at_level(logging.WARNING, logger="vllm_ling.parsers"):
        turn = parse(f"r</think>{cut}")
    assert (turn.content, turn.calls) == (cut, [])
    assert "ended inside a tool call" in caplog.text


def test_calls_stay_in_content_when_the_request_allows_none(parse):
    """With tools and tool_choice "none". Without tools vLLM's parser answers (test_parsers_vllm_contract.py)."""
    turn = parse(f"r</think>Sure.{CALL_WEATHER}", tool_choice="none")
    assert (turn.content, turn.calls) == (f"Sure.{CALL_WEATHER}", [])


def test_reasoning_end_is_found_in_token_ids(special_tokenizer):
    """Structured outputs in the engine core start constraining only after reasoning ends."""

    def ids(text: str) -> list[int]:
        return special_tokenizer.encode(text, add_special_tokens=False)

    on = Ling3ReasoningParser(special_tokenizer, chat_template_kwargs={})
    assert not on.is_reasoning_end(ids("prompt<think>still thinking"))
    assert on.is_reasoning_end(ids("prompt<think>done</think>answer"))
    off = Ling3ReasoningParser(special_tokenizer, chat_template_kwargs={"thinking": False})
    assert off.is_reasoning_end(ids("prompt"))
