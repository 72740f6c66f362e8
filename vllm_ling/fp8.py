"""Online FP8 for the BF16 remainder of a checkpoint: `--quantization ling_fp8` (docs/speed.md §FP8, §FP8 schemes).

A batch-1 decode step of the INT4 checkpoint reads ~7.75 GB, 6.3 GB of it BF16 weights the checkpoint leaves
unquantized (KDA projections, MLA, shared experts, dense MLPs, the LM head); only the routed experts are INT4.
This quantization config wraps the checkpoint's own one (compressed-tensors INT4 experts, or none for a BF16
checkpoint) and gives every linear it leaves unquantized, and the LM head, FP8 e4m3 weights computed at load.
Because it is a quantization config, it works for whichever model class serves: vLLM's in-tree Ling V3 and
ours build their linears and LM head from vLLM's layers, which ask the config for their method.

Two scale schemes, chosen by `VLLM_LING_FP8_SCHEME` (DEFAULT_SCHEME; docs/speed.md §FP8 schemes has why):
- `block`: one fp32 scale per 128 x 128 weight block, s_b = max_{(c,k) in b} |W_ck| / 448, W8 = e4m3(W / s_b),
  and (w8a8) per-token dynamic activation scales per group of 128 inputs: inclusionAI's own FP8 release of
  Ling-3.0-flash (the DeepSeek-V3 scheme), the one measured on real weights. vLLM's online block method
  (`Fp8PerBlockOnlineLinearMethod`, vLLM 0.32-0.34) quantizes; on CUDA vLLM picks its block GEMM (CUTLASS,
  DeepGEMM or Triton) or, for `w8a16`, FP8-Marlin; on the CPU our `TorchBlockFp8Kernel` computes the same numbers.
- `channel`: one fp32 scale per output channel, s_c = max_k |W_ck| / 448, and (w8a8) one per token.
Two kernels, chosen by `VLLM_LING_FP8_KERNEL` (docs/speed.md §FP8 has the measurement behind the default):
- `w8a8` (default): dynamic FP8 activations on vLLM's scaled-mm kernels (CUTLASS on CUDA, sm_89+; vLLM ships
  sm_120 kernels, which a GB10's sm_121 runs); one small quant kernel per linear on top of the GEMM.
  On the H200 (channel) it took the step's BF16 linears from 2.68 to 2.29 ms (M = 1).
- `w8a16`: FP8-Marlin, weight-only (activations stay BF16). Slower than BF16 on the H200 at decode sizes
  (3.08 ms, channel), kept for GPUs without FP8 tensor cores.
Kept BF16: MLA's kv_b_proj (vLLM splits it into W_UK/W_UV and absorbs it), the MTP draft's eh_proj, a DSpark
drafter's Markov projection `markov_w2` when vLLM reads it by gathered rows (`gathered_rows`), any
linear whose output per rank is not a multiple of 16 (`ALIGN`: vLLM's CUTLASS FP8 kernel pads such a weight
and asserts on the padding with per-channel scales; only MLA's head-wise gate, num_heads wide, is that narrow, a
few KB of weight), under `block` any linear whose input per rank is not a multiple of 128 (`BLOCK`: vLLM's block
GEMMs take whole 1 x 128 activation groups; no Ling-3.0 linear is one, at TP 1 or 2), and anything else the
checkpoint quantizes (its method wins). An output width that is no multiple of 128 is served as vLLM serves
DeepSeek-V3's 576-wide kv_a: the last block of rows is partial (its scale covers the rows that exist). A merged
linear is one weight, so its blocks run across its parts (KDA's q|k|v|β|f|g: β's num_heads rows shift f and g off
the block grid). Router and norms are fp32 and no linears of this config's (the router's ReplicatedLinear gets no
quant config).

The DSpark drafter's own weights take this config through the speculative config's own quantization
(`--speculative-config '{"method": "dspark", ..., "quantization": "ling_fp8"}'`: vLLM builds the drafter with the
draft model config's quantization, never the target's; docs/dspark.md §Draft FP8). Its linears (q|k|v, o, gate|up,
down, fc) and the Markov head's `markov_w2`, a ParallelLMHead read as an LM head, are then FP8; its confidence head
(built without a quant config) and the LM head and embedding it shares with the target are not this config's.
"""

from __future__ import annotations

import fnmatch
import functools
import logging
from typing import Any

import torch

# Light imports only: this module is imported by `register()` in every vLLM process, before any model exists.
from vllm.model_executor.layers.quantization import get_quantization_config, register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase

from vllm_ling import envs, startup_log

logger = logging.getLogger("vllm_ling")

NAME = "ling_fp8"
KERNEL_ENV = "VLLM_LING_FP8_KERNEL"
KEEP_ENV = "VLLM_LING_FP8_KEEP"
KERNELS, DEFAULT_KERNEL = envs.VARIABLES[KERNEL_ENV].choices, envs.VARIABLES[KERNEL_ENV].default
SCHEME_ENV = "VLLM_LING_FP8_SCHEME"
# block is the default: docs/speed.md §FP8 schemes, no less accurate on the CPU measurement
SCHEMES, DEFAULT_SCHEME = envs.VARIABLES[SCHEME_ENV].choices, envs.VARIABLES[SCHEME_ENV].default
BLOCK = 128  # `block`: weight blocks BLOCK x BLOCK, activation groups 1 x BLOCK
# Module name patterns (the vLLM-side prefix) that stay BF16 whatever the kernel.
KEEP_BF16 = ("*.kv_b_proj", "*.eh_proj")
ALIGN = 16  # FP8 linears' output width per rank must be a multiple of this (module docstring)
MARKOV_W2 = "*.markov_w2"  # vLLM's DSpark Markov head's r -> V projection (a ParallelLMHead)


def requested_kernel() -> str:
    """`w8a8` (per-token dynamic activations) or `w8a16` (FP8-Marlin), from VLLM_LING_FP8_KERNEL."""
    return envs.read(KERNEL_ENV)


def requested_scheme() -> str:
    """`block` (128 x 128 weight blocks, 1 x 128 activation groups) or `channel`, from VLLM_LING_FP8_SCHEME."""
    return envs.read(SCHEME_ENV)


def keeps_bf16(prefix: str, model_keeps: tuple[str, ...] = ()) -> bool:
    """KEEP_BF16, what the served model's config keeps (`gathered_rows`) and the operator's VLLM_LING_FP8_KEEP
    patterns (fnmatch, on vLLM's module names)."""
    extra = envs.read(KEEP_ENV)  # also enters the compile-cache key: which linears are FP8 shapes the graph
    return any(fnmatch.fnmatchcase(prefix, pattern) for pattern in (*KEEP_BF16, *model_keeps, *extra))


def gathered_rows(hf_config: Any) -> tuple[str, ...]:
    """The modules a model reads by gathering rows of their `.weight`, which an FP8 weight cannot serve.

    vLLM's Qwen3 DSpark drafter with `dspark_draft_topk` (the speculative config's, or the drafter config's; vLLM
    writes it on the drafter's hf_config) applies the Markov bias to the top-k candidates only: it indexes
    `markov_w2.weight[index]` and raises on a weight whose dtype is not the activations' (qwen3_dspark
    `apply_bias_gathered`, 0.32-0.34), so its markov_w2 stays BF16 then. Without it the head runs through the
    logits processor, as an LM head does, which serves FP8."""
    return (MARKOV_W2,) if getattr(hf_config, "dspark_draft_topk", None) is not None else ()


class FreshSegments:
    """Quantizes each linear into a fresh allocation, so the weight memory FP8 saves is not lost to the allocator.

    vLLM loads the model under `max_split_size_mb=20` (its GPU worker scopes the caching allocator so while
    loading). The allocator then never splits a cached block for a request of 20 MiB or more, and serves it from
    any cached block up to 20 MiB larger. The previous layer's quantization leaves a 64 MiB fp32 chunk cached, so a
    KDA `in_proj` FP8 weight of Ling-3.0-flash (50 MiB) took that block whole: ~14 MiB lost per layer, counted
    as weight memory while the weight lives. Emptying the cache first gives the new weight a segment of its own
    size: 67.61 -> 67.33 GiB on the H200 (docs/speed.md §FP8). Mixed in ahead of vLLM's FP8 methods.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        super().process_weights_after_loading(layer)  # type: ignore[misc]


def fp8_method(kernel: str, scheme: str = "channel") -> QuantizeMethodBase:
    """A fresh FP8 linear method for one layer: vLLM's online method of `scheme`, on Marlin for `w8a16`."""
    return _method_classes()[scheme, kernel]()


def dequantize_blocks(w8: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """W = W8 · s_b in fp32, s_b broadcast over its block: scale [ceil(N / block), ceil(K / block)], w8 [N, K]."""
    n, k = w8.shape
    return w8.float() * scale.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


@functools.cache
def _torch_block_kernels() -> dict[str, type]:
    """vLLM's block GEMM as plain torch, for the CPU engine (class TorchBlockFp8Kernel's docstring)."""
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )

    class TorchBlockFp8Kernel(Fp8BlockScaledMMLinearKernel):
        """y = (x8 · s_x)(W8 · s_b)ᵀ in fp32: the numbers of vLLM's block-FP8 GEMM, dequantize-then-matmul.

        Serves the block scheme on the CPU, where vLLM's own block kernels need AMX (Sapphire Rapids and newer)
        and, lacking AMX-FP8, fall back to weight-only: one path computes the same numbers on every CPU, which
        the CPU tests compare with the plain-torch reference (tests/model/oracle.py). vLLM's QuantFP8 rounds the
        input per token per group of 128 (s_x = max(max|x_g| / 448, 1 / (448 · 512))) before this is called.
        """

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return True, None

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                                  Bs: torch.Tensor) -> torch.Tensor:
            k = A.shape[-1]
            a = A.float() * As.float().repeat_interleave(BLOCK, -1)[..., :k] if self.apply_input_quant else A.float()
            return a @ dequantize_blocks(B, Bs).t()

    class TorchBlockFp8W8A16Kernel(TorchBlockFp8Kernel):
        """The same with the input as it comes (weight-only, the block scheme's `w8a16` on the CPU)."""

        apply_input_quant = False

    return {"w8a8": TorchBlockFp8Kernel, "w8a16": TorchBlockFp8W8A16Kernel}


def _block_kernel(kernel: str) -> type | None:
    """The block GEMM to force: ours on the CPU, FP8-Marlin for `w8a16` on CUDA, else None (vLLM's choice)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return _torch_block_kernels()[kernel]
    if kernel == "w8a16":
        from vllm.model_executor.kernels.linear.scaled_mm import MarlinFP8ScaledMMLinearKernel

        return MarlinFP8ScaledMMLinearKernel
    return None


@functools.cache
def _method_classes() -> dict[tuple[str, str], type]:
    """The four method classes, (scheme, kernel) -> class, built once (vLLM's FP8 modules load only when a model
    asks for FP8)."""
    from vllm.model_executor.kernels.linear import init_fp8_linear_kernel
    from vllm.model_executor.kernels.linear.scaled_mm import MarlinFP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PerBlockOnlineLinearMethod as PerBlock
    from vllm.model_executor.layers.quantization.online.fp8 import Fp8PtpcOnlineLinearMethod as Ptpc

    class Fp8W8A8LinearMethod(FreshSegments, Ptpc):
        """Per-output-channel FP8 weights, per-token dynamic FP8 activations: vLLM's PTPC online method."""

    class Fp8W8A16LinearMethod(FreshSegments, Ptpc):
        """Per-output-channel FP8 weights on vLLM's FP8-Marlin kernel; activations stay in the model dtype.

        Weight quantization, layout and loading are vLLM's W8A8 method's (`Fp8PtpcOnlineLinearMethod`); only
        the kernel differs: Marlin dequantizes the FP8 weight in registers, reading half the bytes of BF16.
        """

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                           output_partition_sizes: list[int], input_size: int, output_size: int,
                           params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            # The online base (meta-device weight, quantized once loaded), skipping the W8A8 kernel choice.
            super(Ptpc, self).create_weights(layer, input_size_per_partition, output_partition_sizes, input_size,
                                             output_size, params_dtype, **extra_weight_attrs)
            self.fp8_linear = init_fp8_linear_kernel(
                activation_quant_key=self.activation_quant_key, weight_quant_key=self.weight_quant_key,
                weight_shape=layer.weight.shape, input_dtype=self.input_dtype, out_dtype=self.out_dtype,
                force_kernel=MarlinFP8ScaledMMLinearKernel, module_name=type(self).__name__)

    class Fp8BlockLinearMethod(FreshSegments, PerBlock):
        """128 x 128 weight blocks, per-token-group (1 x 128) dynamic activations: vLLM's online block method
        (`per_block_cast_to_fp8` at load), on the GEMM `_block_kernel` forces for `kernel` (module docstring)."""

        kernel = "w8a8"

        def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                           output_partition_sizes: list[int], input_size: int, output_size: int,
                           params_dtype: torch.dtype, **extra_weight_attrs: Any) -> None:
            # The online base (meta-device weight), then vLLM's block kernel choice with ours forced where it must be.
            super(PerBlock, self).create_weights(layer, input_size_per_partition, output_partition_sizes,
                                                 input_size, output_size, params_dtype, **extra_weight_attrs)
            layer.weight_block_size = self.weight_block_size
            self.fp8_linear = init_fp8_linear_kernel(
                activation_quant_key=self.activation_quant_key, weight_quant_key=self.weight_quant_key,
                weight_shape=layer.weight.shape, input_dtype=self.input_dtype, out_dtype=self.out_dtype,
                force_kernel=_block_kernel(self.kernel), module_name=type(self).__name__)

    class Fp8BlockW8A16LinearMethod(Fp8BlockLinearMethod):
        """128 x 128 weight blocks, activations in the model dtype (FP8-Marlin on CUDA)."""

        kernel = "w8a16"

    return {("channel", "w8a8"): Fp8W8A8LinearMethod, ("channel", "w8a16"): Fp8W8A16LinearMethod,
            ("block", "w8a8"): Fp8BlockLinearMethod, ("block", "w8a16"): Fp8BlockW8A16LinearMethod}


def _is_linear(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.linear import LinearBase

    return isinstance(layer, LinearBase)


def _bf16_linear() -> QuantizeMethodBase:
    """What a linear without a checkpoint config gets (vLLM's linears refuse a None method)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    return UnquantizedLinearMethod()


def _fp8_candidate(layer: torch.nn.Module, base: QuantizeMethodBase | None, scheme: str) -> bool:
    """A linear or the LM head that the checkpoint's own config leaves unquantized, and `scheme` can serve."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    unquantized = base is None or isinstance(base, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))
    if not unquantized or not isinstance(layer, (LinearBase, ParallelLMHead)):
        return False
    return (isinstance(layer, ParallelLMHead) or _aligned(layer)) and (scheme != "block" or _whole_groups(layer))


def _aligned(layer: torch.nn.Module) -> bool:
    """Output width per rank a multiple of ALIGN (vLLM's linears set their partition sizes before they ask
    the quantization config for a method)."""
    return sum(getattr(layer, "output_partition_sizes", None) or [layer.output_size]) % ALIGN == 0


def _whole_groups(layer: torch.nn.Module) -> bool:
    """Input width per rank a multiple of BLOCK (`block`: vLLM's block GEMMs quantize whole 1 x BLOCK groups)."""
    return getattr(layer, "input_size_per_partition", layer.input_size) % BLOCK == 0


@register_quantization_config(NAME)
class LingFp8Config(QuantizationConfig):
    """The checkpoint's quantization (or none) plus online FP8 for what it leaves in BF16 (module docstring).

    `fp8_layers` records every prefix that got an FP8 method, so the start-up log and the self-check can say
    `FP8 weights ON (N linears + LM head)`.
    """

    def __init__(self, checkpoint: QuantizationConfig | None = None, kernel: str | None = None,
                 scheme: str | None = None) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.kernel = kernel or requested_kernel()
        self.scheme = scheme or requested_scheme()
        self.fp8_layers: list[str] = []
        self.model_keeps: tuple[str, ...] = ()  # what the served model's config keeps BF16 (`gathered_rows`)

    # vLLM writes the model's packed_modules_mapping onto the config; the checkpoint's config matches fused
    # modules (KDA's in_proj = q|k|v|b|f|g) against its ignore list through it.
    @property
    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return self._packed

    @packed_modules_mapping.setter
    def packed_modules_mapping(self, value: dict[str, list[str]]) -> None:
        self._packed = value
        if getattr(self, "checkpoint", None) is not None:
            self.checkpoint.packed_modules_mapping = value

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 75  # FP8-Marlin runs from sm_75; the W8A8 kernel checks its own (sm_89+)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LingFp8Config:
        """`config` is the checkpoint's quantization_config (e.g. compressed-tensors INT4 experts)."""
        method = config.get("quant_method")
        if not method or method == NAME:
            return cls()
        return cls(get_quantization_config(method).from_config(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """`--quantization ling_fp8` on a checkpoint that carries its own quantization_config: ours wraps it."""
        return NAME if user_quant == NAME else None

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """vLLM hands every quantization config its model's hf_config once built (0.32-0.34
        `VllmConfig._get_quantization_config`, for the target and, through `get_draft_quant_config`, the drafter):
        the modules that model reads by gathered rows stay BF16 (`gathered_rows`)."""
        self.model_keeps = gathered_rows(hf_config)
        if self.checkpoint is not None:
            self.checkpoint.maybe_update_config(model_name, hf_config=hf_config, revision=revision)

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        if self.checkpoint is not None:
            self.checkpoint.apply_vllm_mapper(hf_to_vllm_mapper)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        base = self.checkpoint.get_quant_method(layer, prefix) if self.checkpoint is not None else None
        if not _fp8_candidate(layer, base, self.scheme) or keeps_bf16(prefix, self.model_keeps):
            return base if base is not None or not _is_linear(layer) else _bf16_linear()
        self.fp8_layers.append(prefix)
        # The LM head comes last in every Ling V3 model: the count is complete. A DSpark drafter's Markov head is no
        # LM head of a Ling model: the drafter logs its own line once built (`dspark_summary`).
        if not _is_linear(layer) and not fnmatch.fnmatchcase(prefix, MARKOV_W2):
            logger.info("%s", self.summary())
        return fp8_method(self.kernel, self.scheme)

    def get_cache_scale(self, name: str) -> str | None:
        return self.checkpoint.get_cache_scale(name) if self.checkpoint is not None else None

    def summary(self) -> str:
        """`vllm-ling: FP8 weights ON (N linears + LM head), w8a8, block scales` (startup_log.FP8_ON)."""
        heads = sum(p.endswith("lm_head") for p in self.fp8_layers)
        head = startup_log.FP8_HEAD_ON if heads else startup_log.FP8_HEAD_BF16
        return startup_log.FP8_ON.text(linears=len(self.fp8_layers) - heads, head=head, kernel=self.kernel,
                                       scheme=self.scheme)

    def dspark_summary(self) -> str:
        """`vllm-ling: DSpark drafter FP8 weights ON (N linears + Markov head), w8a8, block scales`
        (startup_log.DSPARK_FP8_ON), logged by the drafter once built: its own line, so the self-check reads the
        target's FP8_ON line as before and the drafter's apart."""
        markov = sum(fnmatch.fnmatchcase(p, MARKOV_W2) for p in self.fp8_layers)
        return startup_log.DSPARK_FP8_ON.text(
            linears=len(self.fp8_layers) - markov, kernel=self.kernel, scheme=self.scheme,
            markov=startup_log.DSPARK_MARKOV_ON if markov else startup_log.DSPARK_MARKOV_BF16)
