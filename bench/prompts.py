"""Fixed-seed prompt sets: short code, short prose, and long context sized in tokens.

Random prompts make runs incomparable (a "prompt lottery"): every prompt here is a pure function of
(set, seed, index or target size), so two runs with the same seed send byte-identical text. vLLM's
benchmark datasets have no such sets; `write_dataset` writes ours as its custom (JSONL) dataset.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Callable

SETS = ("code", "prose", "long")
CHARS_PER_TOKEN = 4  # rough English/code average, used only when the server cannot tokenize

TokenCount = Callable[[str], int]

_CODE_TASKS = (
    "parses an ISO-8601 duration such as PT1H30M into seconds",
    "merges overlapping integer intervals",
    "returns the k most frequent words of a text",
    "implements an LRU cache with get and put in O(1)",
    "checks whether a string of brackets is balanced",
    "computes the longest common subsequence of two strings",
    "topologically sorts a dependency graph and reports cycles",
    "streams a CSV file and sums one column grouped by another",
    "retries a callable with exponential backoff and jitter",
    "converts a Roman numeral to an integer",
    "finds the shortest path in a weighted grid with Dijkstra's algorithm",
    "tokenizes arithmetic expressions and evaluates them with precedence",
    "rate-limits calls with a token bucket",
    "deduplicates files in a directory tree by content hash",
    "renders a nested dict as an indented YAML-like string",
    "validates and normalises an IPv6 address",
)
_LANGUAGES = ("Python", "Rust", "C++", "Go", "TypeScript")
_PROSE_FORMS = ("a short essay", "a product description", "a letter", "a news brief", "a story opening")
_PROSE_TOPICS = (
    "the first winter on a research station in Antarctica",
    "why bridges are painted continuously",
    "a small town that replaced its street lights",
    "the history of the shipping container",
    "learning to sail as an adult",
    "a library that lends tools instead of books",
    "how tides are predicted",
    "a night market that opens only in the rain",
    "the engineering of mechanical watches",
    "a chef who cooks only with a wood fire",
    "restoring a wetland after a century of farming",
    "the daily routine of a lighthouse keeper",
)
_AUDIENCES = ("children", "engineers", "a general audience", "tourists", "students")
_WORDS = (
    "the a of and to in that it was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use each which she do how their if will "
    "up other about out many then them these so some her would make like him into time has look two "
    "more write go see number no way could people my than first water been call who oil its now find "
    "long down day did get come made may part over new sound take only little work know place year "
    "live me back give most very after thing our just name good sentence man think say great where "
    "help through much before line right too mean old any same tell boy follow came want show also "
    "around form three small set put end does another well large must big even such because turn "
    "here why ask went men read need land different home us move try kind hand picture again change "
    "off play spell air away animal house point page letter mother answer found study still learn "
    "river station engine signal harbour valve cargo north survey lamp ledger crew weather pressure"
).split()


@dataclass(frozen=True)
class Prompt:
    """One benchmark case; `tokens` is counted when the set is built (server or estimate)."""

    name: str
    kind: str
    text: str
    tokens: int
    target_tokens: int | None = None


def estimate_tokens(text: str) -> int:
    """~4 characters per token: the fallback when the server has no /tokenize."""
    return -(-len(text) // CHARS_PER_TOKEN)


def code_prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(f"code/{seed}")
    return [
        f"Write a {rng.choice(_LANGUAGES)} function that {task}. "
        "Use clear names, add type annotations where the language has them, and include two unit tests."
        for task in rng.sample(_CODE_TASKS, n)
    ]


def prose_prompts(seed: int, n: int) -> list[str]:
    rng = random.Random(f"prose/{seed}")
    return [
        f"Write {rng.choice(_PROSE_FORMS)} about {topic} for {rng.choice(_AUDIENCES)}. "
        "Use concrete details and plain language."
        for topic in rng.sample(_PROSE_TOPICS, n)
    ]


def _log_lines(rng: random.Random, start: int, n: int) -> list[str]:
    lines = []
    for i in range(start, start + n):
        words = rng.choices(_WORDS, k=rng.randint(8, 20))
        lines.append(f"Entry {i:06d}: {' '.join(words).capitalize()}.\n")
    return lines


def long_prompt(seed: int, target_tokens: int, count: TokenCount) -> tuple[str, int]:
    """A log of seeded filler lines plus a retrieval question, `target_tokens` long or just under.

    Token count grows with the number of lines, so the largest fitting prefix is found by bisection
    on `count` (the server's tokenizer when it has one); it lands within one line (<= ~40 tokens)
    of the target. Returns (text, counted tokens).
    """
    rng = random.Random(f"long/{seed}")
    code = rng.randint(1000, 9999)
    head = (
        f"The vault code is {code}. Remember it: the question at the end asks for it.\n"
        "Below is a long station log. Read it, then answer the question.\n\n"
    )
    tail = ("\nQuestion: what is the vault code stated at the top? "
            "Answer with the number, then summarise the log.")
    if count(head + tail) > target_tokens:
        raise ValueError(
            f"long-context target {target_tokens} tokens is shorter than the fixed question "
            f"({count(head + tail)} tokens); use a target of at least 256"
        )
    lines = _log_lines(rng, 0, target_tokens * 2 // 15 + 1)  # ~15 tokens a line: enough for most tokenizers

    def text(k: int) -> str:
        return head + "".join(lines[:k]) + tail

    while count(text(len(lines))) <= target_tokens:  # tokenizer denser than assumed: grow the pool
        lines += _log_lines(rng, len(lines), len(lines))
    lo, hi = 0, len(lines)  # invariant: count(text(lo)) <= target < count(text(hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(text(mid)) <= target_tokens else (lo, mid)
    return text(lo), count(text(lo))


def build_prompts(
    sets: list[str], seed: int, num_prompts: int, long_tokens: list[int], count: TokenCount
) -> list[Prompt]:
    """The benchmark cases, in a fixed order: short sets first, then long context by size."""
    prompts: list[Prompt] = []
    for kind in sets:
        if kind not in SETS:
            raise ValueError(f"unknown prompt set {kind!r}; choose from {', '.join(SETS)}")
        if kind == "long":
            for target in long_tokens:
                text, n = long_prompt(seed, target, count)
                prompts.append(Prompt(f"long-{target}", kind, text, n, target))
            continue
        if num_prompts > min(len(_CODE_TASKS), len(_PROSE_TOPICS)):
            raise ValueError(
                f"--num-prompts {num_prompts} exceeds the {min(len(_CODE_TASKS), len(_PROSE_TOPICS))} "
                "distinct short prompts per set; use fewer prompts or more --repeats"
            )
        texts = {"code": code_prompts, "prose": prose_prompts}[kind](seed, num_prompts)
        prompts += [Prompt(f"{kind}-{i}", kind, t, count(t)) for i, t in enumerate(texts)]
    return prompts


def write_dataset(path: str | os.PathLike, prompts: list[Prompt], max_tokens: int) -> None:
    """The prompts as `vllm bench serve --dataset-name custom` lines: `prompt` and `output_tokens`, which
    vLLM reads, plus our name, set and sizes, which it ignores."""
    with open(path, "w", encoding="utf-8") as f:
        for p in prompts:
            row = {"prompt": p.text, "output_tokens": max_tokens, "name": p.name, "set": p.kind,
                   "prompt_tokens": p.tokens, "target_tokens": p.target_tokens}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# Agent sessions (`ling_bench.agent`): a system + tool-schema prefix, a task, then tool outputs. Every text is a
# pure function of (seed, session, turn) and is sized in estimated tokens (CHARS_PER_TOKEN), never by a tokenizer,
# so any server receives byte-identical text for a seed; the real counts come back in usage.prompt_tokens.

_TOOL_VERBS = ("read", "search", "list", "run", "edit", "fetch", "diff", "build", "test", "inspect", "grep", "apply")
_TOOL_NOUNS = ("file", "directory", "symbol", "tests", "logs", "patch", "issue", "commit", "process", "config")
_PARAM_TYPES = ("string", "integer", "boolean", "array")
_PATHS = ("src/core", "src/io", "src/net", "lib/util", "tests/unit", "tests/e2e", "tools/ci", "docs/api")


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choices(_WORDS, k=rng.randint(lo, hi))).capitalize() + "."


def _tool_schema(rng: random.Random, i: int) -> dict:
    name = f"{rng.choice(_TOOL_VERBS)}_{rng.choice(_TOOL_NOUNS)}_{i}"
    params = {f"arg_{j}": {"type": rng.choice(_PARAM_TYPES), "description": _sentence(rng, 6, 14)}
              for j in range(rng.randint(2, 5))}
    return {"type": "function", "function": {
        "name": name, "description": _sentence(rng, 12, 30),
        "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]}}}


def agent_prefix(seed: int, target_tokens: int) -> str:
    """A system prompt and JSON tool schemas, ~`target_tokens` estimated tokens: the part every step of every
    session of a run re-sends unchanged (what a prefix cache can keep)."""
    rng = random.Random(f"agent-prefix/{seed}")
    head = ("You are a coding agent working in a repository. Call one tool per step, read its output, and "
            "continue until the task is done. Tools:\n")
    tools: list[str] = []
    while estimate_tokens(head + "\n".join(tools)) < target_tokens:
        tools.append(json.dumps(_tool_schema(rng, len(tools)), indent=1))
    return head + "\n".join(tools) + "\n"


def agent_task(seed: int, session: int) -> str:
    """The user's request that opens session `session`."""
    rng = random.Random(f"agent-task/{seed}/{session}")
    return (f"Task: in the {rng.choice(_LANGUAGES)} module under {rng.choice(_PATHS)}, write code that "
            f"{rng.choice(_CODE_TASKS)}, then make the tests pass.")


def tool_output(seed: int, session: int, turn: int, min_tokens: int, max_tokens: int) -> str:
    """The tool result that turn `turn` of session `session` appends: grep hits, source lines and test log
    lines, a seeded size between `min_tokens` and `max_tokens` estimated tokens."""
    rng = random.Random(f"agent-tool/{seed}/{session}/{turn}")
    target = rng.randint(min_tokens, max_tokens)
    lines = [f"$ {rng.choice(_TOOL_VERBS)}_{rng.choice(_TOOL_NOUNS)} {rng.choice(_PATHS)}\n"]
    while estimate_tokens("".join(lines)) < target:
        path = f"{rng.choice(_PATHS)}/{rng.choice(_TOOL_NOUNS)}_{rng.randint(0, 99):02d}.py"
        kind = rng.randrange(3)
        if kind == 0:
            lines.append(f"{path}:{rng.randint(1, 999)}: {' '.join(rng.choices(_WORDS, k=rng.randint(4, 12)))}\n")
        elif kind == 1:
            lines.append(f"    def {rng.choice(_TOOL_VERBS)}_{rng.choice(_WORDS)}(self, "
                         f"{rng.choice(_WORDS)}: int) -> None:  # {_sentence(rng, 3, 8)}\n")
        else:
            lines.append(f"{path}::test_{rng.choice(_WORDS)} {rng.choice(('PASSED', 'FAILED', 'SKIPPED'))}\n")
    return "".join(lines)


def fixed_reply(seed: int, session: int, turn: int, target_tokens: int) -> str:
    """A stand-in for the model's reply, ~`target_tokens` estimated tokens: a history known before the run,
    identical on every server (--agent-replies fixed, --write-dataset)."""
    rng = random.Random(f"agent-reply/{seed}/{session}/{turn}")
    text = f"Step {turn}: "
    while estimate_tokens(text) < target_tokens:
        text += _sentence(rng, 6, 16) + " "
    return text.rstrip() + "\n"
