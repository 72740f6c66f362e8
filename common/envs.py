"""The tools' own environment variables, each declared once, in the style of the plugin's `vllm_ling/envs.py`
(`envs.LING_WATCHDOG_CONFIG` returns the parsed value). The plugin's variables are declared there: the plugin
imports nothing of ours, and the tools here may not import the plugin (the watchdog), so each side keeps its
own registry; docs/configuration.md lists both, and tests/test_settings.py checks that every variable the code
reads is declared in one of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable: how it is spelled, parsed and documented."""

    name: str
    type: str  # "path" | "paths"
    default: str  # what applies when unset, in words
    meaning: str
    readers: tuple[str, ...]  # the modules that read it


VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("LING_WATCHDOG_CONFIG", "path", "unset (watchdog/defaults.yaml only)",
             "A YAML file of watchdog options read before any `--config` file (the command line wins over both; "
             "watchdog/defaults.yaml lists every option).", ("ling_watchdog.cli",)),
    Variable("LING_TINY_DIR", "path", "~/.cache/vllm-ling",
             "Where the tiny test checkpoints (`python3 -m ling_tools.tiny`, `ensure_tiny`) are cached.",
             ("ling_tools.tiny.cache",)),
)}


def raw(name: str, env: Mapping[str, str] | None = None) -> str:
    """The declared variable's text in `env` (this process's environment unless given), stripped; "" if unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in ling_common/envs.py")
    return (os.environ if env is None else env).get(name, "").strip()


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """A path, or None when unset."""
    value = raw(name, env)
    return Path(value).expanduser() if value else None


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
