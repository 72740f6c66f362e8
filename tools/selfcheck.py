"""Start-up self-check: is every optimisation we asked for really on? (the integration trap)

Stacked optimisations fail silently: a draft reading the wrong weights is accepted ~0% and decodes
slower than no draft; a missing tuned-MoE file falls back to generic tiles. This module turns each one
into an ON/OFF line with the reason, and fails loudly when something requested fell back.

The in-vLLM half (the MTP draft must run on the target's LM head and embedding, FP8 included) is
`vllm_ling.draft.check`, part of the served plugin; this module is the tool that runs beside the server:
`python -m ling_tools.selfcheck --log logs/serve.log --url http://127.0.0.1:8000 -- <serve command>` runs
  against a live server: reads what each optimisation did from this launch's lines of the server log (from
  the watchdog's launch line, `--launch ID`; never an earlier run's lines in a reused log dir), what was asked
  for from the serve command and the server's own environment (`--server-pid`: /proc/<pid>/environ, where
  the recipe's VLLM_TUNED_CONFIG_FOLDER lives), then sends a short greedy probe as two sequences of one batch
  (they must agree) and, with MTP or DSpark, reads the spec-decode counters from /metrics to check the
  draft is accepted at a plausible rate. Requests carry the server's key (VLLM_API_KEY, else its `--api-key`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ling_common.device import gpu_name
from ling_common.metrics import ZERO, SpecCounters, prefix_cache
from ling_common.vllm_log import served_int4_backend
from vllm_ling import envs, startup_log  # standard library only, like this tool
from vllm_ling.draft.vocab_file import ENV as DRAFT_VOCAB_ENV, requested_path  # standard library only too

logger = logging.getLogger("vllm_ling")

# --- against a live server ---------------------------------------------------------------------------


@dataclass
class Verdict:
    name: str
    on: bool
    why: str
    requested: bool = False

    @property
    def failed(self) -> bool:
        return self.requested and not self.on

    @property
    def state(self) -> str:
        return "ON" if self.on else ("FAILED" if self.failed else "OFF")

    def line(self) -> str:
        return f"{self.name:<16} {self.state:<6} {self.why}"


@dataclass(frozen=True)
class Requested:
    """What the server was asked for: from its serve arguments and from the environment it really runs in
    (the recipe exports VLLM_TUNED_CONFIG_FOLDER; it is no serve argument)."""

    eager: bool = False
    mtp: bool = False
    tuned_folder: str | None = None
    fp8: bool = False
    kda_gate_kernel: bool = False
    draft_vocab: bool = False
    prefix_cache: bool = False
    dspark: bool = False
    adaptive: bool = False  # DSpark's enable_adaptive_verification: the engine's config line does not print it
    dspark_fp8: bool = False  # the DSpark drafter's own quantization ling_fp8 (its speculative config's)
    kda_prefill: str | None = None  # --kda-prefill-backend (vLLM's auto | triton | flashkda ...), None when unset
    kda_checkpoint: bool = False  # VLLM_LING_KDA_PREFILL_CHECKPOINT set on, not left to its default

    @classmethod
    def of(cls, args, env: Mapping[str, str]) -> Requested:
        """args: the serve command's ling_watchdog.serve_args.ServeArgs, or None when not given."""
        spec = args.speculative if args is not None else {}
        method = str(spec.get("method", ""))
        quantization = str((args.values.get("quantization") if args is not None else None) or "")
        return cls(eager=bool(args and args.enforce_eager), mtp="mtp" in method,
                   tuned_folder=env.get("VLLM_TUNED_CONFIG_FOLDER") or None, fp8=quantization == FP8_METHOD,
                   kda_gate_kernel=envs.raw(KDA_GATE_ENV, env).lower() == "kernel",
                   kda_checkpoint=bool(envs.raw(KDA_CHECKPOINT_ENV, env)) and envs.read(KDA_CHECKPOINT_ENV, env),
                   draft_vocab=requested_path(env) is not None,
                   prefix_cache=bool(args is not None and args.values.get("enable_prefix_caching")),
                   dspark=method == "dspark", adaptive=bool(spec.get("enable_adaptive_verification")),
                   dspark_fp8=method == "dspark" and spec.get("quantization") == FP8_METHOD,
                   kda_prefill=(args.values.get("kda_prefill_backend") if args is not None else None) or None)


FP8_METHOD = "ling_fp8"  # vllm_ling.fp8.NAME (not imported: this tool runs without vLLM's model code)
KDA_GATE_ENV = "VLLM_LING_KDA_GATE"  # vllm_ling.kda_core.GATE_ENV (same reason)
KDA_CHECKPOINT_ENV = "VLLM_LING_KDA_PREFILL_CHECKPOINT"  # vllm_ling.kda.CHECKPOINT_ENV (same reason)


def inspect_log(log: str, asked: Requested, choice: dict | None = None) -> list[Verdict]:
    """What each optimisation did, from this launch's lines of vLLM's log, against what was asked for. `choice`
    is ling-tune's measured MoE backend verdict (`backend_choice.json`), held against the one vLLM chose."""
    graphs = re.search(r"Graph capturing finished in", log)
    device = re.search(r"device_config=(\w+)", log)
    on_cpu = bool(device) and device.group(1) == "cpu"
    mode = re.search(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)", log)
    why = (f"captured ({mode.group(1)})" if graphs and mode else "captured") if graphs else (
        "CPU engine" if on_cpu else "--enforce-eager" if asked.eager else "no 'Graph capturing finished' line")
    verdicts = [_model_verdict(log), Verdict("CUDA graphs", bool(graphs), why, requested=not asked.eager and not on_cpu)]
    spec = re.search(r"speculative_config=SpeculativeConfig\(method='mtp'|Speculative decoding.*mtp", log, re.I)
    verdicts.append(Verdict("MTP", bool(spec), "method=mtp in the engine config" if spec else "not configured",
                            requested=asked.mtp))
    verdicts.append(dspark_verdict(log, asked))
    verdicts.append(_int4_verdict(log, choice))
    verdicts.append(_tuned_verdict(log, asked.tuned_folder))
    verdicts.append(_fp8_verdict(log, asked.fp8))
    verdicts.append(_kda_gate_verdict(log, asked.kda_gate_kernel, on_cpu))
    verdicts.append(flashkda_verdict(log, asked.kda_prefill, on_cpu))
    verdicts.append(checkpoint_verdict(log, asked.kda_checkpoint))
    verdicts.append(_draft_vocab_verdict(log, asked.draft_vocab))
    verdicts.append(prefix_cache_verdict(log, asked.prefix_cache))
    return verdicts


PREFIX_CACHE = "Prefix cache"


def prefix_cache_verdict(log: str, asked: bool, counters: tuple[float, float] | None = None) -> Verdict:
    """Whether the engine caches prefixes (its config line, `enable_prefix_caching=`, in 0.32-0.34), how it keeps
    KDA's state for them (vLLM's "Mamba cache mode is set to 'align'" line: checkpoints at block boundaries), and
    with `counters` (queries, hits: vLLM's Prometheus counters, in prompt tokens since the server started) the hit
    rate. Asked for (--enable-prefix-caching) and off in the engine is a failure: every turn prefills it all."""
    found = re.search(r"enable_prefix_caching=(True|False)", log)
    if not found or found.group(1) == "False":
        why = ("asked for (--enable-prefix-caching) but the engine runs without it" if asked and found else
               "asked for, but no engine config line in this launch" if asked else
               "off: every request prefills its whole prompt")
        return Verdict(PREFIX_CACHE, False, why, requested=asked)
    mode = re.search(r"Mamba cache mode is set to '(\w+)'", log)
    why = f"KDA state checkpointed at block boundaries ({mode.group(1)})" if mode else "on"
    if counters is not None:
        why += f"; {hit_rate_text(*counters)}"
    return Verdict(PREFIX_CACHE, True, why, requested=asked)


def hit_rate_text(queries: float, hits: float) -> str:
    """vLLM's prefix-cache hit rate as the self-check and `ling-watchdog status` print it."""
    if queries <= 0:
        return "hit rate n/a (no prompt tokens looked up yet)"
    return f"hit rate {hits / queries:.1%} ({hits:,.0f} of {queries:,.0f} prompt tokens since start)"


def prefix_counters(text: str) -> tuple[float, float] | None:
    """(queries, hits) of a /metrics scrape (ling_common.metrics.prefix_cache); None when the server exports neither."""
    cache = prefix_cache(text)
    return None if cache is None else (float(cache.queries), float(cache.hits))


def _draft_vocab_verdict(log: str, asked: bool) -> Verdict:
    """The MTP draft's vocabulary (VLLM_LING_DRAFT_VOCAB): our draft logs how many ids it proposes among once it
    has gathered their head rows (vllm_ling.draft.vocab). Asked for and absent is a failure: vLLM's in-tree draft,
    for one, would serve its whole head and ignore the file."""
    found = startup_log.DRAFT_VOCAB.search(log)
    if found:
        return Verdict("Draft vocab", True, f"{found['ids']} of {found['vocab']} tokens ({found['dtype']} rows)",
                       requested=asked)
    return Verdict("Draft vocab", False, f"asked for ({DRAFT_VOCAB_ENV}) but the draft never took it: is vllm-ling's "
                   "MTP draft serving?" if asked else "not asked for: the draft reads the whole LM head",
                   requested=asked)


def _model_verdict(log: str) -> Verdict:
    """Which BailingMoeV3ForCausalLM serves, and why: the plugin's one line per process (vllm_ling.plugin)."""
    served = startup_log.REGISTERED.search(log)
    if served:
        return Verdict("Ling V3 model", True, f"{served['who']} on vLLM {served['version']}: {served['why']}; "
                                              f"{served['env']}=vllm-ling|vllm picks")
    failed = startup_log.REGISTRATION_FAILED.search(log)
    return Verdict("Ling V3 model", False, f"the plugin did not register: {failed['error']}" if failed else
                   "no vllm-ling line: the plugin is not installed in the server's environment")


def _fp8_verdict(log: str, asked: bool) -> Verdict:
    """FP8 weights (`--quantization ling_fp8`): the plugin's count of FP8 layers, logged once the LM head got
    its method; asked for and absent is a failure (the linears stayed BF16)."""
    found = startup_log.FP8_ON.findall(log)
    if not found:
        why = "asked for (--quantization ling_fp8) but no layer got FP8 weights" if asked else "not asked for"
        return Verdict("FP8 weights", False, why, requested=asked)
    target = found[0]  # the target's line comes first; the MTP draft's follows
    return Verdict("FP8 weights", True, f"({target['linears']} linears{target['head']}), {target['kernel']}",
                   requested=asked)


def _kda_gate_verdict(log: str, asked: bool, on_cpu: bool) -> Verdict:
    """Where KDA's safe gate and σ(β) are computed: inside vLLM's raw-gate KDA kernels (VLLM_LING_KDA_GATE=kernel)
    or by our compiled gate before the op. Asked for and fallen back (a vLLM without the kernels, a cache whose
    state is not dense per slot) is a failure; the plugin logs the reason (vllm_ling.kda, vllm_ling.kda_core)."""
    fell = startup_log.KDA_GATE_FELL_BACK.search(log)
    if fell:
        return Verdict("KDA gate", False, fell["reason"].strip(), requested=asked)
    if startup_log.KDA_GATE_IN_KERNEL.search(log):
        return Verdict("KDA gate", True, f"in vLLM's raw-gate KDA kernels ({KDA_GATE_ENV}=kernel)", requested=asked)
    if on_cpu:
        return Verdict("KDA gate", False, "CPU engine: our torch ops compute the gate")
    if (served := startup_log.REGISTERED.search(log)) and served["who"] == startup_log.INTREE:
        return Verdict("KDA gate", False, "vLLM's in-tree model serves, with its own KDA layer", requested=asked)
    return Verdict("KDA gate", False, f"ours, before the KDA op ({KDA_GATE_ENV}=ours, or a vLLM without its raw-gate "
                   "KDA kernels)" if not asked else "asked for, but no vllm-ling KDA gate line in this launch",
                   requested=asked)


FLASHKDA = "FlashKDA"


def flashkda_verdict(log: str, asked: str | None, on_cpu: bool) -> Verdict:
    """Whether FlashKDA runs KDA's prefills: our layers log the prefill kernel and why once per process
    (startup_log.KDA_PREFILL; vllm_ling.flashkda decides). Off is a failure only when the serve command named it
    (`--kda-prefill-backend flashkda`); under auto, Triton chunk_kda is the fallback where FlashKDA's contract
    does not hold, and the reason says which part."""
    requested = (asked or "").strip().lower() == "flashkda"
    found = startup_log.KDA_PREFILL.search(log)
    if found:
        on = found["kernel"] == startup_log.KDA_PREFILL_KERNELS[0]
        why = found["why"].strip() if on else f"KDA prefill on {found['kernel']}: {found['why'].strip()}"
        return Verdict(FLASHKDA, on, why, requested=requested)
    if on_cpu:
        return Verdict(FLASHKDA, False, "CPU engine: our torch ops run the KDA prefill", requested=requested)
    if (served := startup_log.REGISTERED.search(log)) and served["who"] == startup_log.INTREE:
        return Verdict(FLASHKDA, False, "vLLM's in-tree model serves, with its own KDA layer (Triton chunk_kda)",
                       requested=requested)
    return Verdict(FLASHKDA, False, "no vllm-ling KDA prefill line in this launch", requested=requested)


KDA_CHECKPOINTS = "KDA checkpoints"


def checkpoint_verdict(log: str, asked: bool) -> Verdict:
    """Whether KDA writes in-prefill checkpoints (startup_log.KDA_CHECKPOINT, logged once unless
    VLLM_LING_KDA_PREFILL_CHECKPOINT=0). On by default, they are off without the prefix cache or under a Triton
    prefill, which the line says; only a launch that sets the variable on and gets them off fails."""
    found = startup_log.KDA_CHECKPOINT.search(log)
    if found:
        return Verdict(KDA_CHECKPOINTS, found["state"] == "ON", found["why"].strip(), requested=asked)
    return Verdict(KDA_CHECKPOINTS, False, f"{KDA_CHECKPOINT_ENV} set, but no vllm-ling KDA checkpoint line in this "
                   f"launch" if asked else f"no vllm-ling KDA checkpoint line ({KDA_CHECKPOINT_ENV}=0, or not our "
                   f"model): a prompt's last prefill pass ends at a block boundary", requested=asked)


def _tuned_verdict(log: str, folder: str | None) -> Verdict:
    """Tuned MoE tiles: asked for when the server's environment names a tuned folder; failed when vLLM's
    Triton MoE lookup still fell back to its default tiles (W11: a file with the wrong name is ignored)."""
    tuned = re.search(r"Using configuration from (\S+) for MoE layer", log)
    default = re.search(r"Using default MoE config", log)
    if tuned:
        return Verdict("tuned MoE tiles", True, tuned.group(1), requested=bool(folder))
    if default:
        why = (f"vLLM fell back to default tiles although VLLM_TUNED_CONFIG_FOLDER={folder}: no file there for "
               f"this device and shape" if folder else "vLLM fell back to default tiles (no tuned folder set)")
        return Verdict("tuned MoE tiles", False, why, requested=bool(folder))
    return Verdict("tuned MoE tiles", False, "no Triton MoE config lookup (Marlin or CPU)")


def _int4_verdict(log: str, choice: dict | None) -> Verdict:
    """Which INT4 MoE backend serves, and whether it is the one ling-tune measured fastest on this device."""
    found = served_int4_backend(log)
    if not found:
        return Verdict("INT4 experts", False, "no WNA16 MoE backend line (BF16 checkpoint?)")
    served, backend = found
    if choice is None:
        return Verdict("INT4 experts", True, f"backend {backend} (no ling-tune backend verdict)")
    wanted = choice["moe_backend"]
    where = f"ling-tune on {choice.get('device_name', '?')}: {choice.get('reason', '')}"
    if wanted != served:
        return Verdict("INT4 experts", False, f"backend {backend}, but {where}; this vLLM chose otherwise",
                       requested=True)
    return Verdict("INT4 experts", True, f"backend {backend}, as measured ({where})")


def read_choice(tuned_dir: str | None, device_name: str | None) -> dict | None:
    """ling-tune's backend verdict in the tuned-config folder, if it was measured on `device_name`; else None
    (a folder copied from another GPU says nothing about this one)."""
    from ling_tuning.choice import read_choice as read_verdict

    return read_verdict(tuned_dir, device_name) if tuned_dir and device_name else None


Counters = SpecCounters | Mapping[str, float] | None


def _counters(c: Counters) -> SpecCounters:
    """SpecCounters, or vLLM's counter names without the prefix ({"num_draft_tokens": ..., ...}, as the
    engine tests collect them from LLM.get_metrics())."""
    if c is None or isinstance(c, SpecCounters):
        return c or ZERO
    return SpecCounters(int(c.get("num_draft_tokens", 0)), int(c.get("num_accepted_tokens", 0)),
                        int(c["num_drafts"]) if "num_drafts" in c else None)


def judge_acceptance(before: Counters, after: Counters, minimum: float) -> Verdict:
    """Draft acceptance over the probe, from the difference of two scrapes of the spec-decode counters."""
    delta = _counters(after) - _counters(before)
    if delta.draft_tokens <= 0:
        return Verdict("MTP acceptance", False, "no draft tokens during the probe", requested=True)
    rate = delta.acceptance_rate
    ok = rate >= minimum
    why = f"{rate:.1%} of {delta.draft_tokens} draft tokens accepted (minimum {minimum:.0%})"
    if not ok:
        why += ": the draft is reading wrong weights or a wrong state; it is slower than no draft"
    return Verdict("MTP acceptance", ok, why, requested=True)


DSPARK = "DSpark"
DSPARK_ENGINE = re.compile(r"speculative_config=SpeculativeConfig\(method='dspark'.*?num_spec_tokens=(\d+)\)")


def dspark_verdict(log: str, asked: Requested) -> Verdict:
    """Whether the engine drafts with DSpark, and its K, from vLLM's engine config line (`SpeculativeConfig(method=
    'dspark', model=..., num_spec_tokens=K)`, 0.32-0.34); adaptive width is what the command asked for; the
    drafter's own FP8 weights from the plugin's line (startup_log.DSPARK_FP8_ON). Asked for and absent is a
    failure: vLLM served without the drafter, or with its weights in BF16."""
    found = DSPARK_ENGINE.search(log)
    if not found:
        return Verdict(DSPARK, False, "asked for (method dspark) but the engine config has no DSpark drafter"
                       if asked.dspark else "not configured", requested=asked.dspark)
    why = f"K={found[1]}, adaptive {'on' if asked.adaptive else 'off'}"
    fp8 = startup_log.DSPARK_FP8_ON.search(log)
    if asked.dspark_fp8 and not fp8:
        return Verdict(DSPARK, False, f"{why}; the drafter's FP8 weights were asked for (\"quantization\": "
                       f"\"{FP8_METHOD}\") but it logged none: its weights are BF16", requested=True)
    if fp8:
        why += f", drafter FP8 ({fp8['linears']} linears{fp8['markov']})"
    return Verdict(DSPARK, True, why, requested=asked.dspark)


def judge_dspark(engine: Verdict, before: Counters, after: Counters, minimum: float) -> Verdict:
    """DSpark's line with the mean accepted length per verify over the probe (vLLM's 1 + accepted / drafts, counting
    the bonus token). The same rule as MTP's acceptance: no draft counted, or fewer than `minimum` accepted tokens
    a verify (MTP k=1's minimum rate, as a length), means the drafter is not working and decodes slower than none."""
    delta = _counters(after) - _counters(before)
    if delta.draft_tokens <= 0:
        return Verdict(DSPARK, False, f"{engine.why}; no drafts counted during the probe: DSpark is not drafting",
                       requested=True)
    length = delta.mean_acceptance_length
    shown = f"mean accepted {length:.2f}" if length is not None else "mean accepted n/a (no num_drafts counter)"
    ok = (length - 1 if length is not None else delta.acceptance_rate) >= minimum
    why = (f"{engine.why}, {shown} ({delta.accepted} of {delta.draft_tokens} draft tokens over the probe, minimum "
           f"{1 + minimum:.2f})")
    if not ok:
        why += ": the drafter is reading wrong weights or a wrong state; it is slower than no draft"
    return Verdict(DSPARK, ok, why, requested=True)


PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
AGREE_CHARS = 64  # about 16 tokens of the probe's continuation


def probe(url: str, model: str, tokens: int, headers: Mapping[str, str] | None = None,
          timeout: float = 120.0) -> list[str]:
    """A greedy completion of a self-consistent input (plain prose), twice in one request: vLLM schedules the
    two sequences together (greedy forbids n > 1, so the prompt is sent as a batch of two)."""
    import requests

    r = requests.post(f"{url}/v1/completions", timeout=timeout, headers=dict(headers or {}), json={
        "model": model, "prompt": [PROBE_PROMPT, PROBE_PROMPT], "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True})
    if not r.ok:
        raise RuntimeError(f"the self-check's probe got HTTP {r.status_code} from {url}: {r.text[:500]}")
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def judge_batch_agreement(texts: list[str], chars: int = AGREE_CHARS) -> Verdict:
    """Two greedy sequences of one prompt, decoded side by side, must agree. A mix-up of per-sequence rows or
    state slots corrupts every sequence but the first from its first token (the H200 MTP verify bug,
    FINDINGS.md §1), which a one-request probe never sees; rounding can part identical rows only at a
    near-tie, rarely within the first ~16 tokens."""
    a, b = texts
    shorter = min(len(a), len(b))
    agree = len(os.path.commonprefix([a, b]))
    need = min(shorter, chars)
    why = f"2 greedy sequences of one prompt, one batch: first {agree} of {shorter} characters agree"
    if agree < need:
        why += f" (need {need}): a sequence reads another's rows or state; concurrent requests get garbage"
    return Verdict("batch agreement", agree >= need, why, requested=True)


def server_env(pid: int | None) -> tuple[dict[str, str], str]:
    """The server's environment as it started (/proc/<pid>/environ), else ours; and where it came from."""
    if pid:
        import psutil

        try:
            return psutil.Process(pid).environ(), f"pid {pid}"
        except (psutil.Error, OSError) as e:
            return dict(os.environ), f"this process (pid {pid} unreadable: {type(e).__name__})"
    return dict(os.environ), "this process"


def _say(v: Verdict | None, message: str, as_json: bool, level: str = "info", **fields) -> None:
    line = f"vllm-ling self-check: {message}"
    if as_json:
        if v is not None:
            level, fields = ("error" if v.failed else "info"), dict(check=v.name, state=v.state, why=v.why)
        print(json.dumps({"message": line, "level": level, **fields}), flush=True)
    else:
        print(line, flush=True, file=sys.stderr if level == "error" else sys.stdout)


def main(argv: list[str] | None = None) -> int:
    from ling_watchdog.events import launch_log
    from ling_watchdog.probes import auth_headers
    from ling_watchdog.serve_args import ServeArgs

    from ling_common.metrics import read_metrics, read_spec_counters

    p = argparse.ArgumentParser(prog="python -m ling_tools.selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--log", required=True, help="the server's log (serve.log of the watchdog's log dir)")
    p.add_argument("--launch", default=None, help="the watchdog's launch id: judge only that launch's lines "
                   "(default: the latest launch in the log)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid: what it was asked for through its environment is read from it")
    p.add_argument("--url", help="server base URL; with it, run the greedy probe (batch agreement, MTP or DSpark "
                   "acceptance)")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    p.add_argument("--min-acceptance", type=float, default=0.3,
                   help="lowest draft acceptance that passes (real Ling MTP: ~0.9 at k=1); for DSpark, the "
                   "lowest mean accepted length per verify less the bonus token")
    p.add_argument("--probe-tokens", type=int, default=64)
    p.add_argument("--tuned-dir", default=None,
                   help="ling-tune's folder, for its measured MoE backend (default: the server's "
                   "VLLM_TUNED_CONFIG_FOLDER)")
    p.add_argument("--json", action="store_true", help="one JSON object per line (the watchdog's format)")
    p.add_argument("serve_args", nargs="*", help="the serve command (after --)")
    a = p.parse_args(argv)
    env, env_from = server_env(a.server_pid)
    args = ServeArgs.parse(a.serve_args) if a.serve_args else None
    asked = Requested.of(args, env)
    log = launch_log(a.log, a.launch)
    if a.launch and not log:
        _say(None, f"launch {a.launch} not found in {a.log}: nothing of it to judge", a.json, level="warning")
    tuned_dir = a.tuned_dir or asked.tuned_folder
    verdicts = inspect_log(log, asked, read_choice(tuned_dir, gpu_name()))
    mtp = next(v for v in verdicts if v.name == "MTP")
    dspark = next(i for i, v in enumerate(verdicts) if v.name == DSPARK)
    if a.url:
        import requests

        key = os.environ.get("VLLM_API_KEY") or (args.api_key(env) if args is not None else None)
        headers = auth_headers(key)
        model = a.model or requests.get(f"{a.url}/v1/models", headers=headers, timeout=5).json()["data"][0]["id"]
        drafts = mtp.on or verdicts[dspark].on
        before = read_spec_counters(a.url, headers) if drafts else None
        verdicts.append(judge_batch_agreement(probe(a.url, model, a.probe_tokens, headers)))
        after = read_spec_counters(a.url, headers) if drafts else None
        if mtp.on:
            verdicts.append(judge_acceptance(before, after, a.min_acceptance))
        if verdicts[dspark].on:
            verdicts[dspark] = judge_dspark(verdicts[dspark], before, after, a.min_acceptance)
        i = next(i for i, v in enumerate(verdicts) if v.name == PREFIX_CACHE)
        if verdicts[i].on:  # the hit rate so far, read after the probe
            verdicts[i] = prefix_cache_verdict(log, asked.prefix_cache, prefix_counters(read_metrics(a.url, headers)))
    for v in verdicts:
        _say(v, v.line(), a.json)
    failed = [v.name for v in verdicts if v.failed]
    if failed:
        _say(None, f"FAILED ({', '.join(failed)}): an optimisation that was asked for is not active; fix it or "
             f"remove it from the serve command (environment read from {env_from}).", a.json, level="error",
             failed=failed)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
