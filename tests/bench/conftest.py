from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import pytest
import requests
from bench_fake_server import FakeConfig, FakeServer


@pytest.fixture
def fake() -> Iterator[Callable[..., FakeServer]]:
    """Factory: `fake(first_token_delay_s=0.1, ...)` starts a FakeServer torn down after the test."""
    with ExitStack() as stack:
        yield lambda **kw: stack.enter_context(FakeServer(FakeConfig(**kw)))


@pytest.fixture
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s
