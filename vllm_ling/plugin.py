"""`register()`: what vLLM runs in every process to learn about Ling V3 (docs/vllm-seams.md §Plugin).

vLLM calls each general plugin's entry point bare, without a try (`load_general_plugins`, 0.32-0.34), so an
exception here would take vLLM down: every failure is caught, logged in one line, and vLLM goes on with its
own model.
"""

from __future__ import annotations

import logging

from vllm_ling import compat, envs, startup_log
from vllm_ling.config import ARCH, MTP_ARCH, BailingMoeV3Config

logger = logging.getLogger("vllm_ling")

_registered: str | None = None


def _route_logs_through_vllm() -> None:
    """Our `vllm_ling.*` loggers write INFO lines through vLLM's handlers, so they land in the server log (the
    self-check reads them). They still propagate: a vLLM server's root logger has no handlers (no line twice),
    and whatever an embedding program attaches to the root (pytest's log capture) sees them too."""
    ours, theirs = logging.getLogger("vllm_ling"), logging.getLogger("vllm")
    ours.setLevel(logging.INFO)
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)


def register() -> str:
    """Register Ling V3 with vLLM; return which implementation serves ("vllm-ling" or "vllm").

    Idempotent, CUDA-free (model classes are lazy "module:Class" strings) and never raises.
    """
    global _registered
    if _registered is None:
        _route_logs_through_vllm()
        try:
            _registered = _register()
        except Exception as e:  # noqa: BLE001 - vLLM must keep serving its own model
            logger.error("%s", startup_log.REGISTRATION_FAILED.text(error=f"{type(e).__name__}: {e}"))
            logger.debug("vllm-ling: registration traceback", exc_info=True)
            _registered = compat.VLLM
    return _registered


def _register() -> str:
    compat.declare_env_vars(envs.VARIABLES)  # before anything can turn the plugin off: they are set all the same
    on, note = compat.release_check()
    if note is not None:
        logger.warning(note)
    if not on:
        return compat.VLLM
    from vllm import ModelRegistry

    import vllm_ling.fp8  # noqa: F401  registers `--quantization ling_fp8`, whichever model serves
    from vllm_ling.parsers import register_parsers

    from vllm_ling import smem_guard

    serving, why = compat.serving_model()
    compat.register_config_class(BailingMoeV3Config)
    compat.install_dspark_draft_config()  # Ling's DSpark drafter onto vLLM's Qwen3 DSpark path (docs/dspark.md)
    compat.install_kv_block_copy_per_view()  # resumes inside a KV block copy every view (vLLM 0.32/0.33)
    smem_guard.install_once()  # GB10: KDA autotuners within 101,376 B, whichever model serves
    _install_moe_align()
    ours = serving == compat.OURS
    if ours:
        ModelRegistry.register_model(ARCH, "vllm_ling.model:BailingMoeV3ForCausalLM")
        ModelRegistry.register_model(MTP_ARCH, "vllm_ling.draft.mtp:BailingMoeV3MTPModel")
        ModelRegistry.register_model("LingDSparkModel", "vllm_ling.draft.dspark:LingDSparkForCausalLM")
    register_parsers(force=ours and compat.has_intree_ling3())
    who = compat.OURS if ours else startup_log.INTREE
    logger.info("%s", startup_log.REGISTERED.text(arch=ARCH, who=who, version=compat.vllm_version(), why=why,
                                                  env=compat.MODEL_ENV))
    return serving


def _install_moe_align() -> None:
    """Our MoE token alignment, if asked (VLLM_LING_MOE_ALIGN=ours), whichever model serves. A value we do not
    know is logged as an error and vLLM's own op stays: a speed option must not stop a server from starting."""
    from vllm_ling.ops import moe_align

    try:
        moe_align.install()
    except ValueError as e:
        logger.error("%s; serving with vLLM's MoE alignment op", e)
