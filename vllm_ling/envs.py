"""The served plugin's environment variables, each declared once (as vLLM's own `vllm/envs.py`): name, type,
default, meaning and the modules that read it. `envs.VLLM_LING_FP8_KERNEL` returns the parsed value;
docs/configuration.md is generated from `VARIABLES` (`python3 -m ling_tools.configuration`), and
tests/test_settings.py fails when the code reads a variable declared nowhere.

A setting read while vLLM builds the model can change the graph torch.compile traces (VLLM_LING_KDA_GATE does),
but vLLM's compile-cache key hashes only vLLM's own settings (`vllm.envs.compile_factors`) and the config. So
every choice read under a current vLLM config is also written into that config's `additional_config`, which the
key hashes: an engine started with another value compiles afresh. Without it, an engine loaded a graph traced
for the other KDA gate from the cache and failed at its first step (H200, 2026-12-01).

Standard library only at import (`vllm.config` is imported when a choice is read in this process): the
self-check reads a server's environment through it (`read(name, env)`, `raw`) without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

COMPILE_KEY = "vllm_ling"  # additional_config[COMPILE_KEY] = {setting: value read while the model was built}


@dataclass(frozen=True, slots=True)
class Variable:
    """One environment variable: how it is spelled, parsed and documented."""

    name: str
    type: str  # "choice" | "flag" | "path" | "bytes" | "patterns"
    default: str  # as it would be spelled in the environment; "" = unset
    meaning: str
    readers: tuple[str, ...]  # the modules that read it, or set it for the engine they start
    choices: tuple[str, ...] = ()
    safe: str | None = None  # what to do instead, in a refusal of a value not among `choices`


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


_FP8_SAFE = "unset it for the default ({}), or serve without --quantization ling_fp8 for BF16 weights"

VARIABLES: dict[str, Variable] = _declare(
    Variable("VLLM_LING_MODEL", "choice", "auto",
             "Which implementation of BailingMoeV3ForCausalLM serves: `auto` (the faster one on this vLLM release, "
             "compat.py's table), `vllm-ling` (this plugin's) or `vllm` (vLLM's in-tree one).",
             ("vllm_ling.compat", "ling_bench.fullsize", "serve/serve-int4.sh"), ("auto", "vllm-ling", "vllm")),
    Variable("VLLM_LING_FORCE", "flag", "0",
             "`1` = VLLM_LING_MODEL=vllm-ling when VLLM_LING_MODEL is `auto` (the older spelling, kept).",
             ("vllm_ling.compat", "ling_tools.demo")),
    Variable("VLLM_LING_FP8_KERNEL", "choice", "w8a8",
             "With `--quantization ling_fp8`: `w8a8` (FP8 weights and per-token dynamic FP8 activations) or "
             "`w8a16` (FP8 weights, BF16 activations, FP8-Marlin).",
             ("vllm_ling.fp8", "ling_bench.fullsize", "serve/serve-int4.sh"),
             ("w8a16", "w8a8"), _FP8_SAFE.format("w8a8")),
    Variable("VLLM_LING_FP8_SCHEME", "choice", "block",
             "With `--quantization ling_fp8`: `block` (128 x 128 weight blocks, 1 x 128 activation groups) or "
             "`channel` (per-channel weight scales).",
             ("vllm_ling.fp8", "ling_bench.fullsize", "serve/serve-int4.sh"),
             ("block", "channel"), _FP8_SAFE.format("block")),
    Variable("VLLM_LING_FP8_KEEP", "patterns", "",
             "With `--quantization ling_fp8`: more vLLM module-name patterns (fnmatch, comma-separated, e.g. "
             "`lm_head,*.o_proj`) that stay BF16, besides `*.kv_b_proj` and `*.eh_proj`.",
             ("vllm_ling.fp8",)),
    Variable("VLLM_LING_KDA_GATE", "choice", "kernel",
             "Who computes KDA's gate and beta: `kernel` (inside vLLM's KDA kernels) or `ours` (our ops before "
             "them). The CPU path computes it with our ops either way.",
             ("vllm_ling.kda", "ling_tools.selfcheck", "ling_bench.fullsize"), ("ours", "kernel")),
    Variable("VLLM_LING_KDA_PREFILL_CHECKPOINT", "flag", "1",
             "With the prefix cache, KDA layers declare in-prefill checkpoints where their prefill kernel writes "
             "them (our torch path on the CPU engine, FlashKDA on CUDA; not Triton chunk_kda): the state at the "
             "last block boundary before a prompt's end is written inside the prefill pass, so vLLM no longer "
             "ends a pass there (one pass fewer a turn; an H200's cached 61K+2K turn 0.41 -> 0.28 s to its first "
             "token, docs/speed.md §In-prefill checkpoints), with MTP too; never with DSpark, whose smaller KV block "
             "makes vLLM lose each prompt's last hashed position with them (docs/dspark.md §Prefix cache). `0` = "
             "vLLM's own boundary pass.",
             ("vllm_ling.kda", "ling_watchdog.preflight", "ling_tools.selfcheck")),
    Variable("VLLM_LING_ROUTER", "choice", "ours",
             "The MoE router: `ours` (one Triton kernel) or `vllm` (vLLM's grouped_topk).",
             ("vllm_ling.ops.routing", "ling_bench.fullsize"), ("ours", "vllm")),
    Variable("VLLM_LING_ROUTER_GEMM", "choice", "ours",
             "The router's logits: `ours` (our kernel up to 16 rows) or `vllm` (vLLM's GateLinear).",
             ("vllm_ling.ops.router_gemm", "ling_bench.fullsize"), ("ours", "vllm")),
    Variable("VLLM_LING_MOE_ALIGN", "choice", "vllm",
             "MoE token alignment: `vllm` (vLLM's CUDA op) or `ours` (our kernel at decode sizes), whichever "
             "model serves. A value not among the choices is logged and vLLM's op stays.",
             ("vllm_ling.plugin", "vllm_ling.ops.moe_align", "ling_bench.fullsize"), ("vllm", "ours")),
    Variable("VLLM_LING_DRAFT_VOCAB", "path", "",
             "With MTP: a draft vocabulary file (`python3 -m ling_tools.draft_vocab`); the draft proposes among "
             "its tokens only. Unset: the draft reads the whole LM head.",
             ("vllm_ling.draft.vocab_file", "ling_tools.selfcheck", "ling_bench.fullsize", "serve/serve-int4.sh")),
    Variable("LING_SMEM_LIMIT", "bytes", "",
             "Shared memory per block, in bytes, to assume instead of the GPU's (101376 = GB10): emulates a "
             "smaller GPU on a bigger one for the KDA autotune guard and ling-tune.",
             ("vllm_ling.smem", "ling_tuning.smem")),
)


def raw(name: str, env: Mapping[str, str] | None = None) -> str:
    """The declared variable's text in `env` (this process's environment unless given), stripped; "" if unset."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in vllm_ling/envs.py")
    return (os.environ if env is None else env).get(name, "").strip()


def asked(name: str, env: Mapping[str, str] | None = None) -> str:
    """What `env` asks of a declared variable, lower-cased, its default when unset: unchecked and unrecorded
    (what a tool reports or passes on; the plugin reads through `read`)."""
    return raw(name, env).lower() or VARIABLES[name].default


def choice(name: str, choices: Sequence[str], default: str, safe: str | None = None) -> str:
    """$name, lower-cased; `default` when unset or blank. Any other value is refused with the setting, the
    value, the choices and the safe alternative (`safe`, or unsetting it)."""
    asked = os.environ.get(name, default).strip().lower() or default
    if asked not in choices:
        raise ValueError(f"vllm-ling: {name}={asked!r} is not one of {', '.join(choices)}; "
                         f"{safe or f'unset it for the default ({default})'}")
    into_compile_key(name, asked)
    return asked


def _choice(v: Variable, env: Mapping[str, str] | None) -> str:
    if env is not None:
        return asked(v.name, env)
    return choice(v.name, v.choices, v.default, v.safe)


def _flag(v: Variable, env: Mapping[str, str] | None) -> bool:
    return (raw(v.name, env) or v.default).lower() in ("1", "true", "yes")


def _path(v: Variable, env: Mapping[str, str] | None) -> str | None:
    return raw(v.name, env) or None


def _bytes(v: Variable, env: Mapping[str, str] | None) -> int | None:
    value = raw(v.name, env)
    if not value:
        return None
    if not value.isdigit() or int(value) <= 0:
        raise ValueError(f"{v.name}={value!r} must be a positive number of bytes (GB10: 101376)")
    return int(value)


def _patterns(v: Variable, env: Mapping[str, str] | None) -> tuple[str, ...]:
    text = (os.environ if env is None else env).get(v.name, "")
    if env is None:
        into_compile_key(v.name, text)  # which linears are FP8 shapes the traced graph
    return tuple(p.strip() for p in text.split(",") if p.strip())


_PARSERS: dict[str, Callable[[Variable, Mapping[str, str] | None], Any]] = {
    "choice": _choice, "flag": _flag, "path": _path, "bytes": _bytes, "patterns": _patterns}


def read(name: str, env: Mapping[str, str] | None = None) -> Any:
    """The parsed value of a declared variable, from `env` or (None) this process's environment. Read from this
    process, a choice is checked and, like the FP8 keep patterns, recorded in the compile-cache key."""
    v = VARIABLES[name]
    return _PARSERS[v.type](v, env)


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def into_compile_key(name: str, value: str) -> None:
    """Record a setting read while the model is built in the current vLLM config's compile-cache key."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and isinstance(config.additional_config, dict):
        config.additional_config.setdefault(COMPILE_KEY, {})[name] = value
