"""Streaming a long argument does work linear in its length (operator issue, item 7).

vLLM's GLM-4.7 engine re-serialised and re-scanned the whole argument JSON for every streamed token
(`ParserEngine._compute_arg_delta` / `_safe_arg_prefix`): quadratic, 29 s for a 20k-token argument.
No timing here: the first test counts the Python lines executed (sys.settrace, every module, vLLM's
included) while streaming an argument of N and 4N tokens through vLLM's DelegatingParser, which is
linear work if the count grows about 4x (quadratic work grows 16x). The second checks our lexer's own
counter. `python3 tests/parsers/bench_long_argument.py` times the 20k-token case.
"""

from __future__ import annotations

import sys

from parsers_harness import make_request, parse_stream

WORD = "lorem ipsum dolor sit amet, "


def long_argument_output(tokenizer, n_tokens: int) -> tuple[str, str]:
    """A call to `echo` whose one argument is about `n_tokens` tokens of prose; (output, argument)."""
    ids = tokenizer.encode(WORD * (n_tokens // 3 + 1), add_special_tokens=False)[:n_tokens]
    body = tokenizer.decode(ids)
    return f"ok</think><tool_call>echo<arg_key>text</arg_key><arg_value>{body}</arg_value></tool_call>", body


def lines_executed(fn) -> int:
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_streaming_a_long_argument_token_by_token_does_linear_work(special_tokenizer):
    def stream(n: int):
        text, body = long_argument_output(special_tokenizer, n)
        turn = parse_stream(special_tokenizer, text, make_request(), 1)
        assert turn.calls == [("echo", {"text": body})]

    small, large = lines_executed(lambda: stream(150)), lines_executed(lambda: stream(600))
    assert large < 5 * small, f"4x the tokens cost {large / small:.1f}x the lines executed ({small} -> {large})"


def test_the_lexer_reads_each_character_of_a_stream_a_bounded_number_of_times(special_tokenizer):
    from vllm_ling.parsers.grammar import OutputParser, Policy
    from vllm_ling.parsers.schema import tool_schemas

    text, _ = long_argument_output(special_tokenizer, 2000)
    text = text.replace(" ", " <") + "<arg_k"  # '<' everywhere: each is a possible tag start
    parser = OutputParser(Policy(True, tool_schemas(make_request().tools)))
    for ch in text:
        parser.feed(ch)
    parser.finish()
    assert parser.scanned <= 2 * len(text), f"{parser.scanned} characters read for {len(text)}"
