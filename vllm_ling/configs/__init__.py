"""The bundled config.json files (package data), located inside the installed package.

`ling-3.0-flash-int4/` holds Ling-3.0-flash-int4's config.json (with its `quantization_config`) and
generation_config.json: the field set of the tiny checkpoints, the input of the byte projection, and,
written into a folder, a model vLLM serves with `--load-format dummy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLASH_INT4_DIR = Path(__file__).parent / "ling-3.0-flash-int4"


def flash_config() -> dict[str, Any]:
    """The bundled Ling-3.0-flash-int4 config.json, parsed."""
    return json.loads((FLASH_INT4_DIR / "config.json").read_text())
