"""The bundled config.json files (package data), located inside the installed package.

`ling-3.0-flash-int4/` holds Ling-3.0-flash-int4's config.json and generation_config.json: the field set
and values of the tiny checkpoints, the defaults of our config class, the input of the byte projection,
and, written into a folder, a model vLLM serves with `--load-format dummy`.

Where config.json comes from (docs/architecture.md §Config): every key but `quantization_config` is the
released BF16 Ling-3.0-flash config.json, key for key and value for value, as a public verbatim copy of it
shows (75 keys, including `auto_map`, which names the checkpoint's own `configuration_bailing_moe_v3.py`,
and `transformers_version` "4.45.0"); `quantization_config` is ours: the INT4 release's
compressed-tensors block as we reconstructed it (pack-quantized W4A16, symmetric, group 32, every
non-expert Linear in `ignore`; docs/architecture.md §INT4), not a copy of the release's file, which we have
not read. The file is sorted by key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FLASH_INT4_DIR = Path(__file__).parent / "ling-3.0-flash-int4"


def flash_config() -> dict[str, Any]:
    """The bundled Ling-3.0-flash-int4 config.json, parsed."""
    return json.loads((FLASH_INT4_DIR / "config.json").read_text())
