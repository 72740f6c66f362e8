"""What a module's source may import, read with `ast` (no import runs): shared by the plugin's import check
(tests/model/test_plugin_imports.py) and the packages' import graph (tests/test_import_graph.py)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator


def imported_names(source: str, name: str, is_package: bool,
                   lazy: re.Pattern[str] | None = None) -> Iterator[tuple[str, int]]:
    """(module name, line) for every import anywhere in `source`, inside functions too: `import a.b`, `from a
    import b` (a, and a.b in case b is a module), relative imports resolved against module `name`; with `lazy`,
    also each string constant it matches whole, a "module[:Class]" target loaded later by name."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base, node.lineno
            yield from ((f"{base}.{a.name}", node.lineno) for a in node.names if a.name != "*")
        elif lazy is not None and isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and lazy.fullmatch(node.value):
            yield node.value.partition(":")[0], node.lineno
