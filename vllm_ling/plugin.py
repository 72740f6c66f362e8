"""`register()`: what vLLM runs in every process to learn about Ling V3 (vllm-integration.md §A)."""

from __future__ import annotations

import logging

from vllm_ling import compat
from vllm_ling.config import ARCH, MTP_ARCH, BailingMoeV3Config

logger = logging.getLogger("vllm_ling")

_registered: str | None = None


def _route_logs_through_vllm() -> None:
    """Our `vllm_ling.*` loggers write through vLLM's handlers, so their lines land in the server log."""
    ours, theirs = logging.getLogger("vllm_ling"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def register() -> str:
    """Register Ling V3 with vLLM; return which implementation serves ("vllm-ling" or "vllm").

    Idempotent and CUDA-free: model classes are registered as lazy "module:Class" strings.
    """
    global _registered
    if _registered is not None:
        return _registered
    from vllm import ModelRegistry

    _route_logs_through_vllm()

    from vllm_ling.parsers import register_parsers

    force = compat.force_requested()
    if compat.has_intree_ling3() and not force:
        _registered = "vllm"
        register_parsers(force=False)
        logger.info(
            "vllm-ling: vLLM %s has %s in-tree; vLLM's implementation serves "
            "(set VLLM_LING_FORCE=1 to serve with vllm-ling's).",
            compat.vllm_version(), ARCH,
        )
        return _registered

    compat.register_config_class(BailingMoeV3Config)
    ModelRegistry.register_model(ARCH, "vllm_ling.model:BailingMoeV3ForCausalLM")
    ModelRegistry.register_model(MTP_ARCH, "vllm_ling.mtp:BailingMoeV3MTPModel")
    compat.install_mtp_override()
    if compat.install_int4_moe_backend():
        logger.info("vllm-ling: INT4 experts go to vLLM's Triton/CUDA wna16 fused-MoE kernels (%s=triton), "
                    "not Marlin.", compat.MOE_BACKEND_ENV)
    register_parsers(force=force)
    _registered = "vllm-ling"
    logger.info(
        "vllm-ling: %s and its MTP draft are served by vllm-ling on vLLM %s%s.",
        ARCH, compat.vllm_version(), " (forced over the in-tree model)" if compat.has_intree_ling3() else "",
    )
    return _registered
