"""Fixtures for the `ling3` parser tests; the harness itself is `parsers_harness.py`."""

from __future__ import annotations

import pytest

try:
    import vllm.parser.glm47_moe  # noqa: F401  (the engine our parsers build on: vLLM >= 0.26)
except ImportError:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", params=[True, False], ids=["arg-tags-special", "arg-tags-bytes"])
def tokenizer(request):
    from parsers_harness import make_tokenizer

    return make_tokenizer(arg_tags_special=request.param)


@pytest.fixture(scope="session")
def special_tokenizer():
    from parsers_harness import make_tokenizer

    return make_tokenizer(arg_tags_special=True)


@pytest.fixture(params=[1, 3], ids=["1-token-steps", "3-token-steps"])
def chunk(request) -> int:
    """Tokens per engine step: 1, or several as with MTP speculative decoding."""
    return request.param


@pytest.fixture
def parse(tokenizer, chunk):
    """parse(text, **request_kwargs) -> Turn: parses both ways and checks streaming == non-streaming."""
    from parsers_harness import client_view, make_request, parse_full, parse_stream

    def _parse(text: str, **request_kwargs):
        full = parse_full(tokenizer, text, make_request(**request_kwargs))
        streamed = parse_stream(tokenizer, text, make_request(**request_kwargs), chunk)
        assert client_view(streamed) == client_view(full), "streamed deltas differ from the non-streaming result"
        return full

    return _parse
