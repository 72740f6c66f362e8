"""Keep vLLM's vendored FLA (KDA) Triton autotuners inside the device's shared memory (docs/ops-walls.md W6).

vLLM's vendored `vllm/third_party/flash_linear_attention/ops/*.py` autotune over fixed config lists
(num_stages up to 4-5, BK/BV up to 128); only chunk_o/cumsum shrink theirs, via `check_shared_mem()`,
whose 102,400 B threshold GB10's 101,376 B just misses. On GB10, KDA's stage-3/4 configs need
133-139 KB: autotuning them mid-serve failed and wedged the box. Triton compiles a config without
launching it (`warmup`), and the compiled kernel knows its shared memory (`metadata.shared`), so:

`install(limit)` walks every Autotuner in those modules (through `@triton.heuristics` wrappers)
and chains an `early_config_prune` that compiles each config and drops any over `limit` before
the autotuner benchmarks (launches) anything. The compiled kernels stay in Triton's cache, so the
benchmark that follows compiles nothing twice. Optionally `max_stages` also removes deeper
pipelines up front. No vLLM file is edited; calling it again replaces the previous guard.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

logger = logging.getLogger("vllm_ling")

FLA_OPS = "vllm.third_party.flash_linear_attention.ops"
KDA_ENTRY = FLA_OPS + ".kda"
# If compiling to measure fails (a Triton API change), fall back to the field fix: stages <= 2.
FALLBACK_MAX_STAGES = 2

SmemProbe = Callable[[Any, Any, dict, dict], int]


@dataclass
class GuardLog:
    """What the guard saw per kernel: configs it kept and dropped, with compiled sizes."""

    limit: int
    kernels: dict[str, dict[str, Any]] = field(default_factory=dict)

    def note(self, kernel: str, cfg: Any, smem: int | None, kept: bool, why: str = "") -> None:
        k = self.kernels.setdefault(kernel, {"kept": {}, "dropped": {}})
        k["kept" if kept else "dropped"][str(cfg)] = {"smem": smem, **({"why": why} if why else {})}


def compile_smem(tuner: Any, cfg: Any, nargs: dict, kwargs: dict) -> int:
    """Compile `cfg` for these exact arguments without launching; its shared memory in bytes."""
    call = {**nargs, **{k: v for k, v in kwargs.items() if k != "warmup"}, **cfg.all_kwargs()}
    call.setdefault("grid", (1,))
    kernel = tuner.fn.run(warmup=True, **call)
    if hasattr(kernel, "result"):  # Triton's async-compile future
        kernel = kernel.result()
    return int(kernel.metadata.shared)


class SmemPrune:
    """early_config_prune: the user's prune first, then drop configs compiled over the limit."""

    def __init__(self, tuner: Any, name: str, limit: int, log: GuardLog, user: Callable | None,
                 probe: SmemProbe = compile_smem):
        self.tuner, self.name, self.limit, self.log, self.user, self.probe = tuner, name, limit, log, user, probe

    def __call__(self, configs: list, nargs: dict, **kwargs: Any) -> list:
        if self.user is not None:
            configs = self.user(configs, nargs, **kwargs)
        sized = []
        for cfg in configs:
            try:
                smem: int | None = self.probe(self.tuner, cfg, nargs, kwargs)
                fits = smem <= self.limit
                why = "" if fits else f"compiled {smem} B > {self.limit} B"
            except Exception as e:  # cannot measure: keep only shallow pipelines
                smem, fits = None, cfg.num_stages <= FALLBACK_MAX_STAGES
                why = f"probe failed ({type(e).__name__}); num_stages {cfg.num_stages} vs cap {FALLBACK_MAX_STAGES}"
            self.log.note(self.name, cfg, smem, fits, why)
            sized.append((cfg, smem, fits))
        kept = [c for c, _, fits in sized if fits]
        if not kept:  # the autotuner needs one; the smallest is the only one with a chance
            cfg = min(sized, key=lambda t: t[1] if t[1] is not None else float("inf"))[0]
            logger.error("%s: no config fits %d B of shared memory; keeping %s", self.name, self.limit, cfg)
            kept = [cfg]
        return kept


def _autotuner_types() -> tuple[type, type]:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface

    return Autotuner, KernelInterface


def autotuners(module: ModuleType) -> Iterator[tuple[str, Any]]:
    """(name, Autotuner) for each kernel in `module`, looking through Heuristics wrappers."""
    autotuner, kernel_interface = _autotuner_types()
    for name, obj in vars(module).items():
        seen: set[int] = set()
        while isinstance(obj, kernel_interface) and id(obj) not in seen:
            seen.add(id(obj))
            if isinstance(obj, autotuner):
                yield f"{module.__name__.rsplit('.', 1)[-1]}.{name}", obj
                break
            obj = getattr(obj, "fn", None)


def fla_modules() -> list[ModuleType]:
    """vLLM's vendored FLA op modules that KDA uses: import the KDA entry point, then take every
    module of the package it pulled in (no other module is imported: some register custom ops)."""
    importlib.import_module(KDA_ENTRY)
    prefix = FLA_OPS + "."
    return [m for name, m in sorted(sys.modules.items()) if name.startswith(prefix) and m is not None]


def install(smem_limit: int, max_stages: int | None = None, modules: Iterable[ModuleType] | None = None,
            probe: SmemProbe = compile_smem) -> GuardLog:
    """Guard every autotuned kernel in `modules` (default: vLLM's FLA ops) to `smem_limit` bytes.

    Idempotent: the original config list and prune hook are kept on the Autotuner and restored
    before a new guard is applied. Autotune results already cached are cleared, since they may
    have been chosen from configs the guard now removes."""
    if smem_limit <= 0:
        raise ValueError(f"smem_limit={smem_limit} must be a positive number of bytes (GB10: 101376)")
    log = GuardLog(smem_limit)
    seen: set[int] = set()
    for module in fla_modules() if modules is None else modules:
        for name, tuner in autotuners(module):
            if id(tuner) in seen:
                continue
            seen.add(id(tuner))
            if not hasattr(tuner, "_ling_configs"):
                tuner._ling_configs, tuner._ling_user_prune = list(tuner.configs), tuner.early_config_prune
            configs = list(tuner._ling_configs)
            if max_stages is not None:
                shallow = [c for c in configs if c.num_stages <= max_stages]
                for c in configs:
                    if c not in shallow:
                        log.note(name, c, None, False, f"num_stages {c.num_stages} > {max_stages}")
                configs = shallow or [min(configs, key=lambda c: c.num_stages)]
            tuner.configs = configs
            tuner.early_config_prune = SmemPrune(tuner, name, smem_limit, log, tuner._ling_user_prune, probe)
            tuner.cache.clear()
            log.kernels.setdefault(name, {"kept": {}, "dropped": {}})
    return log


_installed: GuardLog | None = None


def install_once() -> GuardLog | None:
    """The plugin's hook, from `register()` in every process: on a GPU with at most GB10's shared memory per block
    (or with LING_SMEM_LIMIT set) guard vLLM's vendored KDA autotuners, whichever Ling model serves; on bigger
    GPUs (the H200) nothing changes. Once per process; never needs a CUDA context."""
    global _installed
    if _installed is not None:
        return _installed
    from vllm_ling.smem import GB10_SMEM_PER_BLOCK, platform_smem_limit

    limit = platform_smem_limit()
    if limit is None or limit > GB10_SMEM_PER_BLOCK:
        return None
    try:
        _installed = install(limit)
    except ImportError as e:  # no vendored FLA ops in this vLLM
        logger.info("vllm-ling: KDA shared-memory guard not installed: %s", e)
        return None
    logger.info("vllm-ling: KDA Triton autotune configs limited to %d B of shared memory per block (W6)", limit)
    return _installed
