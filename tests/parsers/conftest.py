"""Fixtures for the `ling3` parser tests; the harness itself is `parsers_harness.py`."""

from __future__ import annotations

import pytest

try:
    import vllm.parser.glm47_moe  # noqa: F401  (the engine our parsers build on)
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
    """parse(text, **request_kwargs) -> Turn: parses non-streaming, then streamed in steps of `chunk`
    tokens and character by character, and checks that every stream adds up to the non-streaming result."""
    from parsers_harness import client_view, make_request, parse_full, parse_stream, parse_text_chunks

    def _parse(text: str, **request_kwargs):
        full = parse_full(tokenizer, text, make_request(**request_kwargs))
        by_tokens = parse_stream(tokenizer, text, make_request(**request_kwargs), chunk)
        by_chars = parse_text_chunks(tokenizer, list(text), make_request(**request_kwargs))
        assert client_view(by_tokens) == client_view(full), "token-step stream differs from the whole parse"
        assert client_view(by_chars) == client_view(full), "character stream differs from the whole parse"
        return full

    return _parse
