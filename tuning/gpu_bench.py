"""The CUDA runner: one MoE layer of random INT4 experts, in both layouts vLLM serves them.

* wna16 (CUDA `moe_wna16_gemm` / Triton `fused_moe_kernel_gptq_awq`): w13 uint8 [E, 2N, hidden/2],
  w2 uint8 [E, hidden, N/2], low nibble = even k, code c means (c - 8)·scale; scales bf16
  [E, out, in/group]. These are the checkpoint's compressed-tensors bytes, viewed as uint8.
* Marlin: the same codes GPTQ-packed ([E, in/8, out] int32) and passed through vLLM's own
  `gptq_marlin_moe_repack` and `marlin_moe_permute_scales`, as its weight loader does.

Correctness: each config runs on two fixed input sets against a float32 reference dequantized from
the same codes; two sets, because a kernel that writes nothing would otherwise pass on the previous
config's stale output. Timing: a CUDA graph of `rotations` calls, each with its own inputs and
routing (so L2 cannot keep the experts between calls), replayed; median per call.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ling_tuning.runner import REL_TOL, DeviceInfo, Measured, NoDevice
from ling_tuning.shapes import MoEShape
from ling_tuning.smem import device_smem_limit
from ling_tuning.space import Config, config_key, uses_cuda_kernel
from ling_tuning.vllm_check import tuned_folder, vllm_file_name

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # x [M, hidden] bf16, ids [M, k] int32, w [M, k] fp32


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2]: element 2j in the low nibble, 2j+1 in the high."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def gptq_pack(codes: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """[E, out, in] codes -> GPTQ [E, in/8, out] int32 (vLLM pack_rows: row 8j+i at bits 4i)."""
    e, n, k = codes.shape
    out = torch.empty((e, k // 8, n), dtype=torch.int32, device=codes.device)
    for e0 in range(0, e, chunk):
        t = codes[e0:e0 + chunk].transpose(1, 2).to(torch.int32)
        acc = torch.zeros_like(t[:, 0::8])
        for i in range(8):
            acc |= t[:, i::8] << (4 * i)
        out[e0:e0 + chunk] = acc
    return out


def dequantize(packed: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """float32 weights of one expert: (code - 8) * scale of its group along the reduction axis."""
    return (unpack_nibbles(packed).float() - 8) * scales.float().repeat_interleave(group, dim=-1)


def reference_moe(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor,
                  w2: torch.Tensor, s2: torch.Tensor, group: int) -> torch.Tensor:
    """float32 MoE from the packed codes: out_t = sum_k w_tk · W2_e (SiLU(G_e x_t) ⊙ U_e x_t), e = ids_tk,
    with w13 = [G; U] stacked along the output axis (vLLM's silu_and_mul order)."""
    n = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], device=x.device, dtype=torch.float32)
    for e in ids.unique().tolist():
        rows, slot = (ids == e).nonzero(as_tuple=True)
        h = x[rows].float() @ dequantize(w13[e], s13[e], group).T
        a = F.silu(h[:, :n]) * h[:, n:]
        out.index_add_(0, rows, (a @ dequantize(w2[e], s2[e], group).T) * w[rows, slot, None])
    return out


def copy_bandwidth_gbs(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy, counting bytes read + written (the bandwidth ceiling a measurement is held to)."""
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times) / 1e9


class CudaRunner:
    """`ling_tuning.runner.Runner` on the current CUDA device, through vLLM's own kernels."""

    def __init__(self, shape: MoEShape, seed: int = 0, rotations: int = 16, replays: int = 7):
        if not torch.cuda.is_available():
            raise NoDevice("ling-tune measures on a CUDA GPU and none is visible here "
                           "(run it on the Spark; tests drive the CLI with a fake runner)")
        import triton
        import vllm
        from vllm_ling import compat
        from vllm.model_executor.layers.fused_moe import fused_moe as fm
        from vllm.model_executor.layers.fused_moe import override_config
        from vllm.model_executor.layers.fused_moe.config import int4_w4a16_moe_quant_config
        from vllm.model_executor.layers.quantization.utils.marlin_utils import (
            marlin_make_workspace_new,
            marlin_moe_permute_scales,
        )
        from vllm.scalar_type import scalar_types

        self.shape, self.seed, self.rotations, self.replays = shape, seed, rotations, replays
        self._fm, self._override = fm, override_config
        self.timing_mode = "cuda_graph"
        self.meta = {"rotations": rotations, "replays": replays, "seed": seed, "method": "cuda_graph_rotating_routing"}
        self._smem_seen: dict[str, int] = {}
        self._inputs: dict[tuple[str, int], Any] = {}
        torch.manual_seed(seed)
        self.dev = dev = torch.device("cuda", torch.cuda.current_device())  # vLLM sizes workspaces by index
        e, n, k, g = shape.num_experts, shape.intermediate, shape.hidden, shape.group_size

        def codes(rows: int, cols: int) -> torch.Tensor:
            return torch.randint(0, 16, (e, rows, cols), dtype=torch.uint8, device=dev)

        def scales(rows: int, cols: int) -> torch.Tensor:  # ~1/50 keeps every activation O(1)
            return (torch.rand(e, rows, cols // g, device=dev) * 0.02 + 0.005).to(torch.bfloat16)

        q13, q2 = codes(2 * n, k), codes(k, n)
        self.s13, self.s2 = scales(2 * n, k), scales(k, n)
        self.w13, self.w2 = pack_nibbles(q13), pack_nibbles(q2)
        self.quant = int4_w4a16_moe_quant_config(w1_scale=self.s13, w2_scale=self.s2, w1_zp=None, w2_zp=None,
                                                 block_shape=[0, g])
        # Marlin: GPTQ layout, then vLLM's repack and scale permutation (oracle/int_wna16.py).
        self.mw13 = compat.marlin_moe_repack(gptq_pack(q13), k, 2 * n, 4)
        self.mw2 = compat.marlin_moe_repack(gptq_pack(q2), n, k, 4)
        del q13, q2
        self.ms13 = marlin_moe_permute_scales(self.s13.transpose(1, 2).contiguous(), k, 2 * n, g)
        self.ms2 = marlin_moe_permute_scales(self.s2.transpose(1, 2).contiguous(), n, k, g)
        self.ws = marlin_make_workspace_new(dev, 4)
        self.uint4b8 = scalar_types.uint4b8.id
        torch.cuda.synchronize()
        self.device = DeviceInfo(
            name=torch.cuda.get_device_name(), smem_limit=device_smem_limit(honour_env=False),
            copy_gbs=copy_bandwidth_gbs(), triton_version=triton.__version__, vllm_version=vllm.__version__,
            vllm_file_name=vllm_file_name(shape))

    # ---- inputs and reference -------------------------------------------------------------------
    def _make_inputs(self, m: int, seed: int) -> Inputs:
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        s, dev = self.shape, self.dev
        x = torch.randn(m, s.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(m, s.num_experts, device=dev, generator=gen).topk(s.top_k, dim=1).indices
        w = torch.randn(m, s.top_k, device=dev, generator=gen).softmax(dim=1)
        return x, ids.to(torch.int32).contiguous(), w.float().contiguous()

    def _sets(self, kind: str, m: int) -> Any:
        """Input sets for batch size m, kept for the current m only (large M sets are big)."""
        if (kind, m) not in self._inputs:
            self._inputs = {key: v for key, v in self._inputs.items() if key[1] == m}
            base = self.seed * 1_000_003 + m * 101
            if kind == "check":
                sets = [self._make_inputs(m, base + i) for i in range(2)]
                self._inputs[(kind, m)] = [(inp, self._reference(*inp)) for inp in sets]
            else:
                self._inputs[(kind, m)] = [self._make_inputs(m, base + 7 + i) for i in range(self.rotations)]
        return self._inputs[(kind, m)]

    def _reference(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return reference_moe(x, ids, w, self.w13, self.s13, self.w2, self.s2, self.shape.group_size)

    # ---- calls ----------------------------------------------------------------------------------
    def _triton_call(self, config: Config | None) -> Callable[..., torch.Tensor]:
        fm, quant, override = self._fm, self.quant, self._override

        def call(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            with override(config) if config is not None else nullcontext():
                return fm.fused_experts(x, self.w13, self.w2, w, ids, global_num_experts=self.shape.num_experts,
                                        quant_config=quant)
        return call

    def _marlin_call(self) -> Callable[..., torch.Tensor]:
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe

        def call(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return fused_marlin_moe(x, self.mw13, self.mw2, None, None, self.ms13, self.ms2, w, ids,
                                    quant_type_id=self.uint4b8, global_num_experts=self.shape.num_experts,
                                    workspace=self.ws)  # 0.33/0.34: no is_k_full
        return call

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def _check(self, call: Callable[..., torch.Tensor], m: int) -> float:
        worst = 0.0
        for (x, ids, w), ref in self._sets("check", m):
            out = call(x, ids, w)
            self._sync()  # surface asynchronous launch errors here, not later
            err = ((out.float() - ref).norm() / ref.norm()).item()
            worst = max(worst, err if err == err else float("inf"))
        return worst

    def _time(self, call: Callable[..., torch.Tensor], m: int) -> float:
        sets = self._sets("time", m)
        if self.timing_mode == "cuda_graph":
            try:
                return self._time_graph(call, sets)
            except Exception as e:  # capture unsupported here: time plain launches instead
                torch.cuda.synchronize()
                self.timing_mode = f"events (graph capture failed: {type(e).__name__}: {e})"[:200]
        return self._time_events(call, sets)

    def _time_graph(self, call: Callable[..., torch.Tensor], sets: list[Inputs]) -> float:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for inp in sets[:2]:
                call(*inp)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for inp in sets:
                call(*inp)
        graph.replay()
        times = []
        for _ in range(self.replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / len(sets))
        del graph
        return statistics.median(times)

    def _time_events(self, call: Callable[..., torch.Tensor], sets: list[Inputs]) -> float:
        for inp in sets[:2]:
            call(*inp)
        times = []
        for _ in range(self.replays):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for inp in sets:
                call(*inp)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e3 / len(sets))
        return statistics.median(times)

    def _compiled_kernels(self) -> list[Any]:
        fn = self._fm.fused_moe_kernel_gptq_awq
        out = []
        for entry in getattr(fn, "device_caches", {}).values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            out += list(cache.values()) if isinstance(cache, dict) else []
        return out

    def _compiled_smem(self, before: set[int], config: Config | None) -> int | None:
        """Shared memory of the Triton kernels this config compiled (None on the CUDA kernel)."""
        new = [k for k in self._compiled_kernels() if id(k) not in before]
        sizes = [getattr(getattr(k, "metadata", None), "shared", None) for k in new]
        sizes = [s for s in sizes if isinstance(s, int)]
        key = config_key(config) if config else ""
        if sizes:
            self._smem_seen[key] = max(sizes + [self._smem_seen.get(key, 0)])
        return self._smem_seen.get(key)

    # ---- the Runner protocol ---------------------------------------------------------------------
    def triton(self, m: int, config: Config | None, folder: Path | None = None) -> Measured:
        call = self._triton_call(config)
        with tuned_folder(folder) if config is None else nullcontext():
            before = {id(k) for k in self._compiled_kernels()}
            err = self._check(call, m)
            smem = None if uses_cuda_kernel(m, self.shape) else self._compiled_smem(before, config)
            if not err <= REL_TOL:
                return Measured(None, err, smem)
            return Measured(self._time(call, m), err, smem)

    def marlin(self, m: int) -> Measured:
        call = self._marlin_call()
        err = self._check(call, m)
        return Measured(self._time(call, m) if err <= REL_TOL else None, err)

    def experts_touched(self, m: int) -> float:
        sets = self._sets("time", m)
        return sum(ids.unique().numel() for _, ids, _ in sets) / len(sets)


def kda_guard_demo(smem_limit: int, seq_len: int = 2048, heads: int = 32, head_dim: int = 128) -> dict[str, Any]:
    """Guard vLLM's vendored FLA autotuners to `smem_limit`, run one KDA prefill (Ling's head
    layout, the varlen path vLLM uses) and report what each autotuner kept, dropped and chose.

    On an H200, `smem_limit=101376` emulates GB10: dropped configs were compiled (never launched)
    and measured over the limit; every chosen config must be within it."""
    from vllm_ling import smem_guard
    from vllm.third_party.flash_linear_attention.ops.kda import chunk_kda

    log = smem_guard.install(smem_limit)
    torch.manual_seed(0)
    t, h, d, dev = seq_len, heads, head_dim, "cuda"
    q, k, v = (torch.randn(1, t, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    g = -5.0 * torch.rand(1, t, h, d, device=dev)  # log decay in [lower_bound, 0], fp32
    beta = torch.rand(1, t, h, device=dev)
    h0 = torch.zeros(1, h, d, d, device=dev)
    cu = torch.tensor([0, t], device=dev, dtype=torch.int32)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    torch.cuda.synchronize()
    kernels, over = {}, []
    for module in smem_guard.fla_modules():
        for name, tuner in smem_guard.autotuners(module):
            seen = log.kernels.get(name, {"kept": {}, "dropped": {}})
            chosen = [str(c) for c in tuner.cache.values()]
            sizes = [seen["kept"].get(c, {}).get("smem") for c in chosen]
            over += [(name, c, s) for c, s in zip(chosen, sizes, strict=True) if s is not None and s > smem_limit]
            if chosen or seen["dropped"]:
                kernels[name] = {"configs": len(tuner.configs), "kept": len(seen["kept"]),
                                 "dropped": seen["dropped"], "chosen": dict(zip(chosen, sizes, strict=True)),
                                 "max_kept_smem": max((x["smem"] or 0 for x in seen["kept"].values()), default=None)}
    return {"smem_limit": smem_limit, "seq_len": t, "heads": h, "head_dim": d,
            "output_finite": bool(o.isfinite().all() and ht.isfinite().all()),
            "chosen_over_limit": over, "ok": not over, "kernels": kernels}
