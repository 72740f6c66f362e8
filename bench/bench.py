"""ling-bench: TTFT, prefill/decode tok/s and MTP acceptance of a vLLM server on fixed-seed prompt sets.

The measuring is `vllm bench serve`'s (`ling_bench.vllm_bench`): its clients, its usage-counted tokens,
its spec-decode counter deltas. ling-bench adds what that CLI lacks: fixed-seed code, prose and long
prompts, the long ones sized to the token by the server's own /tokenize (`ling_bench.prompts`); one
case per prompt, each request with a fresh prefix-cache salt; warm-up kept apart from the measured
requests; median (min-max) per request; a refusal to start a case that cannot fit max_model_len; peak
GPU memory. Each case runs `--warmup` x `--concurrency` discarded requests, then `--repeats` x
`--concurrency` measured ones, at most `--concurrency` in flight. Markdown goes to stdout, JSON to
`--out`; `--write-dataset FILE` writes the prompts as a `vllm bench serve --dataset-name custom` file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import reduce
from itertools import count

import requests

from ling_bench import agent
from ling_bench.client import BenchError, Endpoint, resolve_endpoint, server_error, token_counter
from ling_bench.gpu_memory import GpuMemSampler
from ling_bench.prompts import SETS, Prompt, build_prompts, write_dataset
from ling_bench.vllm_bench import CaseRun, Sampling, run_case

SCHEMA = "ling-bench/2"
MIN_LONG_TOKENS = 256


@dataclass(frozen=True)
class Stat:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Stat | None:
        return cls(statistics.median(values), min(values), max(values)) if values else None


@dataclass(frozen=True)
class CaseResult:
    prompt: Prompt
    run: CaseRun  # measured requests only: warm-up requests are never stored

    def stats(self) -> dict[str, Stat | None]:
        rs = self.run.requests
        return {
            "ttft_s": Stat.of([r.ttft_s for r in rs]),
            "prefill_tok_s": Stat.of([r.prefill_tok_s for r in rs]),
            "decode_tok_s": Stat.of([d for r in rs if (d := r.decode_tok_s) is not None]),
            "completion_tokens": Stat.of([r.completion_tokens for r in rs]),
            "chunks": Stat.of([r.chunks for r in rs]),
        }

    def to_json(self) -> dict:
        p, rs = self.prompt, self.run.requests
        return {
            "name": p.name, "set": p.kind, "target_tokens": p.target_tokens,
            "prompt_tokens": rs[0].prompt_tokens, "prompt_tokens_counted": p.tokens,
            "prompt_sha256": hashlib.sha256(p.text.encode()).hexdigest(),
            **{k: asdict(s) if s else None for k, s in self.stats().items()},
            "output_tok_s": self.run.output_tok_s,
            "spec": self.run.spec.to_json() if self.run.spec else None,
            "requests": [
                {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "chunks": r.chunks,
                 "ttft_s": r.ttft_s, "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s}
                for r in rs
            ],
        }


class Salts:
    """Fresh vLLM `cache_salt`s, unique across runs too, so no request reuses another's prefix cache;
    none at all with --prefix-cache."""

    def __init__(self, enabled: bool):
        self.enabled, self._run, self._seq = enabled, uuid.uuid4().hex[:12], count()

    def take(self, n: int) -> list[str | None]:
        return [f"ling-bench-{self._run}-{next(self._seq)}" if self.enabled else None for _ in range(n)]


def _fmt(stat: Stat | None, scale: float = 1.0, digits: int = 1) -> str:
    """`median (min-max)`."""
    if stat is None:
        return "-"
    return f"{stat.median * scale:.{digits}f} ({stat.min * scale:.{digits}f}-{stat.max * scale:.{digits}f})"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(c: CaseResult) -> str:
    s, spec = c.stats(), c.run.spec
    cells = [
        c.prompt.name, str(c.run.requests[0].prompt_tokens), _fmt(s["completion_tokens"], digits=0),
        _fmt(s["ttft_s"], 1000), _fmt(s["prefill_tok_s"], digits=0), _fmt(s["decode_tok_s"]),
        f"{c.run.output_tok_s:.1f}", _num(spec and spec.acceptance_rate, ".1%"),
        _num(spec and spec.mean_acceptance_length, ".2f"),
    ]
    return "| " + " | ".join(cells) + " |"


def _spec_line(spec: dict | None) -> str:
    if spec is None:
        return ("Spec decode: no draft tokens counted on /metrics during the measured requests "
                "(speculation off, or no metrics).")
    line = f"Spec decode (all cases): acceptance {spec['acceptance_rate']:.1%}"
    if spec["mean_acceptance_length"] is not None:
        line += f", mean acceptance length {spec['mean_acceptance_length']:.2f}"
    if spec["acceptance_rate_per_pos"]:
        line += ", per position " + ", ".join(f"{x:.1%}" for x in spec["acceptance_rate_per_pos"])
    return line


def markdown(report: dict, cases: list[CaseResult]) -> str:
    cfg, srv = report["config"], report["server"]
    by_server = report["token_count_source"] == "server"
    sizes = "the server's /tokenize" if by_server else "an estimate (~4 chars/token)"
    lines = [
        f"**ling-bench** `{srv['model']}` at {srv['base_url']}{srv['endpoint']}: "
        f"temperature {cfg['temperature']}, max_tokens {cfg['max_tokens']}, ignore_eos {cfg['ignore_eos']}; "
        f"{cfg['repeats']} x {cfg['concurrency']} requests after {cfg['warmup']} x {cfg['concurrency']} warm-up, "
        f"concurrency {cfg['concurrency']}, seed {cfg['seed']}; prompt sizes from {sizes}; measured by vLLM's "
        f"`vllm bench serve`; cells are median (min-max) over requests",
        "",
        "| case | prompt tok | out tok | TTFT ms | prefill tok/s | decode tok/s | output tok/s | accept "
        "| accept len |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *map(_row, cases),
        "",
        _spec_line(report["spec"]),
    ]
    if report["gpu_mem_peak_mib"]:
        lines.append(f"Peak GPU memory.used (MiB, per GPU): {report['gpu_mem_peak_mib']}")
    return "\n".join(lines)


def _int_at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} must be >= {low}")
        return value
    return parse


def _sets(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if bad := [s for s in names if s not in SETS]:
        raise argparse.ArgumentTypeError(f"unknown set(s) {bad}; choose a comma list of {', '.join(SETS)}")
    return names


def _long_tokens(text: str) -> list[int]:
    parse = _int_at_least(MIN_LONG_TOKENS)
    return [parse(t) for t in text.split(",") if t.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ling-bench", description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=("serve", "agent"), default="serve",
                   help="serve: the prompt sets below (default); agent: multi-turn agent sessions "
                        "(ling_bench.agent, --agent-* flags)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--model", help="served model name (default: the first in /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    p.add_argument("--chat", action="store_true", help="use /v1/chat/completions (default /v1/completions)")
    p.add_argument("--sets", type=_sets, default=list(SETS), help="comma list of code,prose,long")
    p.add_argument("--num-prompts", type=_int_at_least(1), default=2, help="prompts per short set")
    p.add_argument("--long-tokens", type=_long_tokens, default=[4096, 16384, 65536],
                   help="long-context prompt sizes in tokens, comma list (default 4096,16384,65536)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=_int_at_least(2), default=256,
                   help="tokens decoded per request (>= 2: decode tok/s excludes the first token)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (then runs may decode different lengths)")
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="discarded requests per case, x concurrency")
    p.add_argument("--repeats", type=_int_at_least(1), default=5, help="measured requests per case, x concurrency")
    p.add_argument("--concurrency", type=_int_at_least(1), default=1, help="requests in flight at most")
    p.add_argument("--prefix-cache", action="store_true",
                   help="allow prefix-cache hits (default: a fresh vLLM cache_salt per request)")
    p.add_argument("--gpu-mem", action="store_true", help="record peak nvidia-smi memory.used")
    p.add_argument("--out", help="write the JSON report here")
    p.add_argument("--write-dataset", metavar="FILE",
                   help="write the prompts as a vLLM custom dataset (JSONL) and exit without measuring")
    agent.add_arguments(p)
    return p


def _check_fits(long_tokens: list[int], max_tokens: int, max_model_len: int | None) -> None:
    if max_model_len and (too_long := [t for t in long_tokens if t + max_tokens > max_model_len]):
        raise BenchError(
            f"--long-tokens {too_long} + --max-tokens {max_tokens} exceed the server's max_model_len "
            f"{max_model_len}; use sizes up to {max_model_len - max_tokens} "
            "or raise --max-model-len on the server"
        )


def prepare(args: argparse.Namespace) -> tuple[Endpoint, int | None, str, list[Prompt]]:
    """Resolve the served model, check the long sizes fit, build the prompts with the server's tokenizer."""
    with requests.Session() as session:
        ep, max_model_len = resolve_endpoint(args, session)
        if "long" in args.sets:
            _check_fits(args.long_tokens, args.max_tokens, max_model_len)
        count_tokens, source = token_counter(session, ep)
        prompts = build_prompts(args.sets, args.seed, args.num_prompts, args.long_tokens, count_tokens)
    return ep, max_model_len, source, prompts


def run(args: argparse.Namespace) -> tuple[dict, list[CaseResult]]:
    """Measure every case; returns (JSON report, finished cases).

    A failure mid-run (say HTTP 400 on the 64K case) keeps the finished cases and records the error.
    """
    ep, max_model_len, source, prompts = prepare(args)
    sampling, salts = Sampling(args.max_tokens, args.temperature, args.ignore_eos), Salts(not args.prefix_cache)
    cases: list[CaseResult] = []
    error, t0 = None, time.time()
    gpu = GpuMemSampler() if args.gpu_mem else None
    try:
        with gpu or nullcontext():
            for i, prompt in enumerate(prompts, 1):
                print(f"[{i}/{len(prompts)}] {prompt.name}: {prompt.tokens} prompt tokens",
                      file=sys.stderr, flush=True)
                measured = run_case(ep, prompt.text, sampling, salts.take(args.warmup * args.concurrency),
                                    salts.take(args.repeats * args.concurrency), args.concurrency)
                cases.append(CaseResult(prompt, measured))
    except BenchError as e:
        prompt = prompts[len(cases)]
        detail = server_error(ep, prompt.text)
        error = f"{prompt.name}: {e}" + (f" (the server says: {detail})" if detail else "")
    specs = [c.run.spec for c in cases if c.run.spec]
    report = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
        "duration_s": time.time() - t0,
        "server": {"base_url": ep.base_url, "model": ep.model, "max_model_len": max_model_len,
                   "endpoint": "/v1/chat/completions" if ep.chat else "/v1/completions"},
        "config": {k: getattr(args, k) for k in ("seed", "sets", "num_prompts", "long_tokens", "max_tokens",
                                                  "temperature", "ignore_eos", "warmup", "repeats",
                                                  "concurrency", "prefix_cache")},
        "token_count_source": source,
        "error": error,
        "cases": [c.to_json() for c in cases],
        "spec": reduce(lambda a, b: a + b, specs).to_json() if specs else None,
        "gpu_mem_peak_mib": gpu.peak_mib if gpu else None,
    }
    return report, cases


def dataset(args: argparse.Namespace) -> int:
    """--write-dataset: the cases as `vllm bench serve --dataset-name custom` lines, and how to replay them."""
    ep, _, source, prompts = prepare(args)
    write_dataset(args.write_dataset, prompts, args.max_tokens)
    backend = "openai-chat --endpoint /v1/chat/completions" if ep.chat else "openai"
    print(f"wrote {len(prompts)} prompts (sized by {source}) to {args.write_dataset}; replay with:\n"
          f"  vllm bench serve --backend {backend} --base-url {ep.base_url} --model {ep.model} "
          f"--dataset-name custom --dataset-path {args.write_dataset} --disable-shuffle --skip-chat-template "
          f"--num-prompts {len(prompts)} --custom-output-len {args.max_tokens}"
          f"{' --ignore-eos' if args.ignore_eos else ''} --temperature {args.temperature}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workload == "agent":
        return agent.main(args)
    try:
        if args.write_dataset:
            return dataset(args)
        report, cases = run(args)
    except (BenchError, ValueError, requests.RequestException) as e:
        print(f"ling-bench: error: {e}", file=sys.stderr)
        return 1
    print(markdown(report, cases))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    if report["error"]:
        print(f"ling-bench: error: {report['error']} (stopped; finished cases are reported)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
