"""A seeded generator of crafted Ling-3 outputs for the property tests (test_parsers_fuzz.py).

Outputs are built from the grammar's pieces (docs/parsers.md §3): reasoning, `</think>`, content, calls
to known and unknown tools, keys and values that fit or break the schema, values holding markup-like
text, and corruptions (truncation, a stray or nested tag, a repeated key, text between arguments).
Requests vary thinking, tool_choice and whether tools are offered. Everything is drawn from one
`random.Random(seed)`, so a failing case is reproduced by its seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from parsers_harness import TOOLS

TAGS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|endoftext|>",
]
TEXTS = [
    "Hello",
    " ",
    "\n",
    "Paris",
    "São Paulo ✓",
    "a<b",
    "<",
    "</",
    "<thin",
    "</tool",
    "<arg",
    "x > y",
    '"quoted"',
    "{",
    "}",
    "3",
    "three",
    "null",
    "true",
    '{"temp": "C"}',
    '["rain", "wind"]',
    "  ",
    "0",
    "-1.5",
    "1e999",
]
NAMES = ["get_weather", "now", "echo", "book", "get_wether", "get", " get_weather\n", "get weather", ""]
KEYS = ["city", "days", "hotel", "nights", "units", "fields", "note", "threshold", "hourly", "x", "ci", "", " city "]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
WHITESPACE = ["", "", "", " ", "\n"]


@dataclass(frozen=True)
class Case:
    seed: int
    text: str
    request: dict[str, Any]


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 3)))


def _valid_call(rng: random.Random) -> str:
    """A call that fits the harness's TOOLS (values may still hold markup-like text)."""
    name = rng.choice(["get_weather", "echo", "now", "book"])
    pairs = {
        "get_weather": [
            ("city", _text(rng)),
            ("days", rng.choice(["3", " 2 ", "-1"])),
            ("note", rng.choice(["null", "x"])),
        ],
        "echo": [(rng.choice(["a", "b", "c"]), _text(rng)) for _ in range(2)],
        "now": [],
        "book": [("hotel", _text(rng)), ("nights", rng.choice(["1", "7"]))],
    }[name]
    chosen = dict(rng.sample(pairs, rng.randint(min(len(pairs), 1), len(pairs))) if pairs else [])
    if name == "book":
        chosen.setdefault("hotel", "Ritz")
    body = "".join(
        f"{rng.choice(WHITESPACE)}<arg_key>{k}</arg_key>{rng.choice(WHITESPACE)}<arg_value>{v}</arg_value>"
        for k, v in chosen.items()
    )
    return f"<tool_call>{name}{body}{rng.choice(WHITESPACE)}</tool_call>"


def _call(rng: random.Random) -> str:
    if rng.random() < 0.5:
        block = _valid_call(rng)
        return _corrupt(rng, block) if rng.random() < 0.3 else block
    pairs = []
    for _ in range(rng.randint(0, 3)):
        value = _text(rng) if rng.random() < 0.6 else rng.choice(TEXTS)
        pairs.append(
            f"<arg_key>{rng.choice(KEYS)}</arg_key>{rng.choice(WHITESPACE)}<arg_value>{value}</arg_value>"
            + rng.choice(WHITESPACE)
        )
    block = f"<tool_call>{rng.choice(NAMES)}{''.join(pairs)}</tool_call>"
    return _corrupt(rng, block) if rng.random() < 0.4 else block


def _corrupt(rng: random.Random, block: str) -> str:
    at = rng.randrange(len(block) + 1)
    match rng.randrange(5):
        case 0:  # cut off (max_tokens)
            return block[:at]
        case 1:  # a stray tag
            return block[:at] + rng.choice(TAGS) + block[at:]
        case 2:  # stray text
            return block[:at] + _text(rng) + block[at:]
        case 3:  # a repeated pair
            start = block.find("<arg_key>")
            end = block.find("</arg_value>", start) + len("</arg_value>")
            return block[:end] + block[start:end] + block[end:] if start >= 0 else block
        case _:  # a tag dropped
            tag = rng.choice(TAGS[2:8])
            i = block.find(tag)
            return block[:i] + block[i + len(tag) :] if i >= 0 else block


def _part(rng: random.Random) -> str:
    """Text, calls and stray tags, in random order."""
    bits = []
    for _ in range(rng.randint(0, 4)):
        r = rng.random()
        bits.append(_text(rng) if r < 0.5 else _call(rng) if r < 0.85 else rng.choice(TAGS))
    return "".join(bits)


def output(rng: random.Random) -> str:
    text = ("<think>" if rng.random() < 0.1 else "") + _part(rng)
    if rng.random() < 0.75:
        text += "</think>" + _part(rng)
    return text


def request(rng: random.Random) -> dict[str, Any]:
    thinking = rng.choice([None, {"enable_thinking": False}, {"thinking": True}])
    kwargs: dict[str, Any] = {"chat_template_kwargs": thinking}
    if rng.random() < 0.15:
        kwargs["tools"] = None
    else:
        kwargs["tools"] = TOOLS
        choice = rng.choice([None, "auto", "none", "required", NAMED])
        if choice is not None:
            kwargs["tool_choice"] = choice
    return kwargs


def case(seed: int) -> Case:
    rng = random.Random(seed)
    return Case(seed, output(rng), request(rng))


def splits(rng: random.Random, text: str) -> list[str]:
    """`text` cut at random characters (possibly none)."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
