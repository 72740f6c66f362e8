"""Time streaming one long tool-call argument through `ling3`, token by token (operator issue, item 7).

    python3 tests/parsers/bench_long_argument.py [N_TOKENS=20000]

Not a test (timings vary with the machine); test_parsers_linear.py checks the work is linear.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from parsers_harness import make_request, make_tokenizer, parse_stream  # noqa: E402
from test_parsers_linear import long_argument_output  # noqa: E402


def main(n_tokens: int) -> None:
    tokenizer = make_tokenizer(arg_tags_special=True)
    text, body = long_argument_output(tokenizer, n_tokens)
    start = time.perf_counter()
    turn = parse_stream(tokenizer, text, make_request(), 1)
    seconds = time.perf_counter() - start
    assert turn.calls == [("echo", {"text": body})]
    n = len(tokenizer.encode(text, add_special_tokens=False))
    print(f"streamed a {n_tokens}-token argument ({n} output tokens, {len(text)} chars) in {seconds:.2f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20000)
