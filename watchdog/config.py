"""Watchdog settings: one flat dataclass, resolved as defaults.yaml < --config files < flags.

defaults.yaml is the single source of the default values; this module only types and checks them.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DEFAULTS = Path(__file__).with_name("defaults.yaml")
MEMORY_MODELS = ("auto", "unified", "discrete", "cpu")


class ConfigError(ValueError):
    """A setting is unknown or out of range; the message names the value and the safe range."""


@dataclass(slots=True)
class Config:
    # logs
    log_dir: str
    log_max_mb: float
    log_backups: int
    # loading
    load_stall_s: float
    busy_cpu_percent: float
    cpu_busy_s: float
    load_silent_s: float
    load_timeout_s: float
    # warm-up
    ready_timeout_s: float
    warmup_grace_s: float
    # serving
    url: str | None
    probe_interval_s: float
    health_timeout_s: float
    liveness_timeout_s: float
    fail_threshold: int
    traffic_log_s: float
    spec_break_even: float | None
    # relaunch
    kill_grace_s: float
    max_relaunches: int
    stable_after_s: float
    backoff_initial_s: float
    backoff_max_s: float
    burst_failures: int
    burst_window_s: float
    # host memory
    guard_floor_fraction: float
    guard_floor_gib: float | None
    guard_floor_below_start_mb: float | None
    memory_poll_s: float
    memory_log_s: float
    # after the server first serves
    after_serving: str | None
    after_serving_timeout_s: float
    release_fraction: float
    release_floor_gib: float | None
    release_timeout_s: float
    # preflight
    force: bool
    long_context_tokens: int
    max_util: float
    max_util_long_context: float
    max_batched_tokens_long_context: int
    small_smem_bytes: int
    max_spec_tokens_small_smem: int
    max_seqs_small_smem: int
    gpu_smem_bytes: int | None
    memory_model: str
    model_max_context: int
    weights_gib: float
    kv_bytes_per_token: int
    draft_kv_bytes_per_token: int
    state_bytes_per_seq: int
    dspark_params: int
    dspark_kv_bytes_per_token: int
    dspark_block_size: int
    flashkda_bytes_per_tile: int
    overhead_gib: float
    host_reserve_gib: float

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{f.name}={value} is negative; use a value >= 0")
        for name in ("guard_floor_fraction", "release_fraction", "max_util", "max_util_long_context"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a fraction in (0, 1]")
        if self.fail_threshold < 1:
            raise ConfigError(f"fail_threshold={self.fail_threshold} must be >= 1 (1 = no retry)")
        if self.burst_failures < 1:
            raise ConfigError(f"burst_failures={self.burst_failures} must be >= 1")
        if self.memory_model not in MEMORY_MODELS:
            raise ConfigError(f"memory_model={self.memory_model!r} is not one of {MEMORY_MODELS}")
        if self.spec_break_even is not None and self.spec_break_even < 1:
            raise ConfigError(f"spec_break_even={self.spec_break_even} is a mean accepted length, bonus token "
                              f"included: use a value >= 1 (ling_bench.projection --break-even), or null")
        if self.busy_cpu_percent > 100:
            raise ConfigError(f"busy_cpu_percent={self.busy_cpu_percent} is per CPU: use <= 100")


def field_types() -> dict[str, type]:
    """The scalar type of each field (`float | None` -> float), for YAML coercion and flags."""
    out = {}
    for name, hint in typing.get_type_hints(Config).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = args[0] if isinstance(hint, types.UnionType) else hint
    return out


_KIND_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string"}


def _coerce(name: str, value: Any, kind: type) -> Any:
    if value is None or isinstance(value, kind):
        return value
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, str):
        if value.lower() in ("true", "yes", "1", "on"):
            return True
        if value.lower() in ("false", "no", "0", "off"):
            return False
    try:
        if kind is float or kind is str:
            return kind(value)
        if kind is int and float(value).is_integer():
            return int(float(value))
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"{name}={value!r} is not {_KIND_NAMES[kind]}")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping of key: value, got {type(data).__name__}")
    return data


def load_config(files: list[str | Path] = (), overrides: Mapping[str, Any] | None = None) -> Config:
    """defaults.yaml, then each file, then `overrides` (flags; None values mean "not given")."""
    kinds = field_types()
    merged: dict[str, Any] = {}
    for layer in [_read_yaml(DEFAULTS), *(_read_yaml(Path(f)) for f in files), overrides or {}]:
        for key, value in layer.items():
            if key not in kinds:
                near = difflib.get_close_matches(key, kinds, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"unknown setting {key!r}{hint}")
            if layer is not overrides or value is not None:
                merged[key] = _coerce(key, value, kinds[key])
    missing = set(kinds) - set(merged)
    if missing:
        raise ConfigError(f"defaults.yaml lacks {sorted(missing)}")
    return Config(**merged)
