"""Full-size Ling-3.0-flash speed with random weights (`load_format=dummy`): one engine configuration per run.

    ling-make-tiny /tmp/flash --full-config        # the bundled config.json, no weights
    python -m ling_bench.fullsize /tmp/flash --mode graphs --out graphs.json    # eager | graphs | mtp | dspark
    python -m ling_bench.fullsize /tmp/flash --impl vllm --fp8 w8a16 --kernels    # vLLM's model, FP8, profiled
    python -m ling_bench.fullsize /tmp/flash --mode mtp --k 3 --prefill= --acceptance-length 3.5,2.5
    python -m ling_bench.fullsize /tmp/flash --mode dspark --k 8 --adaptive --prefill= --acceptance-length 6.5,5.3,3.5
    python -m ling_bench.fullsize /tmp/flash --mode dspark --fp8 w8a8 --draft-fp8 --prefill= --acceptance-length 5.3

Batch 1, token-id prompts (no tokenizer ships with the bundled config). Reports prefill tok/s at each
--prefill length (time of a 1-token request), decode tok/s (the extra time of `--decode` more tokens) after a
short prompt and after each --prefill prompt (long-context decode: does it hold up at 64K?), peak GPU
memory, and the bytes a decode step reads (counted from config.json by `ling_bench.projection`) against
this GPU's device-to-device copy bandwidth measured in the same run, the weight memory vLLM reports ("Model
loading took"), the cudagraph mode, and with --kernels the CUDA kernels and GPU time per decode step (torch
profiler, graph-replayed kernels included; per generated token, and `per_round` in speculative modes).

Speculative decoding, `--k N` draft tokens a round: `mtp` (the checkpoint's MTP layer, k = 1..3, default 1) and
`dspark` (Ling's DSpark drafter, K = 1..8, default 8, the drafter's block; `--adaptive` for vLLM's confidence-driven
verification width, which vLLM 0.34 serves for this model only on compute capability 10.x). DSpark drafts with a dummy
drafter of the released one's shape (5 layers, hidden 2,560, 32/32 heads, block 8, Markov rank 256, target layers 1,
11, 23, 29, 35: `ling_bench.projection.dspark_config`), a folder with only its config.json: vLLM gives the draft the
target's load format, so it gets dummy weights too. `--draft-fp8` serves the drafter's own weights in FP8
(`"quantization": "ling_fp8"` in its speculative config: its linears and Markov head, docs/dspark.md §Draft FP8), on
`--fp8`'s kernel and scheme when given, else vllm_ling.fp8's defaults; `--fp8` alone leaves the drafter BF16, as vLLM
builds it with its own quantization, never the target's. With dummy weights real acceptance is meaningless, so on vLLM
>= 0.32 `--acceptance-length L` has the engine accept drafts synthetically (its `rejection_sample_method: synthetic`,
L in [1, k + 1]) and tokens/s is measured at a given mean accepted length; `--acceptance-length 6.5,5.3,3.5` measures
each in turn on one engine (vLLM holds the rates as a device tensor its rejection sampler reads every step; it is
refilled in place with the rates vLLM computes for that L and k, `vllm_ling.compat.synthetic_conditional_rates`). Each
phase reports decode tok/s, the round (one engine step: the draft and the target's verify of k + 1 tokens) in ms and
the tokens a round yields (accepted + 1, from vLLM's spec-decode counters) with the share accepted at each position;
`refill_rates_match_engine` says whether the refill's rates for the first L equal those vLLM built for it; the
drafter's weights are `drafter_weight_gib`. A round's cost over a plain step is its ms over a `--mode graphs` run's
`decode_step_ms`. On a GPU, `round_split` times the round's two phases apart with vLLM's own step timing: the target's
forward over k + 1 tokens and the drafter's propose, by CUDA events over dummy rounds.

Lanes: `--lanes 1,2,4,8` also decodes that many requests together after the batch-1 phases (the engine admits
max(lanes) sequences), each lane count's step in ms, per-request and aggregate tok/s (a round's tokens counted, so
speculative modes too). `--smem-limit 101376` holds every Triton kernel the process launches to a GB10's shared
memory per block (`ling_tuning.smem.emulate_launch_limit`, with the KDA autotune guard at the same limit through
LING_SMEM_LIMIT) and records the most each kernel asked for: a kernel over the limit fails the run as it would
fail a Spark (CUDA kernels are not emulated).

Agent turns: `--turn 32768+2048` turns the prefix cache on and times an agent's turn, 2,048 new tokens after a
32,768-token history the cache holds, against the same length prefilled fresh, and the decode step after each
(`ling_bench.cached_turn`; with --kernels the CUDA kernels of each); it needs `--prefill=`.

Which model serves: `--impl ours|vllm` (VLLM_LING_MODEL), or `vllm-bare` (vLLM as installed, no plugin at all:
VLLM_PLUGINS=none). `--fp8 w8a16|w8a8` serves with `--quantization ling_fp8` (`--fp8-scheme block|channel`: its
scales, VLLM_LING_FP8_SCHEME; vllm_ling.fp8's default when not given); `--moe-backend
marlin|humming|triton` picks the INT4 expert kernels (whole-step Humming vs Marlin). Runs the engine in-process,
so one configuration per process: vLLM does not give GPU memory back between engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path

from ling_bench.cached_turn import parse_turns, turn_phase
from ling_bench.projection import DSPARK
from ling_common.device import ADAPTIVE_VERIFICATION_FROM_VLLM, ADAPTIVE_VERIFICATION_MLA_MAJORS, ROOMY_CARD_GIB
from ling_tuning.engine_compare import BACKENDS as MOE_BACKENDS  # vLLM >= 0.28's --moe-backend for INT4 experts
from ling_tuning.step_kernels import kernels_per_step, timed
from vllm_ling import compat, envs
from vllm_ling.draft import vocab_file as draft_vocab_file  # the draft vocabulary file (--draft-vocab)
from vllm_ling.fp8 import KERNELS as FP8_KERNELS
from vllm_ling.fp8 import KERNEL_ENV as FP8_KERNEL_ENV
from vllm_ling.fp8 import NAME as FP8_NAME
from vllm_ling.fp8 import SCHEME_ENV as FP8_SCHEME_ENV
from vllm_ling.fp8 import SCHEMES as FP8_SCHEMES
from vllm_ling.ops.moe_align import ALIGN_ENV, ALIGNS  # our MoE token layout or vLLM's op (--moe-align)
from vllm_ling.kda import CHECKPOINT_ENV  # in-prefill KDA checkpoints, as the environment asks (recorded)
from vllm_ling.kda_core import GATE_ENV, GATES  # KDA gate: in vLLM's kernels or ours (--kda-gate)
from vllm_ling.ops.routing import ROUTER_ENV, ROUTERS  # our MoE router or vLLM's (--router)
from vllm_ling.ops.router_gemm import GEMM_ENV, GEMMS  # the router's logits: our kernel or GateLinear

MODES = {"eager": {"enforce_eager": True}, "graphs": {"enforce_eager": False}, "mtp": {"enforce_eager": False},
         "dspark": {"enforce_eager": False}}
# Draft tokens a round, per speculative mode: MTP the rounds ling_bench.projection compares (k = 1..3; the serve
# recipe ships k = 1), DSpark 1 up to the drafter's block (vllm_ling.draft.dspark refuses K beyond it).
SPEC_KS = {"mtp": range(1, 4), "dspark": range(1, DSPARK["dspark_block_size"] + 1)}
DEFAULT_K = {"mtp": 1, "dspark": DSPARK["dspark_block_size"]}


def copy_bandwidth_gbs(gib: float = 1.0, repeats: int = 10) -> float | None:
    """Device-to-device copy, read + write bytes per second (the roofline a decode step is held to): ling-tune's
    measurement of it, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from ling_tuning.gpu_bench import copy_bandwidth_gbs as measured

    gbs = measured(int(gib * 2**30), repeats)
    torch.cuda.empty_cache()
    return gbs


def step_bytes(config: dict, mode: str, context: int, k: int | None = None, fp8: bool = False,
               draft_fp8: bool | None = None) -> float:
    """Bytes one engine step reads, as ling_bench.projection counts them: a plain step, or a whole round (MTP: k
    draft passes and a verify of k + 1 tokens; DSpark: the drafter's pass over the block and a verify of K + 1).
    `draft_fp8`: the DSpark drafter's own matrices in FP8 (`--draft-fp8`), None: as the target's, the projection's
    reading. With a quantized drafter vLLM projects the context K/V through each layer's whole q|k|v
    (`_project_context_kv`'s unfused branch), which the count reads as the k|v rows only (0.10 GB of the full-size
    round in FP8 where 0.16 are read). Adaptive verification verifies fewer than K + 1 tokens when confidence is
    low: the count is the full round's."""
    from ling_bench.projection import decode_step_bytes, dspark_round_bytes, mtp_round_bytes

    if mode == "mtp":
        return mtp_round_bytes(config, context, k or 1, fp8=fp8).total
    if mode == "dspark":
        return dspark_round_bytes(config, context, k or DEFAULT_K["dspark"], fp8=fp8, draft_fp8=draft_fp8).total
    return decode_step_bytes(config, context, fp8=fp8).total


def roofline(model: str, mode: str, context: int, step_s: float, copy_gbs: float | None,
             accepted_per_step: float, fp8: bool = False, k: int | None = None,
             draft_fp8: bool | None = None) -> dict:
    """Bytes one engine step reads (`step_bytes`: a round with MTP or DSpark; FP8 weights under `--fp8`, the
    drafter's under `--draft-fp8`) and the share of the copy bandwidth that the measured step time reaches."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    read = step_bytes(config, mode, context, k, fp8, draft_fp8)
    engine_step_s = step_s * (1 + accepted_per_step)  # one engine step yields 1 + accepted tokens
    out = {"bytes_per_step_gb": read / 1e9, "engine_step_ms": 1e3 * engine_step_s,
           "achieved_gbs": read / engine_step_s / 1e9, "copy_gbs": copy_gbs}
    if copy_gbs:
        out["fraction_of_copy_bw"] = out["achieved_gbs"] / copy_gbs
    return out


def _progress(t0: float, what: str) -> None:
    """A line per phase on stderr: a run cut short by a time limit still shows how far it got."""
    print(f"[fullsize] {time.perf_counter() - t0:7.1f} s  {what}", file=sys.stderr, flush=True)


IMPLS = {"ours": {"VLLM_LING_MODEL": "vllm-ling"}, "vllm": {"VLLM_LING_MODEL": "vllm"},
         "vllm-bare": {"VLLM_PLUGINS": "none"}}


class _LogLines(logging.Handler):
    """Keeps the vLLM log lines the result quotes (kernel and backend choices, vllm-ling's own lines)."""

    WANTED = ("Selected ", "MoE backend", "cudagraph", "FP8 weights", "vllm-ling:", "DSpark")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if any(w in text for w in self.WANTED):
            self.lines.append(text[:300])


def length_problem(length: float, k: int) -> str | None:
    """Why a mean accepted length cannot be asked of a k-draft round, or None: a round yields the accepted drafts
    and the bonus token, 1 to k + 1 tokens (vLLM refuses the same range, in words that do not name the flag)."""
    if 1.0 <= length <= k + 1:
        return None
    return (f"--acceptance-length {length} at k={k}: a round yields 1 to k + 1 = {k + 1} tokens (the accepted "
            f"drafts and the bonus token), so L must lie in [1, {k + 1}]")


def check_spec(mode: str, k: int | None = None, adaptive: bool = False, lengths: list[float] | None = None,
               impl: str = "ours", draft_fp8: bool = False) -> int | None:
    """The draft tokens a round (`--k`, or the mode's default; None without drafts), after refusing what the run
    could not measure: before the engine starts, since a full-size start costs minutes. Raises ValueError."""
    if adaptive and mode != "dspark":
        raise ValueError("--adaptive is DSpark's confidence-driven verification width: it needs --mode dspark")
    if draft_fp8 and mode != "dspark":
        raise ValueError("--draft-fp8 serves the DSpark drafter's own weights in FP8 (its speculative config's "
                         "quantization): it needs --mode dspark (--fp8 is the target's)")
    if mode not in SPEC_KS:
        if k is not None:
            raise ValueError(f"--k {k} counts draft tokens a round: it needs --mode mtp or --mode dspark")
        if lengths:
            raise ValueError(f"--acceptance-length {','.join(map(str, lengths))} is the drafts' synthetic "
                             f"acceptance: it needs --mode mtp or --mode dspark")
        return None
    k = DEFAULT_K[mode] if k is None else k
    if k not in (ks := SPEC_KS[mode]):
        why = "up to the drafter's block size" if mode == "dspark" else "the MTP rounds the projection compares"
        raise ValueError(f"--mode {mode} --k {k}: k must lie in {ks.start}..{ks.stop - 1} ({why})")
    problems = [p for p in (length_problem(v, k) for v in lengths or []) if p]
    if problems:
        raise ValueError(problems[0])
    if mode == "dspark" and impl != "ours":
        raise ValueError(f"--mode dspark with --impl {impl}: the drafter reads the target's aux hidden states, which "
                         f"only vllm-ling's model provides (docs/dspark.md §Target). Use --impl ours")
    return k


def check_runtime(mode: str, adaptive: bool = False) -> None:
    """Refuse DSpark where this vLLM cannot run it (`compat.dspark_runtime_missing`: no runtime, or the CPU engine),
    and adaptive width before vLLM 0.34 or where no MLA backend serves it (ling_common.device), before
    minutes of start-up end in an error after the weights. Raises ValueError."""
    if mode == "dspark" and (missing := compat.dspark_runtime_missing()):
        raise ValueError(f"--mode dspark: {missing}")
    if adaptive and compat.vllm_version().release[:2] < ADAPTIVE_VERIFICATION_FROM_VLLM:
        raise ValueError(f"--adaptive: vLLM {compat.vllm_version()}'s GDN attention backend (Ling's KDA layers) does "
                         f"not take the device-side query lengths adaptive verification trims; vLLM "
                         f"{'.'.join(map(str, ADAPTIVE_VERIFICATION_FROM_VLLM))} does")
    if adaptive and ((capability := compat.cuda_capability()) is None
                     or capability[0] not in ADAPTIVE_VERIFICATION_MLA_MAJORS):
        raise ValueError(f"--adaptive: vLLM's adaptive verification needs an MLA attention backend that replays "
                         f"decode CUDA graphs of varying query length, which vLLM has only on compute capability "
                         f"{ADAPTIVE_VERIFICATION_MLA_MAJORS[0]}.x (FlashInfer MLA); this is {capability}")


CONTEXT_SLACK = 64  # tokens of max_model_len past the longest prompt and its decode


def check_turns(turns: list[tuple[int, int]] | None, prefill: list[int]) -> None:
    """Refuse --turn beside --prefill lengths: the engine then runs with the prefix cache on, and the prefill
    phase's repeats of one prompt would be served from it. Raises ValueError."""
    if turns and prefill:
        raise ValueError(f"--turn turns the prefix cache on, and --prefill {','.join(map(str, prefill))} times "
                         f"repeats of one prompt, which it would serve from the cache: pass --prefill= with --turn "
                         f"(run the prefill lengths in a run of their own)")


def check_context(prefill: list[int], decode: int, limit: int | None) -> None:
    """Refuse a prompt (a --prefill length, a --turn's history + new) whose decode would run past the model's
    context (`max_position_embeddings`): vLLM would refuse the engine's max_model_len only after imports. Raises
    ValueError."""
    longest = max(prefill, default=0) + decode + CONTEXT_SLACK
    if limit is not None and longest > limit:
        raise ValueError(f"a {max(prefill)}-token prompt (--prefill, or a --turn's history + new) with --decode {decode} "
                         f"needs {longest} tokens of context, over the model's {limit} (max_position_embeddings): use "
                         f"prompts of {limit - decode - CONTEXT_SLACK} tokens or less")


def _max_context(model: str) -> int | None:
    """The model folder's max_position_embeddings (None where it has no config.json to read)."""
    path = Path(model) / "config.json"
    return json.loads(path.read_text()).get("max_position_embeddings") if path.is_file() else None


def speculative_config(mode: str, k: int | None, acceptance_length: float | None = None, adaptive: bool = False,
                       drafter: str | None = None, draft_fp8: bool = False) -> dict | None:
    """The engine's `speculative_config` for a mode (None for a plain one): MTP with k drafts, or DSpark over
    `drafter` (a folder) with K drafts, FLASH_ATTN for the drafter and adaptive width on or off, the keys of vLLM's
    Ling recipe but its `draft_sample_method: probabilistic` (draft logits kept for sampled requests; this run
    decodes greedily), and with `draft_fp8` the drafter's own quantization ling_fp8 (vLLM builds a drafter with
    the draft model config's quantization, this key); with `acceptance_length`, synthetic acceptance at that mean
    accepted length."""
    if mode == "mtp":
        spec: dict = {"method": "mtp", "num_speculative_tokens": k or DEFAULT_K[mode]}
    elif mode == "dspark":
        if not drafter:
            raise ValueError("--mode dspark needs a drafter folder (write_dummy_drafter)")
        spec = {"method": "dspark", "model": drafter, "num_speculative_tokens": k or DEFAULT_K[mode],
                "attention_backend": "FLASH_ATTN", "enable_adaptive_verification": adaptive}
        if draft_fp8:
            spec["quantization"] = FP8_NAME
    else:
        return None
    if acceptance_length is not None:
        spec |= {"rejection_sample_method": "synthetic", "synthetic_acceptance_length": acceptance_length}
    return spec


def write_dummy_drafter(model: str) -> str:
    """A folder holding only the config.json of a DSpark drafter of the released one's shape for the target in
    `model` (ling_bench.projection.dspark_config). No weights: vLLM's DSpark loader builds the draft with
    `get_draft_load_config`, which (0.33, 0.34) hands back the target's load config unless it is `ipc_cache`, so the
    draft loads with load_format=dummy too; vLLM's DummyModelLoader fills each parameter in place and never calls
    the model's own load_weights, so LingDSparkForCausalLM's check for missing tensors (in its load_weights) does not
    run. Nor does the drafter's load_weights mark an lm_head or embedding of its own (`has_own_lm_head`), so vLLM
    installs the target's on the drafter, as it does for the released files, which hold neither."""
    import tempfile

    from ling_bench.projection import dspark_config

    with open(os.path.join(model, "config.json")) as f:
        target = json.load(f)
    folder = tempfile.mkdtemp(prefix="ling-fullsize-dspark-")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dspark_config(target), f, indent=1)
    return folder


def _engine_kwargs(mode: str, fp8: str | None, acceptance_length: float | None,
                   moe_backend: str | None = None, draft_vocab: int | None = None,
                   fp8_scheme: str | None = None, k: int | None = None, adaptive: bool = False,
                   drafter: str | None = None, draft_fp8: bool = False) -> dict:
    kwargs = dict(MODES[mode])
    spec = speculative_config(mode, k, acceptance_length, adaptive, drafter, draft_fp8)
    if spec is not None:
        kwargs["speculative_config"] = spec
    elif acceptance_length is not None:
        raise ValueError(f"--acceptance-length {acceptance_length} needs --mode mtp or --mode dspark")
    if draft_vocab:
        if mode != "mtp":
            raise ValueError(f"--draft-vocab {draft_vocab} is the MTP draft's: it needs --mode mtp")
        key = compat.draft_top_tokens_key()
        if key is None:
            raise ValueError("--draft-vocab needs a vLLM that asks the draft for its top token (0.32, 0.33)")
        kwargs["speculative_config"][key] = True
        os.environ[draft_vocab_file.ENV] = _first_ids_file(draft_vocab)
    if moe_backend:
        kwargs["moe_backend"] = moe_backend
    if fp8_scheme and not fp8:
        raise ValueError(f"--fp8-scheme {fp8_scheme} picks FP8's scales: it needs --fp8 w8a8|w8a16")
    if fp8:
        os.environ[FP8_KERNEL_ENV] = fp8
        if fp8_scheme:
            os.environ[FP8_SCHEME_ENV] = fp8_scheme
        kwargs["quantization"] = FP8_NAME
    return kwargs


def _first_ids_file(n: int) -> str:
    """A draft vocabulary of ids 0..n-1: on dummy weights which ids does not matter, only how many rows."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="ling-fullsize-"), "draft_vocab.json")
    with open(path, "w") as f:
        json.dump(draft_vocab_file.document(list(range(n))), f)
    return path


def model_shape(model) -> dict:
    """What the engine really built: the KDA projection width (32 heads x 128 = 4096 for Ling-3.0-flash) and the
    bytes of every parameter and buffer, by dtype (a wrong config class builds a smaller model that runs)."""
    from collections import Counter

    by_dtype: Counter = Counter()
    for t in [*model.parameters(), *model.buffers()]:
        by_dtype[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    kda = next((m for n, m in model.named_modules()
                if n.endswith("self_attn") and (hasattr(m, "in_proj") or hasattr(m, "f_proj"))), None)
    # ours: the q part of in_proj; vLLM's in-tree model: its f_proj
    width = kda.in_proj.output_sizes[0] if hasattr(kda, "in_proj") else \
        getattr(getattr(kda, "f_proj", None), "output_size", None)
    return {"kda_projection_width": width, "param_gib_by_dtype": {k: v / 2**30 for k, v in by_dtype.items()}}


def _tensors(value) -> list:
    """The tensors in an attribute: a tensor, or lists/tuples of them (vLLM keeps KV caches as lists)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def memory_breakdown(worker) -> dict:
    """Where the weight memory vLLM reports ("Model loading took", the model runner's `model_memory_usage`: torch's
    allocated bytes after loading minus before) goes: parameters and buffers of the model and the draft, and every
    other CUDA tensor a module holds as a plain attribute (absorbed MLA matrices, caches, workspaces), by name;
    the layers' `kv_cache` apart. Run in the worker (`llm.collective_rpc`). With CUDA, also the caching allocator's
    live blocks by owner (weights, KV cache, other) and what its rounding adds (block size minus requested size)."""
    import torch

    runner = worker.model_runner
    models = {"model": runner.model}
    proposer = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)  # vLLM 0.33's MRV2 / V1
    if getattr(proposer, "model", None) is not None:
        models["draft"] = proposer.model
    out: dict = {"runner": f"{type(runner).__module__}.{type(runner).__name__}",  # 0.33: V2 (worker.gpu) or V1
                 "model_memory_usage_gib": getattr(runner, "model_memory_usage", 0) / 2**30}
    owned: dict[int, int] = {}  # storage pointer -> bytes, each storage once (views and shared heads count once)
    for label, m in models.items():
        named = 0
        for t in [*m.parameters(), *m.buffers()]:
            st = t.untyped_storage()
            if st.data_ptr() not in owned:
                owned[st.data_ptr()] = st.nbytes()
                named += st.nbytes()
        out[f"{label}_param_storage_gib"] = named / 2**30
    registered = set(owned)
    kv: set[int] = set()
    extra: dict[str, int] = {}
    for label, m in models.items():
        for name, mod in m.named_modules():
            for attr, v in vars(mod).items():
                for t in _tensors(v):
                    if isinstance(t, torch.nn.Parameter) or not t.numel():
                        continue
                    st = t.untyped_storage()
                    if attr == "kv_cache":
                        kv.add(st.data_ptr())
                    elif st.data_ptr() not in owned:
                        owned[st.data_ptr()] = st.nbytes()
                        extra[f"{label}.{name}.{attr}"] = st.nbytes()
    kinds: dict[str, int] = {}
    for key, n in extra.items():
        kind = key.rsplit(".", 1)[-1]
        kinds[kind] = kinds.get(kind, 0) + n
    out["unregistered_tensors_gib"] = sum(extra.values()) / 2**30
    out["unregistered_by_attr_mib"] = {k: v / 2**20 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:20]}
    out["unregistered_largest_mib"] = {k: v / 2**20 for k, v in sorted(extra.items(), key=lambda kv: -kv[1])[:15]}
    if not torch.cuda.is_available():
        return out
    import bisect

    starts = {k: sorted(v) for k, v in (("weights", registered), ("kv_cache", kv), ("other_tensors", set(owned)))}

    def holds(name: str, lo: int, hi: int) -> bool:  # does a storage of this kind start inside [lo, hi)?
        i = bisect.bisect_left(starts[name], lo)
        return i < len(starts[name]) and starts[name][i] < hi

    by_owner: dict[str, list[int]] = {"weights": [0, 0], "kv_cache": [0, 0], "other_tensors": [0, 0], "other": [0, 0]}
    other_blocks: list[int] = []
    for seg in torch.cuda.memory_snapshot():
        for b in seg.get("blocks", []):
            if b.get("state") != "active_allocated":
                continue
            lo, hi = b["address"], b["address"] + b["size"]
            owner = next((k for k in starts if holds(k, lo, hi)), "other")
            if owner == "other":
                other_blocks.append(b["size"])
            by_owner[owner][0] += b["size"]
            by_owner[owner][1] += b["size"] - b.get("requested_size", b["size"])
    out["allocator_gib"] = {k: {"allocated": v[0] / 2**30, "rounding": v[1] / 2**30} for k, v in by_owner.items()}
    out["other_blocks_mib"] = [round(s / 2**20, 2) for s in sorted(other_blocks, reverse=True)[:20]]
    out["other_blocks_count"] = len(other_blocks)
    return out


def _cudagraph_mode(llm) -> str | None:
    try:
        return str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except AttributeError:
        return None


def _spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters; its per-position vector (`..._per_pos`) as one key per position, `name[i]`, so
    a request's increase is a plain difference like the others'."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if not m.name.startswith("vllm:spec_decode_num_"):
            continue
        if hasattr(m, "values"):  # vLLM's Vector
            out |= {f"{m.name}[{i}]": v for i, v in enumerate(m.values)}
        else:
            out[m.name] = getattr(m, "value", 0)
    return out


def _accepted_per_draft(counters: dict[str, float]) -> float:
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    return counters.get("vllm:spec_decode_num_accepted_tokens", 0) / drafts if drafts else 0.0


DRAFTS = "vllm:spec_decode_num_drafts"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _accepted_per_position(counters: dict[str, float]) -> list[float]:
    """Share of rounds whose draft at each position was accepted (with synthetic acceptance: the unconditional
    rates vLLM resolved from L, e.g. k = 3, L = 3.5: 1, 1, 0.5)."""
    drafts = counters.get(DRAFTS, 0)
    n = sum(1 for key in counters if key.startswith(PER_POSITION + "["))
    return [counters.get(f"{PER_POSITION}[{i}]", 0) / drafts for i in range(n)] if drafts else []


def _counted(llm, prompt: list[int], max_tokens: int) -> tuple[float, dict[str, float]]:
    """(seconds, the spec-decode counters' increase) for one request."""
    before = _spec_counters(llm)
    seconds = timed(llm, prompt, max_tokens)
    return seconds, {k: v - before.get(k, 0) for k, v in _spec_counters(llm).items()}


# Short-prompt decode and speculative rounds: each request takes well under a second, so more repeats cost seconds
# and steady the medians (three repeats put one fixed-K round at 6.1 to 7.7 ms across acceptance settings, H200).
SHORT_REPEATS = 7


def _round_phase(llm, prompt: list[int], decode: int, repeats: int, length: float | None) -> dict:
    """One acceptance setting, timed as `_decode_step` times a plain step, with each request's drafts counted."""
    ones = [_counted(llm, prompt, 1) for _ in range(repeats)]
    manys = [_counted(llm, prompt, decode + 1) for _ in range(repeats)]
    return _spec_phase(ones, manys, decode, length)


def _spec_phase(ones: list[tuple[float, dict]], manys: list[tuple[float, dict]], decode: int,
                length: float | None) -> dict:
    """Per generated token: the extra time of `decode` more tokens over a 1-token request (medians). Per round
    (`verify_step_ms`: one engine step, the draft's pass or passes and one target pass over 1 + k tokens): that
    extra time over the extra drafts the longer requests verified, one per round. Counted per request, so no
    earlier request's drafts enter, and the round does not lean on the acceptance rate. Tokens a round yields:
    the accepted drafts per round + the bonus token."""
    extra_s = statistics.median(t for t, _ in manys) - statistics.median(t for t, _ in ones)
    steps = statistics.mean(c.get(DRAFTS, 0) for _, c in manys) - statistics.mean(c.get(DRAFTS, 0) for _, c in ones)
    counters = {k: sum(c.get(k, 0) for _, c in manys) for k in manys[0][1]}
    step_s = extra_s / decode
    accepted = _accepted_per_draft(counters)
    return {"synthetic_acceptance_length": length, "accepted_per_draft": accepted,
            "tokens_per_round": 1 + accepted if counters.get(DRAFTS) else None,
            "accepted_per_position": _accepted_per_position(counters),
            "decode_step_ms": 1e3 * step_s, "decode_tok_s": 1 / step_s,
            "verify_step_ms": 1e3 * extra_s / steps if steps > 0 else None, "verify_steps_per_request": steps,
            "counters": counters, "request_s": {"1": [t for t, _ in ones], str(decode + 1): [t for t, _ in manys]}}


def _error(e: Exception) -> dict:
    """What a diagnostic that failed records in place of its figures (it never costs the run its timings)."""
    return {"error": f"{type(e).__name__}: {e}"[:500]}


ROUND_SPLIT_REPLAYS = 20  # dummy rounds timed for the draft / verify split (median of each)


def round_split(llm, context_len: int, replays: int = ROUND_SPLIT_REPLAYS) -> dict:
    """A speculative round's two GPU phases apart, by vLLM's own step timing (`model_runner.step_timing`, the
    StepTimingCollector adaptive verification prices its cost curves with, in 0.32-0.34): one dummy step of one
    request at the runner's decode width (1 + k tokens) over `context_len` tokens of context, `replays` times,
    each timed by CUDA events on the stream from the target's forward start to its end (`verify_forward_ms`: the
    target over 1 + k tokens, without the LM head and sampling) and around the drafter's propose (`draft_ms`:
    every draft pass, the Markov head or MTP layer included). A round less the two is the LM head, the rejection
    sampler and the host's gaps. Medians; `full_cudagraph` says whether the forward replayed a full graph, as a
    real decode round does. A diagnostic: an error is returned, never raised."""
    def measure(worker) -> list[tuple[float, float, bool, int]]:
        import torch

        runner = worker.model_runner
        if getattr(runner, "speculator", None) is None or not hasattr(runner, "step_timing"):
            raise RuntimeError("this engine's runner has no speculator or no step timing")
        width = runner.decode_query_len
        with torch.inference_mode(), runner.step_timing.collect() as samples:
            for _ in range(replays):
                runner._dummy_run(width, uniform_decode=True, context_len=context_len, skip_eplb=True)
        return [(t.forward_ms, t.drafter_ms, t.full_cudagraph, t.num_target_tokens) for t in samples]

    try:
        samples = llm.collective_rpc(measure)[0]
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return summarize_split(samples, context_len)


def summarize_split(samples: list[tuple[float, float, bool, int]], context_len: int) -> dict:
    """Medians of (forward ms, draft ms) samples, with how many replayed a full CUDA graph."""
    if not samples:
        return {"error": "no step was timed (the runner recorded no drafter phase)"}
    return {"verify_forward_ms": statistics.median(s[0] for s in samples),
            "draft_ms": statistics.median(s[1] for s in samples),
            "verify_tokens": samples[0][3], "context_len": context_len, "replays": len(samples),
            "full_cudagraph": sum(bool(s[2]) for s in samples)}


def _set_synthetic_length(llm, length: float, k: int = 1) -> list[float]:
    """Refill the rejection sampler's synthetic rates in place for mean accepted length `length` at k drafts, and
    return them. vLLM (0.32-0.34) keeps them as a device tensor of k conditional per-position rates that its
    rejection kernel reads every step, a pointer a captured graph keeps: so the same tensor is overwritten, with the
    rates vLLM itself computes for (L, k) at start-up (`compat.synthetic_conditional_rates`)."""
    problem = length_problem(length, k)
    if problem:
        raise ValueError(problem)
    new = compat.synthetic_conditional_rates(length, k)

    def fill(worker) -> None:
        import torch

        rates = worker.model_runner.rejection_sampler.synthetic_conditional_rates
        if rates is None or rates.numel() != k:
            raise RuntimeError(f"need synthetic rejection sampling at k={k} ({k} rates), found rates {rates}")
        rates.copy_(torch.tensor(new, dtype=rates.dtype))

    llm.collective_rpc(fill)
    return new


def _held_rates(llm) -> list[float] | None:
    """The conditional rates the engine's rejection sampler holds now (None without synthetic acceptance)."""
    def read(worker) -> list[float] | None:
        sampler = getattr(worker.model_runner, "rejection_sampler", None)
        rates = getattr(sampler, "synthetic_conditional_rates", None)
        return None if rates is None else rates.tolist()

    return llm.collective_rpc(read)[0]


def rates_agree(ours: list[float], held: list[float] | None, tol: float = 1e-6) -> bool:
    """Do the rates a refill would write for the engine's own L equal those vLLM built at start-up (float32)?"""
    return held is not None and len(ours) == len(held) and all(abs(a - b) <= tol for a, b in zip(ours, held))


def default_util(total_bytes: int | None) -> float:
    """The engine's share of the card when --util is not given. The full-size dummy model's weights take 67.3-71.9 GiB
    (FP8 or not, draft or not; BENCHMARKS.md), so an 80 GB H100 needs 0.95 of its 79.6 GiB to leave a few GiB of KV
    cache and activations (the plain and DSpark engines ran so on an H100, 2026-12-06; the served recipe with MTP did
    not load there: tests/gpu/agent_run.py, card_gib); a card of ROOMY_CARD_GIB (100) or more keeps the 0.85 every
    H200 run so far has used, and so does the CPU engine (`total_bytes` None), whose KV budget is
    VLLM_CPU_KVCACHE_SPACE rather than this share."""
    return 0.95 if total_bytes is not None and total_bytes < ROOMY_CARD_GIB * 2**30 else 0.85


def run(model: str, mode: str, prefill: list[int], decode: int, repeats: int, util: float | None, chunk: int,
        impl: str = "ours", fp8: str | None = None, kernels: bool = False,
        acceptance_lengths: list[float] | None = None, moe_backend: str | None = None,
        router: str | None = None, moe_align: str | None = None, kda_gate: str | None = None,
        router_gemm: str | None = None, draft_vocab: int | None = None, fp8_scheme: str | None = None,
        k: int | None = None, adaptive: bool = False, draft_fp8: bool = False, lanes: list[int] | None = None,
        smem_limit: int | None = None, turns: list[tuple[int, int]] | None = None) -> dict:
    k = check_spec(mode, k, adaptive, acceptance_lengths, impl, draft_fp8)
    check_turns(turns, prefill)
    acceptance_length, more_lengths = (acceptance_lengths[0], acceptance_lengths[1:]) if acceptance_lengths \
        else (None, [])
    check_runtime(mode, adaptive)
    longest = max([*prefill, *(h + n for h, n in turns or [])], default=0)
    check_context([longest], decode, _max_context(model))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # same process: its GPU memory is ours to read
    os.environ.update(IMPLS[impl])
    if router:
        os.environ[ROUTER_ENV] = router
    if moe_align:
        os.environ[ALIGN_ENV] = moe_align
    if kda_gate:
        os.environ[GATE_ENV] = kda_gate
    if router_gemm:
        os.environ[GEMM_ENV] = router_gemm
    launched = None
    if smem_limit:  # before the engine: every kernel it compiles and launches is held to the limit
        from ling_tuning.smem import SMEM_LIMIT_ENV, emulate_launch_limit

        os.environ[SMEM_LIMIT_ENV] = str(smem_limit)
        launched = emulate_launch_limit(smem_limit)
    import torch
    from vllm import LLM

    log = _LogLines()
    compat.settle_vllm_logging()  # else the engine's own logging set-up drops the handler added below
    for name in ("vllm", "vllm_ling"):
        logger = logging.getLogger(name)
        logger.addHandler(log)
        if logger.getEffectiveLevel() > logging.INFO:  # unconfigured: INFO records would never reach `log`
            logger.setLevel(logging.INFO)
    if util is None:
        util = default_util(torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
    drafter = write_dummy_drafter(model) if mode == "dspark" else None
    t0 = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True,
              max_model_len=longest + decode + CONTEXT_SLACK, max_num_seqs=max(lanes or [1]),
              max_num_batched_tokens=chunk, gpu_memory_utilization=util, enable_prefix_caching=bool(turns), seed=0,
              disable_log_stats=k is None and not turns,
              **_engine_kwargs(mode, fp8, acceptance_length, moe_backend, draft_vocab, fp8_scheme, k, adaptive,
                               drafter, draft_fp8))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    served = llm.apply_model(lambda m: f"{type(m).__module__}.{type(m).__name__}")[0]
    shape = llm.apply_model(model_shape)[0]
    result: dict = {"mode": mode, "model": model, "impl": impl, "served_by": served, "fp8": fp8 or "off",
                    "fp8_scheme": envs.asked(FP8_SCHEME_ENV) if fp8 else "off",
                    "vllm": __import__("vllm").__version__, "prefill": {}, "decode_tokens": decode,
                    "repeats": repeats, "short_repeats": max(repeats, SHORT_REPEATS),
                    "gpu_memory_utilization": util, "chunked_prefill_tokens": chunk,
                    "cudagraph_mode": _cudagraph_mode(llm),
                    "acceptance_length_synthetic": acceptance_length, "moe_backend_asked": moe_backend or "auto",
                    "k": k, "adaptive": adaptive, "drafter": drafter, "draft_fp8": draft_fp8,
                    "draft_vocab": draft_vocab, "smem_limit": smem_limit,
                    "router_asked": envs.asked(ROUTER_ENV) if impl == "ours" else None,
                    "moe_align_asked": envs.asked(ALIGN_ENV),
                    "router_gemm_asked": envs.asked(GEMM_ENV) if impl == "ours" else None,
                    "kda_gate_asked": envs.asked(GATE_ENV) if impl == "ours" else None,
                    "kda_prefill_checkpoint_asked": envs.asked(CHECKPOINT_ENV) if impl == "ours" else None, **shape}
    short = [rng.randrange(10, vocab) for _ in range(32)]
    result["engine_start_s"] = time.perf_counter() - t0  # LLM(): load, compile, graph capture (what a relaunch pays)
    _progress(t0, f"engine up ({mode})")
    first = time.perf_counter()
    timed(llm, short, decode)  # warm-up: JIT and first-request costs are not speed
    result["first_request_s"] = time.perf_counter() - first
    _progress(t0, "warm-up done")
    at_context = {}
    for n in prefill:
        prompt = [rng.randrange(10, vocab) for _ in range(n)]
        timed(llm, prompt, 1)
        t = statistics.median(timed(llm, prompt, 1) for _ in range(repeats))
        result["prefill"][str(n)] = {"seconds": t, "tok_s": n / t}
        _progress(t0, f"prefill {n}: {n / t:.0f} tok/s")
        at_context[n] = _decode_step(llm, prompt, decode, repeats, t)
        _progress(t0, f"decode after {n}: {1e3 * at_context[n]:.2f} ms/step")
    short_repeats = max(repeats, SHORT_REPEATS)
    phases = [_round_phase(llm, short, decode, short_repeats, acceptance_length)] if k else []
    step = phases[0]["decode_step_ms"] / 1e3 if phases else _decode_step(llm, short, decode, short_repeats)
    result |= {"decode_step_ms": 1e3 * step, "decode_tok_s": 1 / step}
    _progress(t0, f"decode: {1 / step:.1f} tok/s")
    if kernels:
        try:  # the profile must not cost the run the timings above
            result["kernels"] = kernels_per_step(llm, short, decode)
            if phases:
                result["kernels"]["per_round"] = per_round(result["kernels"], phases[0]["tokens_per_round"])
            _progress(t0, f"kernels: {result['kernels']['kernels_per_step']:.0f} per step")
        except Exception as e:  # noqa: BLE001
            result["kernels"] = _error(e)
            _progress(t0, f"kernel profile failed: {result['kernels']['error']}")
    if turns:
        result["prefix_caching"] = True
        result["turns"] = [turn_phase(llm, h, n, decode, repeats, vocab, kernels) for h, n in turns]
        _progress(t0, "turns: " + ", ".join(f"{r['history']}+{r['new']}: {r['cached_first_token_s']:.3f} s cached, "
                                            f"{r['fresh_first_token_s']:.3f} s fresh" for r in result["turns"]))
    if lanes:
        result["lanes"] = {str(n): _lanes_phase(llm, n, vocab, decode, repeats) for n in lanes}
        _progress(t0, "lanes: " + ", ".join(f"{n}: {r['aggregate_tok_s']:.1f} tok/s"
                                             for n, r in result["lanes"].items()))
    accepted = 0.0
    if k:
        result["spec_decode"] = _spec_counters(llm)  # the whole run's, warm-up included
        accepted = phases[0]["accepted_per_draft"]
        phases[0]["synthetic_conditional_rates"] = held = _held_rates(llm)
        if acceptance_length is not None:  # the refill's maths against what vLLM built for the first L
            result["refill_rates_match_engine"] = rates_agree(
                compat.synthetic_conditional_rates(acceptance_length, k), held)
        for length in more_lengths:
            _set_synthetic_length(llm, length, k)
            phases.append(_round_phase(llm, short, decode, short_repeats, length)
                          | {"synthetic_conditional_rates": _held_rates(llm)})
            _progress(t0, f"synthetic acceptance {length}: {phases[-1]['decode_tok_s']:.1f} tok/s, "
                          f"{phases[-1]['tokens_per_round'] or 0:.2f} tokens a round")
            if kernels:  # is a slower verify step at another acceptance more GPU work, or more time between it?
                phases[-1]["kernels"] = totals = _kernel_totals(llm, short, decode)
                if "error" not in totals:
                    totals["per_round"] = per_round(totals, phases[-1]["tokens_per_round"])
        result["by_acceptance"] = phases
        if torch.cuda.is_available():  # last: its dummy steps write scratch state no timed request reads after
            result["round_split"] = split = round_split(llm, len(short) + decode // 2)
            _progress(t0, "round split: " + (split.get("error") or f"verify forward {split['verify_forward_ms']:.2f} "
                                             f"ms, draft {split['draft_ms']:.2f} ms"))
    if torch.cuda.is_available():
        result["peak_gpu_gib"] = torch.cuda.max_memory_reserved() / 2**30
    try:  # a diagnostic: it must never cost the run its timings
        memory = llm.collective_rpc(memory_breakdown)[0]
    except Exception as e:  # noqa: BLE001
        memory = _error(e)
    result["memory"] = memory
    # what vLLM logs as "Model loading took", read from the runner it is computed in
    result["weight_gib"] = round(memory.get("model_memory_usage_gib", 0), 4) or None
    # the drafter's own parameters (the shared LM head and embedding are the target's, counted there); vLLM logs
    # no figure of its own for it: its "Model loading took" covers target and draft together
    result["drafter_weight_gib"] = memory.get("draft_param_storage_gib") if drafter else None
    result["log"] = log.lines[:40]
    if launched is not None:
        result["triton_smem"] = dict(sorted(launched.items(), key=lambda kv: -kv[1]))
    copy_gbs = copy_bandwidth_gbs()
    result["roofline"] = roofline(model, mode, len(short) + decode // 2, step, copy_gbs, accepted, bool(fp8), k,
                                  draft_fp8)
    result["decode_at_context"] = {  # step = prompt + `decode` tokens minus the 1-token request, per token
        str(n): {"decode_step_ms": 1e3 * s,
                 **roofline(model, mode, n + decode // 2, s, copy_gbs, accepted, bool(fp8), k, draft_fp8)}
        for n, s in at_context.items()}
    return result


def _lanes_phase(llm, n: int, vocab: int, decode: int, repeats: int) -> dict:
    """`n` short requests decoding together: the extra time of `decode` more tokens each over a 1-token batch
    (medians), as a step in ms, per-request and aggregate tok/s."""
    rng = random.Random(n)
    prompts = [[rng.randrange(10, vocab) for _ in range(32)] for _ in range(n)]
    timed(llm, prompts, decode)  # warm-up: a batch of this size's first graphs and kernels
    one = statistics.median(timed(llm, prompts, 1) for _ in range(repeats))
    many = statistics.median(timed(llm, prompts, decode + 1) for _ in range(repeats))
    seconds = many - one
    return {"step_ms": 1e3 * seconds / decode, "per_request_tok_s": decode / seconds,
            "aggregate_tok_s": n * decode / seconds}


KERNEL_TOTALS = ("kernels_per_step", "gpu_us_per_step", "gpu_busy_us_per_step")


def per_round(totals: dict, tokens_per_round: float | None) -> dict | None:
    """A speculative engine's kernel totals per round: `kernels_per_step` counts per generated token (the extra
    of `decode` more tokens over a 1-token request, divided by `decode`), and a round yields `tokens_per_round`."""
    if not tokens_per_round:
        return None
    return {name.replace("_per_step", "_per_round"): totals[name] * tokens_per_round for name in KERNEL_TOTALS}


def _kernel_totals(llm, prompt: list[int], decode: int) -> dict:
    """`kernels_per_step`'s totals without its kernel list, or the error (a diagnostic never costs the run)."""
    try:
        got = kernels_per_step(llm, prompt, decode)
    except Exception as e:  # noqa: BLE001
        return _error(e)
    return {k: got[k] for k in KERNEL_TOTALS}


def _decode_step(llm, prompt: list[int], decode: int, repeats: int, one: float | None = None) -> float:
    """Seconds per decode step after `prompt`: the extra time of `decode` more tokens over a 1-token request
    (medians; `one` is that request's median when already measured)."""
    if one is None:
        one = statistics.median(timed(llm, prompt, 1) for _ in range(repeats))
    many = statistics.median(timed(llm, prompt, decode + 1) for _ in range(repeats))
    return (many - one) / decode


def _comma_list(text: str, kind: type, expected: str, at_least_1: str) -> list:
    """A comma-separated argument of `kind`s, each at least 1; argparse's error names what was expected."""
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: {at_least_1}")
    return values


def _lengths(text: str) -> list[float]:
    return _comma_list(text, float, "numbers, e.g. 1.94,1.70", "an acceptance length is the tokens a round "
                       "yields, >= 1 (and <= k + 1: checked against --k)")


def _turns(text: str) -> list[tuple[int, int]]:
    try:
        return parse_turns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _counts(text: str) -> list[int]:
    return _comma_list(text, int, "whole numbers, e.g. 1,2,4,8", "a lane count is at least 1, e.g. 1,2,4,8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ling_bench.fullsize", description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a folder with config.json (ling-make-tiny DIR --full-config)")
    ap.add_argument("--mode", choices=sorted(MODES), default="graphs")
    ap.add_argument("--k", type=int, metavar="N",
                    help="mtp | dspark: draft tokens a round (mtp 1..3, default 1; dspark 1..8, default 8)")
    ap.add_argument("--adaptive", action="store_true",
                    help="dspark: vLLM's confidence-driven verification width (enable_adaptive_verification; "
                         "compute capability 10.x)")
    ap.add_argument("--draft-fp8", action="store_true",
                    help="dspark: the drafter's own weights in FP8 (\"quantization\": \"ling_fp8\" in its speculative "
                         "config); --fp8 is the target's")
    ap.add_argument("--prefill", default="4096,16384,65536", help="prompt lengths, comma-separated")
    ap.add_argument("--decode", type=int, default=128, help="tokens decoded per measurement")
    ap.add_argument("--repeats", type=int, default=3,
                    help=f"requests per prefill and long-context measurement (short-prompt decode and rounds take at "
                         f"least {SHORT_REPEATS})")
    ap.add_argument("--util", type=float,
                    help="gpu_memory_utilization (default: 0.85 on a card of >= 100 GiB, 0.95 below, where the full-size "
                         "weights would not fit at 0.85)")
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (the serve recipe's chunk)")
    ap.add_argument("--impl", choices=sorted(IMPLS), default="ours",
                    help="which model serves: ours, vLLM's in-tree (plugin on), or vLLM as installed (no plugin)")
    ap.add_argument("--fp8", choices=FP8_KERNELS, help="serve with --quantization ling_fp8 on this kernel")
    ap.add_argument("--fp8-scheme", choices=FP8_SCHEMES,
                    help="with --fp8: FP8's scales, 128x128 blocks or per channel (VLLM_LING_FP8_SCHEME)")
    ap.add_argument("--kernels", action="store_true", help="profile CUDA kernels per decode step")
    ap.add_argument("--acceptance-length", type=_lengths,
                    help="mtp | dspark: synthetic acceptance, the mean tokens a round yields, in [1, k + 1] (1 + "
                         "rate at k=1; vLLM >= 0.32 on a GPU: the CPU sampler refuses it); comma-separated to "
                         "measure several on one engine, e.g. 1.94,1.70 or 6.5,5.3,3.5")
    ap.add_argument("--moe-backend", choices=MOE_BACKENDS,
                    help="INT4 expert kernels (vLLM >= 0.28's --moe-backend; default: vLLM's choice, Humming on sm_90)")
    ap.add_argument("--router", choices=ROUTERS,
                    help="our model's MoE routing: our one-kernel router (default) or vLLM's grouped_topk")
    ap.add_argument("--moe-align", choices=ALIGNS,
                    help="MoE token layout before the expert GEMMs: vLLM's op (default) or ours at decode sizes")
    ap.add_argument("--router-gemm", choices=GEMMS,
                    help="our model's router logits: our fp32 kernel at <= 16 rows (default) or vLLM's GateLinear")
    ap.add_argument("--kda-gate", choices=GATES,
                    help="our model's KDA gate: inside vLLM's raw-gate kernels (the default where vLLM has them, "
                         ">= 0.32) or computed by ours before the op (the default on 0.26)")
    ap.add_argument("--draft-vocab", type=int, metavar="N",
                    help="mtp: the draft proposes among ids 0..N-1 only (a draft vocabulary, vllm_ling.draft.vocab)")
    ap.add_argument("--lanes", type=_counts, help="also decode this many requests together, e.g. 1,2,4,8")
    ap.add_argument("--turn", type=_turns, metavar="HISTORY+NEW",
                    help="with the prefix cache on, time an agent's turn: NEW tokens after a HISTORY the cache holds, "
                         "against the same prompt fresh (ling_bench.cached_turn); comma-separated, e.g. "
                         "32768+2048,61440+2048; needs --prefill= (its repeated prompts would hit the cache)")
    ap.add_argument("--smem-limit", type=int, metavar="BYTES",
                    help="hold every Triton kernel to this much shared memory per block at launch (GB10: 101376)")
    ap.add_argument("--out", help="write the JSON result here")
    a = ap.parse_args(argv)
    prefill = [int(x) for x in a.prefill.split(",") if x]
    try:  # refused here, a mistake costs no engine start
        check_spec(a.mode, a.k, a.adaptive, a.acceptance_length, a.impl, a.draft_fp8)
        check_runtime(a.mode, a.adaptive)
        check_turns(a.turn, prefill)
        check_context([*prefill, *(h + n for h, n in a.turn or [])], a.decode, _max_context(a.model))
    except ValueError as e:
        ap.error(str(e))
    result = run(a.model, a.mode, prefill, a.decode, a.repeats, a.util, a.chunk, a.impl, a.fp8, a.kernels,
                 a.acceptance_length, a.moe_backend, a.router, a.moe_align, a.kda_gate, a.router_gemm, a.draft_vocab,
                 a.fp8_scheme, a.k, a.adaptive, a.draft_fp8, a.lanes, a.smem_limit, a.turn)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
