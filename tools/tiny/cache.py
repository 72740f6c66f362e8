"""The tiny-checkpoint cache: built once per (seed, int4, variant, GENERATOR_VERSION), reused after."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ling_common import envs
from ling_tools.tiny.writer import STAMP_FILE, make_tiny_checkpoint, stamp

CACHE_ENV = "LING_TINY_DIR"


def cache_root() -> Path:
    """`$LING_TINY_DIR` if set, else ~/.cache/vllm-ling."""
    return envs.read(CACHE_ENV) or Path.home() / ".cache" / "vllm-ling"


def default_tiny_dir(*, seed: int = 0, int4: bool = False, variant: str = "default") -> Path:
    """Cache location: `cache_root() / tiny-<variant>-<int4|bf16>-seed<N>`."""
    return cache_root() / f"tiny-{variant}-{'int4' if int4 else 'bf16'}-seed{seed}"


def _is_current(path: Path, expected: dict[str, Any]) -> bool:
    try:
        return json.loads((path / STAMP_FILE).read_text()) == expected
    except (OSError, ValueError):
        return False


def ensure_tiny(*, seed: int = 0, int4: bool = False, variant: str = "default") -> Path:
    """Return the cached tiny checkpoint, building it first if absent or stale. The build goes to a
    temporary sibling that is renamed into place, so a concurrent or interrupted build never leaves a
    half-written model at the final path."""
    final = default_tiny_dir(seed=seed, int4=int4, variant=variant)
    expected = stamp(seed, int4, variant, None)
    if _is_current(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_tiny_checkpoint(tmp, seed=seed, int4=int4, variant=variant)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the final dir should read like any model dir
        if final.exists():  # stale: move it aside first (rename is atomic, rmtree is not)
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, old / "stale")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    except OSError:
        if not _is_current(final, expected):  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
