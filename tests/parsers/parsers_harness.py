"""Harness for the `ling3` parser tests: a tiny tokenizer and a driver that runs our parsers (or vLLM's
own ling3 parsers, `VllmLing3`) the way vLLM's chat-completion server does (one DelegatingParser per
request; `parse()` for a whole output, `parse_delta()` per detokenized step for a stream)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerFast
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.abstract_parser import DelegatingParser
from vllm.reasoning.ling3_reasoning_parser import Ling3ParserReasoningAdapter as VllmLing3ReasoningParser
from vllm.tool_parsers.ling3_tool_parser import Ling3ToolParser as VllmLing3ToolParser

from vllm_ling.parsers.ling3 import Ling3ReasoningParser, Ling3ToolParser

THINK_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
ARG_TAGS = ["<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
EOS = "<|endoftext|>"
# A few merges so that tokens span several characters, as in a real BPE vocabulary.
MERGES = ["t h", "th e", "i n", "e r", "a r", "o n", "Ġ t", "P a", "r i", "ri s", "c i", "ci t", "cit y", "< /", '" :']


def make_tokenizer(arg_tags_special: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE (256 bytes + MERGES) with the Ling-3 tags as special tokens.

    With `arg_tags_special=False` only the think/tool_call tags are single tokens and the arg tags are
    spelled in bytes, so the text lexer must find them across delta boundaries."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [tuple(m.split(" ")) for m in MERGES]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = THINK_TAGS + (ARG_TAGS if arg_tags_special else [])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        additional_special_tokens=specials,
        clean_up_tokenization_spaces=False,
    )


def _fn(name: str, properties: dict | None = None, required: list[str] | None = None) -> dict:
    fn: dict[str, Any] = {"name": name, "description": name}
    if properties is not None:
        fn["parameters"] = {"type": "object", "properties": properties}
        if required:
            fn["parameters"]["required"] = required
    return {"type": "function", "function": fn}


TOOLS = [
    _fn(
        "get_weather",
        {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "threshold": {"type": "number"},
            "hourly": {"type": "boolean"},
            "units": {"type": "object", "properties": {"temp": {"type": "string"}}},
            "fields": {"type": "array", "items": {"type": "string"}},
            "note": {"type": ["string", "null"]},
        },
    ),
    _fn("now", {}),
    _fn("echo"),  # no schema: arguments stay strings
    _fn("book", {"hotel": {"type": "string"}, "nights": {"type": "integer", "minimum": 1}}, required=["hotel"]),
]

PROMPT_THINKING = "user: hi\nassistant:<think>"  # the generation prompt opens the think block (docs/parsers.md §1)
PROMPT_PLAIN = "user: hi\nassistant:"


@dataclass
class Turn:
    """One assistant turn as an OpenAI client sees it."""

    reasoning: str | None
    content: str | None
    calls: list[tuple[str, dict]] = field(default_factory=list)


class Ling3(DelegatingParser):
    """What vLLM's ParserManager composes for `--reasoning-parser ling3 --tool-call-parser ling3`."""

    reasoning_parser_cls = Ling3ReasoningParser
    tool_parser_cls = Ling3ToolParser


class Ling3ReasoningOnly(DelegatingParser):
    """`--reasoning-parser ling3` without a tool parser (no --enable-auto-tool-choice)."""

    reasoning_parser_cls = Ling3ReasoningParser


class Ling3ToolsOnly(DelegatingParser):
    """`--tool-call-parser ling3` without a reasoning parser."""

    tool_parser_cls = Ling3ToolParser


class VllmLing3(DelegatingParser):
    """vLLM's own ling3 parsers, composed as its server composes them: the contract ours keeps."""

    reasoning_parser_cls = VllmLing3ReasoningParser
    tool_parser_cls = VllmLing3ToolParser


def make_request(tools: list | None = TOOLS, chat_template_kwargs: dict | None = None, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="ling3",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        **kw,
    )


def _new_parser(tokenizer, request: ChatCompletionRequest, cls: type[DelegatingParser] = Ling3) -> DelegatingParser:
    return cls(tokenizer, request.tools, chat_template_kwargs=request.chat_template_kwargs or {})


def _prompt_ids(tokenizer, request: ChatCompletionRequest) -> list[int]:
    from vllm_ling.parsers.ling3 import thinking_enabled

    prompt = PROMPT_THINKING if thinking_enabled(request.chat_template_kwargs) else PROMPT_PLAIN
    return tokenizer.encode(prompt, add_special_tokens=False)


def parse_full(tokenizer, text: str, request: ChatCompletionRequest, cls: type[DelegatingParser] = Ling3) -> Turn:
    """Non-streaming: ChatCompletion serving's `parser.parse(output.text, ...)`."""
    parser = _new_parser(tokenizer, request, cls)
    ids = tokenizer.encode(text, add_special_tokens=False)
    if hasattr(parser, "set_prompt_token_ids"):  # vLLM >= 0.32
        parser.set_prompt_token_ids(_prompt_ids(tokenizer, request))
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=True, model_output_token_ids=ids)
    return Turn(reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls or []])


def parse_stream(
    tokenizer, text: str, request: ChatCompletionRequest, chunk: int = 1, cls: type[DelegatingParser] = Ling3
) -> Turn:
    """Streaming: `parser.parse_delta()` per engine step of `chunk` tokens (more than one with MTP),
    with the text vLLM's fast incremental detokenizer yields: tokenizers' DecodeStream, special tokens
    kept (as `adjust_request` asks), nothing for a token that ends inside a UTF-8 character."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text, "fixture tokenizer must round-trip the test text"
    detok = DecodeStream(skip_special_tokens=False)
    steps = []
    for start in range(0, len(ids), chunk):
        step_ids = ids[start : start + chunk]
        steps.append(("".join(detok.step(tokenizer._tokenizer, i) or "" for i in step_ids), step_ids))
    return drive_stream(tokenizer, steps, request, cls)


def parse_text_chunks(
    tokenizer, chunks: list[str], request: ChatCompletionRequest, cls: type[DelegatingParser] = Ling3
) -> Turn:
    """Streaming with the output cut at arbitrary characters (no token ids): our parsers read text."""
    return drive_stream(tokenizer, [(c, []) for c in chunks], request, cls)


def drive_stream(
    tokenizer, steps: list[tuple[str, list[int]]], request: ChatCompletionRequest, cls: type[DelegatingParser] = Ling3
) -> Turn:
    """Feed `(delta_text, delta_token_ids)` steps to a fresh parser; the client's view of the stream."""
    parser = _new_parser(tokenizer, request, cls)
    prompt = _prompt_ids(tokenizer, request)
    reasoning, content = [], []
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for n, (delta_text, delta_ids) in enumerate(steps, start=1):
        delta = parser.parse_delta(
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            request=request,
            prompt_token_ids=prompt,
            finished=n == len(steps),
        )
        if delta is None:
            continue
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
        for tc in delta.tool_calls or []:
            if tc.function and tc.function.name:
                assert tc.index not in names, f"tool call {tc.index} named twice"
                assert tc.id, "the first delta of a call carries its id"
                names[tc.index] = tc.function.name
            if tc.function and tc.function.arguments:
                args[tc.index] = args.get(tc.index, "") + tc.function.arguments
    if not request.tools:  # vLLM's own parsers serve it: record their deltas as they are (docs/parsers.md §4)
        calls = [(names.get(i, ""), _json_or_text(args.get(i) or "{}")) for i in sorted(set(names) | set(args))]
        return Turn("".join(reasoning) or None, "".join(content) or None, calls)
    assert sorted(names) == list(range(len(names))), f"tool indices not dense: {sorted(names)}"
    assert set(args) <= set(names), "arguments streamed for a call that was never named"
    calls = [(names[i], json.loads(args.get(i) or "{}")) for i in sorted(names)]
    return Turn("".join(reasoning) or None, "".join(content) or None, calls)


def _json_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def client_view(turn: Turn) -> Turn:
    """vLLM's non-streaming path (DelegatingParser, not ours) turns whitespace-only content next to tool
    calls into None; streaming sends that whitespace. Compare modulo exactly that."""
    content = turn.content
    if turn.calls and content is not None and not content.strip():
        content = None
    return Turn(turn.reasoning, content, turn.calls)
