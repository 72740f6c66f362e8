"""Pair the reasoning parser and the tool parser that vLLM builds for one request.

vLLM (0.32 to 0.34) serves `--reasoning-parser X --tool-call-parser Y` through `DelegatingParser`,
whose `__init__` builds the request's reasoning parser and, right after it in the same thread, its tool
parser; neither is told about the other. Ling-3 needs them to agree (docs/parsers.md §4): whether a
`<tool_call>` inside reasoning ends the reasoning depends on the request's tools, which only the tool
parser sees while streaming. So the reasoning parser offers itself here and the tool parser built next
claims it. A claim succeeds only for the parser built last in this thread, unclaimed, unused, and with
the same tokenizer object; otherwise each parser works alone.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_last = threading.local()


def offer(reasoning_parser: Any) -> None:
    """Called at the end of the reasoning parser's `__init__`."""
    _last.reasoning = weakref.ref(reasoning_parser)


def claim(tokenizer: Any) -> Any | None:
    """The reasoning parser of the request whose tool parser is being built, or None."""
    ref = getattr(_last, "reasoning", None)
    _last.reasoning = None
    parser = ref() if ref is not None else None
    if parser is None or parser.model_tokenizer is not tokenizer or parser.used:
        return None
    return parser
