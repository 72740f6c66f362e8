"""Register our `ling3` tool-call and reasoning parsers over vLLM's own when our model serves (`force`).

Registration is lazy ("module", "Class"): the parser module (`vllm_ling.parsers.ling3`) is imported only
when a server asks for `ling3`. Only vLLM's two registries are imported here (no CUDA).
"""

from __future__ import annotations

NAME = "ling3"
_MODULE = f"{__name__}.ling3"
_CLASSES = {"tool": "Ling3ToolParser", "reasoning": "Ling3ReasoningParser"}


def _registries() -> dict[str, tuple[type, dict]]:
    """kind -> (manager, its cache of imported classes, which shadows lazy entries)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    return {
        "tool": (ToolParserManager, ToolParserManager.tool_parsers),
        "reasoning": (ReasoningParserManager, ReasoningParserManager.reasoning_parsers),
    }


def register_parsers(force: bool = False) -> list[str]:
    """Make `--tool-call-parser ling3` / `--reasoning-parser ling3` resolve to our classes.

    Stands aside where vLLM already registers `ling3` (every supported release) unless `force`.
    Idempotent. Returns the names that resolve to our classes afterwards, e.g.
    ["tool:ling3", "reasoning:ling3"]; [] when vLLM's own parsers stay in place.
    """
    ours = []
    for kind, (manager, imported) in _registries().items():
        entry = (_MODULE, _CLASSES[kind])
        if manager.lazy_parsers.get(NAME) != entry:
            if NAME in manager.list_registered() and not force:
                continue
            imported.pop(NAME, None)
            manager.register_lazy_module(NAME, *entry)
        ours.append(f"{kind}:{NAME}")
    return ours
