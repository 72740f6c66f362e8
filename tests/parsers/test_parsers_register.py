"""`register_parsers()`: stands aside for vLLM's own `ling3` (every supported release ships it) unless forced,
registers ours lazily and idempotently. Registry state is restored after each test."""

from __future__ import annotations

import pytest
from vllm.parser.parser_manager import ParserManager
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

from vllm_ling.parsers import register_parsers

OURS = ["tool:ling3", "reasoning:ling3"]
_TABLES = [
    ToolParserManager.tool_parsers,
    ToolParserManager.lazy_parsers,
    ReasoningParserManager.reasoning_parsers,
    ReasoningParserManager.lazy_parsers,
]


@pytest.fixture(autouse=True)
def restore_registries():
    saved = [dict(t) for t in _TABLES]
    yield
    for table, before in zip(_TABLES, saved):
        table.clear()
        table.update(before)


def _vllm_has_ling3() -> bool:
    return "ling3" in ToolParserManager.list_registered() and "ling3" in ReasoningParserManager.list_registered()


def test_stands_aside_for_vllms_own_ling3():
    """In a fresh process, as vLLM starts one: another test may already have put ours in this one's registries."""
    import json
    import subprocess
    import sys

    code = ("import json; from vllm.tool_parsers import ToolParserManager as T; "
            "from vllm.reasoning import ReasoningParserManager as R; "
            "own = 'ling3' in T.list_registered() and 'ling3' in R.list_registered(); before = T.lazy_parsers.get('ling3'); "
            "from vllm_ling.parsers import register_parsers; names = register_parsers(); "
            "print(json.dumps([own, names, before == T.lazy_parsers.get('ling3'), 'ling3' in T.list_registered()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    had_own, names, unchanged, has_ling3 = json.loads(out.stdout.strip().splitlines()[-1])
    assert had_own and has_ling3, "every supported vLLM registers its own ling3 parsers"
    assert names == [] and unchanged


def test_force_registers_ours_even_over_an_already_imported_vllm_parser():
    from vllm_ling.parsers.ling3 import Ling3ReasoningParser, Ling3ToolParser

    if _vllm_has_ling3():
        ToolParserManager.get_tool_parser("ling3")  # vLLM's class now sits in the import cache
    assert register_parsers(force=True) == OURS
    assert ToolParserManager.get_tool_parser("ling3") is Ling3ToolParser
    assert ReasoningParserManager.get_reasoning_parser("ling3") is Ling3ReasoningParser


def test_registration_is_lazy():
    register_parsers(force=True)
    assert ToolParserManager.lazy_parsers["ling3"] == ("vllm_ling.parsers.ling3", "Ling3ToolParser")
    assert ReasoningParserManager.lazy_parsers["ling3"] == ("vllm_ling.parsers.ling3", "Ling3ReasoningParser")
    assert "ling3" not in ToolParserManager.tool_parsers  # nothing imported until a server asks for it
    assert "ling3" not in ReasoningParserManager.reasoning_parsers


@pytest.mark.parametrize("force", [False, True])
def test_repeated_registration_changes_nothing(force):
    first = register_parsers(force=force)
    state = [dict(t) for t in _TABLES]
    assert register_parsers(force=force) == first
    assert register_parsers() == first  # a later plain call keeps what force registered
    assert [dict(t) for t in _TABLES] == state


def test_server_composes_our_parsers_from_the_registered_name():
    from vllm_ling.parsers.ling3 import Ling3ReasoningParser, Ling3ToolParser

    register_parsers(force=True)
    parser_cls = ParserManager.get_parser(
        tool_parser_name="ling3", reasoning_parser_name="ling3", enable_auto_tools=True
    )
    assert parser_cls.tool_parser_cls is Ling3ToolParser
    assert parser_cls.reasoning_parser_cls is Ling3ReasoningParser
