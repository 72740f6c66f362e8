"""Property tests of `ling3` on seeded random outputs (fuzz_outputs.py): streamed == whole, no text lost.

* Through vLLM's DelegatingParser (as the server runs our parsers), for a request that declares tools:
  the non-streaming result equals the concatenated deltas of every stream of the same output: token by
  token, three tokens a step (MTP), character by character, and cut at random characters. For a request
  without tools, vLLM's own ling3 parsers are the contract (docs/parsers.md §4): ours give exactly their
  result, whole and in every one of those streams, even where vLLM's stream and whole parse differ.
* In our grammar (`OutputParser`): the pieces of an output, however it is cut, concatenate back to the
  output exactly, the only pieces in no output field are whole markup tags (or dropped special
  tokens), and the fields they give are those the server returns.
"""

from __future__ import annotations

import json
import random

import pytest
from fuzz_outputs import TAGS, case, splits
from parsers_harness import Ling3, VllmLing3, client_view, make_request, parse_full, parse_stream, parse_text_chunks

SEEDS = range(300)


def _every_parse(tokenizer, c, seed: int, cls) -> dict:
    """The whole parse and the four streams of one fuzz case, by the parsers `cls` composes."""
    rng = random.Random(seed)
    return {
        "whole": parse_full(tokenizer, c.text, make_request(**c.request), cls),
        "1-token steps": parse_stream(tokenizer, c.text, make_request(**c.request), 1, cls),
        "3-token steps": parse_stream(tokenizer, c.text, make_request(**c.request), 3, cls),
        "characters": parse_text_chunks(tokenizer, list(c.text), make_request(**c.request), cls),
        "random cuts": parse_text_chunks(tokenizer, splits(rng, c.text), make_request(**c.request), cls),
    }


@pytest.mark.parametrize("block", range(10), ids=lambda b: f"seeds-{b * 30}-{b * 30 + 29}")
def test_every_stream_of_an_output_adds_up_to_its_whole_parse(tokenizer, block):
    for seed in SEEDS[block * 30 : block * 30 + 30]:
        c = case(seed)
        ours = _every_parse(tokenizer, c, seed, Ling3)
        if not c.request.get("tools"):  # vLLM's contract, mode by mode
            assert ours == _every_parse(tokenizer, c, seed, VllmLing3), f"seed {seed}: {c.text!r} {c.request}"
            continue
        full = client_view(ours.pop("whole"))
        for how, streamed in ours.items():
            assert client_view(streamed) == full, f"seed {seed} ({how}): {c.text!r} {c.request}"


@pytest.mark.parametrize("block", range(10), ids=lambda b: f"seeds-{b * 30}-{b * 30 + 29}")
def test_no_text_is_lost_and_the_pieces_are_what_the_server_returns(special_tokenizer, block):
    from vllm_ling.parsers.grammar import Kind, OutputParser, Policy
    from vllm_ling.parsers.ling3 import thinking_enabled
    from vllm_ling.parsers.schema import callable_tools

    drop = frozenset(special_tokenizer.all_special_tokens)
    for seed in SEEDS[block * 30 : block * 30 + 30]:
        c = case(seed)
        req = make_request(**c.request)
        policy = Policy(thinking_enabled(req.chat_template_kwargs), callable_tools(req.tools, req.tool_choice))
        rng = random.Random(seed)
        seen = set()
        for chunks in ([c.text], list(c.text), splits(rng, c.text), splits(rng, c.text)):
            parser = OutputParser(policy, drop)
            pieces = [p for chunk in chunks for p in parser.feed(chunk)] + parser.finish()
            assert "".join(p.raw for p in pieces) == c.text, f"seed {seed}: text lost or added"
            assert all(p.raw in TAGS for p in pieces if p.kind is Kind.MARKUP), f"seed {seed}: text dropped"
            calls = [p.raw for p in pieces if p.kind is Kind.CALL]
            assert all(c.startswith("<tool_call>") and c.endswith("</tool_call>") for c in calls)
            fields = (
                "".join(p.raw for p in pieces if p.kind is Kind.REASONING) or None,
                "".join(p.raw for p in pieces if p.kind is Kind.CONTENT) or None,
                [(p.name, json.loads(p.arguments)) for p in pieces if p.kind is Kind.CALL],
            )
            seen.add(json.dumps(fields))
        assert len(seen) == 1, f"seed {seed}: the pieces depend on where the output was cut"
        if not req.tools:
            continue  # without tools vLLM's own parsers serve (test_every_stream_of_an_output_adds_up_to_...)
        server = client_view(parse_full(special_tokenizer, c.text, req))
        reasoning, content, calls = json.loads(seen.pop())
        expected = client_view(type(server)(reasoning, content, [tuple(x) for x in calls]))
        assert server == expected, f"seed {seed}: {c.text!r} {c.request}"


def test_the_fuzz_reaches_every_outcome():
    """The generator is worth something only if it produces calls, refusals, reasoning and content."""
    from vllm_ling.parsers.grammar import Kind, OutputParser, Policy
    from vllm_ling.parsers.ling3 import thinking_enabled
    from vllm_ling.parsers.schema import callable_tools

    kinds, refusals = set(), 0
    for seed in SEEDS:
        c = case(seed)
        req = make_request(**c.request)
        policy = Policy(thinking_enabled(req.chat_template_kwargs), callable_tools(req.tools, req.tool_choice))
        parser = OutputParser(policy)
        kinds |= {p.kind for p in parser.feed(c.text) + parser.finish()}
        refusals += len(parser.refusals)
    assert kinds == set(Kind) and refusals > 50
