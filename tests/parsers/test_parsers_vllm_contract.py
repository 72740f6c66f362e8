# SPDX-License-Identifier: Apache-2.0
# The cases marked "vLLM:" are ported from vLLM 0.34.0's own ling3 parser tests (sdist
# `tests/parser/engine/test_ling3.py`, and the GLM-4.7 engine cases of `tests/parser/engine/test_glm47_moe.py`
# that the ling3 parser inherits), Copyright contributors to the vLLM project, Apache License 2.0.
"""vLLM's ling3 parser contract, run against our parsers and against vLLM's own, case by case.

Each case runs twice, `impl="ours"` (vllm_ling.parsers.ling3) and `impl="vllm"` (the installed vLLM's
`vllm.parser.ling3` classes). vLLM's tests build a `MockTokenizer`; here the harness' byte-level BPE with
the eight tags as special tokens stands in, and requests are built by `make_request`. Where the request
declares no tools, ours must give vLLM's result exactly. Where it declares tools, ours adds the schema
check and keeps refused text as content; each such case says what differs and why (docs/parsers.md §8).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from parsers_harness import (
    TOOLS,
    Ling3,
    Turn,
    VllmLing3,
    VllmLing3ReasoningParser,
    VllmLing3ToolParser,
    drive_stream,
    make_request,
    parse_full,
)
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

from vllm_ling.parsers.ling3 import Ling3ReasoningParser, Ling3ToolParser

IMPLS = {
    "ours": (Ling3ReasoningParser, Ling3ToolParser, Ling3),
    "vllm": (VllmLing3ReasoningParser, VllmLing3ToolParser, VllmLing3),
}


@pytest.fixture(params=sorted(IMPLS))
def impl(request) -> str:
    return request.param


def reasoning_parser(impl: str, tokenizer, **kwargs):
    return IMPLS[impl][0](tokenizer, **kwargs)


def tool_parser(impl: str, tokenizer, tools=None):
    return IMPLS[impl][1](tokenizer, tools)


# ── vLLM: tests/parser/engine/test_ling3.py ──


def test_ling3_registered():
    """vLLM: `test_ling3_registered`. Our plugin replaces the entries under the same name."""
    assert "ling3" in ReasoningParserManager.list_registered()
    assert "ling3" in ToolParserManager.list_registered()


def test_ling3_defaults_thinking_on(impl, special_tokenizer):
    """vLLM: `test_ling3_defaults_thinking_on`."""
    parser = reasoning_parser(impl, special_tokenizer)
    assert (parser.reasoning_start_str, parser.reasoning_end_str) == ("<think>", "</think>")
    assert parser.extract_reasoning("<think>reason</think>answer", make_request(tools=None)) == ("reason", "answer")


def test_ling3_disable_thinking_keeps_reasoning_as_content(impl, special_tokenizer):
    """vLLM: `test_ling3_disable_thinking_keeps_reasoning_as_content`."""
    parser = reasoning_parser(impl, special_tokenizer, chat_template_kwargs={"enable_thinking": False})
    output = "<think>reason</think>answer"
    assert parser.extract_reasoning(output, make_request(tools=None)) == (None, output)


@pytest.mark.parametrize("model_output", ["only reasoning", "<think>only reasoning"])
def test_ling3_truncated_reasoning_stays_reasoning(impl, special_tokenizer, model_output):
    """vLLM: `test_ling3_truncated_reasoning_stays_reasoning`."""
    parser = reasoning_parser(impl, special_tokenizer, chat_template_kwargs={"enable_thinking": True})
    assert parser.extract_reasoning(model_output, make_request(tools=None)) == ("only reasoning", None)


@pytest.mark.parametrize(
    "output, name, arguments",
    [
        (
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>",
            "get_weather",
            {"city": "Beijing"},
        ),
        ("<tool_call>ping</tool_call>", "ping", {}),
    ],
    ids=["test_ling3_tool_call_without_newline", "test_ling3_tool_call_without_args"],
)
def test_ling3_tool_call_in_a_request_without_tools(impl, special_tokenizer, output, name, arguments):
    """vLLM: `test_ling3_tool_call_without_newline`, `test_ling3_tool_call_without_args`. No tools
    declared: the call comes back, whatever its name, and nothing is checked."""
    result = tool_parser(impl, special_tokenizer).extract_tool_calls(output, request=make_request(tools=None))
    assert result.tools_called and result.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls] == [(name, arguments)]


# ── vLLM: tests/parser/engine/test_glm47_moe.py (the engine ling3 is built on) ──


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "prompt, ended",
    [("<think>x", False), ("<think>x</think>y", True), ("<think>x<tool_call>y", True), ("", False)],
    ids=["test_open_reasoning", "test_think_end", "test_tool_call_without_think_end", "test_empty_input"],
)
def test_is_reasoning_end(impl, special_tokenizer, prompt, ended):
    """vLLM: `TestIsReasoningEnd` (the cases without GLM's turn-boundary tokens, which Ling-3 lacks)."""
    assert reasoning_parser(impl, special_tokenizer).is_reasoning_end(_ids(special_tokenizer, prompt)) is ended


def test_is_reasoning_end_with_thinking_disabled(impl, special_tokenizer):
    """vLLM: `TestIsReasoningEnd.test_thinking_disabled`."""
    parser = reasoning_parser(impl, special_tokenizer, chat_template_kwargs={"thinking": False})
    assert parser.is_reasoning_end(_ids(special_tokenizer, "<think>x"))


@pytest.mark.parametrize(
    "output, content",
    [
        ("<think>x</think>ab<tool_call>c</tool_call>", "ab<tool_call>c</tool_call>"),
        ("<think>x<tool_call>c</tool_call>", "<tool_call>c</tool_call>"),
        ("ab", "ab"),
    ],
    ids=["test_think_end_wins_over_later_tool_call", "test_falls_back_to_tool_call", "test_no_markers_returns_input_ids"],
)
def test_extract_content_ids(impl, special_tokenizer, output, content):
    """vLLM: `TestExtractContentIds`."""
    parser = reasoning_parser(impl, special_tokenizer)
    assert parser.extract_content_ids(_ids(special_tokenizer, output)) == _ids(special_tokenizer, content)


WRITE_TOOL = {
    "type": "function",
    "function": {
        "name": "Write",
        "parameters": {
            "type": "object",
            "properties": {
                "file_path": {"type": "string"},
                "line_count": {"type": "integer"},
                "content": {"type": "string"},
            },
        },
    },
}
CALL_HEAD = (
    "</think><tool_call>Write\n"
    "<arg_key>file_path</arg_key><arg_value>/repo/app.py</arg_value>\n"
    "<arg_key>line_count</arg_key><arg_value>120</arg_value>\n"
    "<arg_key>content</arg_key><arg_value>"
)
CALL_TAIL = "</arg_value>\n</tool_call>"
CONTENT_LINE = 'if a < b > c: print("x\\y")  # </div> </arg_ \t\u00e9\n'  # vLLM's, less its <arg_key> (§3)
LOOP_HEAD = "</think><tool_call>Write\n<arg_key>file_path</arg_key><arg_value>/repo/app.py</arg_value>\n"
LOOP_PAIRS = (
    "<arg_key>content</arg_key><arg_value>a > b</arg_value>\n"
    "<arg_key>line_count</arg_key><arg_value>1</arg_value>\n"
)


def _whole_and_streamed(impl: str, tokenizer, text: str, **request_kwargs) -> tuple[Turn, Turn]:
    cls = IMPLS[impl][2]
    whole = parse_full(tokenizer, text, make_request(**request_kwargs), cls)
    pieces = [text[i : i + 7] for i in range(0, len(text), 7)]
    return whole, drive_stream(tokenizer, [(p, []) for p in pieces], make_request(**request_kwargs), cls)


@pytest.mark.parametrize(
    "tools, line_count", [([], "120"), ([WRITE_TOOL], 120)], ids=["no_schema", "schema"]
)
def test_long_call_streams_non_streaming_arguments(impl, special_tokenizer, tools, line_count):
    """vLLM: `TestStreamedToolArguments.test_long_call_streams_non_streaming_arguments` (40 lines, not 400:
    a shared CPU). Without a schema a value stays a string; with one it takes the schema's type. vLLM's
    no-tools request is tool_choice "none" at the server, which drops the call; the test calls the tool
    parser directly, as vLLM's does, and streams through the composed parser with the Write tool."""
    text = CALL_HEAD + CONTENT_LINE * 40 + CALL_TAIL
    result = tool_parser(impl, special_tokenizer, tools).extract_tool_calls(
        text.removeprefix("</think>"), make_request(tools=tools or None)
    )
    assert json.loads(result.tool_calls[0].function.arguments)["line_count"] == line_count
    if tools:
        whole, streamed = _whole_and_streamed(impl, special_tokenizer, text, tools=tools)
        assert whole == streamed and whole.calls[0][1]["line_count"] == line_count


@pytest.mark.parametrize("tools", [None, [WRITE_TOOL]], ids=["no-tools", "write-tool"])
def test_repeated_closed_args(impl, special_tokenizer, tools):
    """vLLM: `TestStreamedToolArguments.test_repeated_closed_args_stream_non_streaming_arguments`: a call
    that repeats its keys, then a second call. vLLM returns both calls, each repeated key with its last
    value. Ours does so where no tools are declared; where the request declares tools a repeated key
    refuses the call (a JSON object has each key once) and its text comes back as content."""
    first = LOOP_HEAD + LOOP_PAIRS * 3 + "<arg_key>content</arg_key><arg_value>a > b" + CALL_TAIL
    second = LOOP_HEAD.removeprefix("</think>") + "</tool_call>"
    result = tool_parser(impl, special_tokenizer, tools).extract_tool_calls(
        (first + second).removeprefix("</think>"), make_request(tools=tools)
    )
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]
    last = ("Write", {"file_path": "/repo/app.py", "content": "a > b", "line_count": 1 if tools else "1"})
    if impl == "ours" and tools:
        assert calls == [("Write", {"file_path": "/repo/app.py"})]
        assert result.content == first.removeprefix("</think>")
    else:
        assert calls == [last, ("Write", {"file_path": "/repo/app.py"})]


# ── The composed parsers, as the server runs them: whole and streamed, vLLM's result or ours ──

CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"


@dataclass(frozen=True)
class Case:
    text: str
    request: dict
    vllm: tuple[Turn, Turn]  # (whole, streamed) from vLLM's own ling3 parsers
    ours: Turn | None = None  # ours where it deliberately differs (whole == streamed); None: vLLM's
    why: str = ""


def same(turn: Turn) -> tuple[Turn, Turn]:
    return turn, turn


NO_TOOLS = {"tools": None}
CASES = {
    # No tools declared: the server's request has tool_choice "none", so vLLM's DelegatingParser drops
    # every call the engine parses, with its text; ours gives exactly vLLM's result.
    "no-tools-call": Case(f"r</think>Sure.{CALL}", NO_TOOLS, same(Turn("r", "Sure."))),
    "no-tools-call-ends-reasoning": Case(f"r{CALL}", NO_TOOLS, same(Turn("r", None))),
    "no-tools-thinking-off": Case(
        f"Sure.{CALL}", {**NO_TOOLS, "chat_template_kwargs": {"enable_thinking": False}}, same(Turn(None, "Sure."))
    ),
    "no-tools-text-between-calls": Case(
        f"r</think>A{CALL}B<tool_call>now</tool_call>C", NO_TOOLS, (Turn("r", "A"), Turn("r", "ABC"))
    ),
    "no-tools-empty-call": Case("r</think>x<tool_call></tool_call>y", NO_TOOLS, same(Turn("r", "xy"))),
    "no-tools-thinking-off-tags": Case(
        "<think>reason</think>answer",
        {**NO_TOOLS, "chat_template_kwargs": {"enable_thinking": False}},
        same(Turn(None, "reasonanswer")),
    ),
    "no-tools-trailing-reasoning-whitespace": Case("reason  \n</think>answer", NO_TOOLS, same(Turn("reason", "answer"))),
    # Tools declared, the call valid: the same result.
    "auto-valid-call": Case(f"r</think>Sure.{CALL}", {}, same(Turn("r", "Sure.", [("get_weather", {"city": "Paris"})]))),
    "auto-typed-argument": Case(
        "r</think><tool_call>get_weather<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        {},
        same(Turn("r", None, [("get_weather", {"days": 3})])),
    ),
    "required-valid-call": Case(
        f"r</think>{CALL}", {"tool_choice": "required"}, same(Turn("r", None, [("get_weather", {"city": "Paris"})]))
    ),
    # Tools declared: where ours deliberately differs.
    "none-with-tools": Case(
        f"r</think>Sure.{CALL}",
        {"tool_choice": "none"},
        same(Turn("r", "Sure.")),
        Turn("r", f"Sure.{CALL}"),
        "tool_choice none: the model wrote a call it may not make; its text is kept, not dropped",
    ),
    "auto-unknown-tool": Case(
        "r</think>x<tool_call>nope</tool_call>y",
        {},
        same(Turn("r", "xy")),
        Turn("r", "x<tool_call>nope</tool_call>y"),
        "a name the request does not offer is no call; its text is kept, not dropped",
    ),
    "auto-value-of-the-wrong-type": Case(
        "r</think><tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>",
        {},
        same(Turn("r", None, [("get_weather", {"days": "three"})])),
        Turn("r", "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>"),
        "the schema check: a call that breaks the tool's schema is not executed; its text comes back as content",
    ),
    "auto-text-after-a-call": Case(
        f"r</think>A{CALL}B",
        {},
        (Turn("r", "A", [("get_weather", {"city": "Paris"})]), Turn("r", "AB", [("get_weather", {"city": "Paris"})])),
        Turn("r", "AB", [("get_weather", {"city": "Paris"})]),
        "vLLM's whole parse drops text after a call, its stream keeps it; ours keeps it in both",
    ),
    "auto-cut-off-call": Case(
        f"r</think>x{CALL[:-12]}",
        {},
        same(Turn("r", "x", [("get_weather", {"city": "Paris"})])),
        Turn("r", f"x{CALL[:-12]}"),
        "a call cut off before </tool_call> (max_tokens) is not executed; its text comes back as content",
    ),
    "auto-trailing-reasoning-whitespace": Case(
        "reason  \n</think>answer",
        {},
        same(Turn("reason", "answer")),
        Turn("reason  \n", "answer"),
        "reasoning is returned verbatim where our grammar reads the output",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_composed_parsers(impl, special_tokenizer, name):
    case = CASES[name]
    whole, streamed = _whole_and_streamed(impl, special_tokenizer, case.text, **case.request)
    if impl == "ours" and case.ours is not None:
        assert case.why and (whole, streamed) == (case.ours, case.ours), case.why
    else:
        assert (whole, streamed) == case.vllm


def test_every_deliberate_difference_declares_tools():
    """Ours may differ from vLLM only where the request declares tools."""
    for name, case in CASES.items():
        assert case.ours is None or case.request.get("tools", TOOLS), name
