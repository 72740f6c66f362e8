"""ling-bench: TTFT, prefill/decode tok/s and spec-decode acceptance against a vLLM server.

Each case (one fixed-seed prompt) runs `--warmup` discarded batches, then `--repeats` measured
batches of `--concurrency` parallel streamed requests; every metric is reported as the median with
min and max over the measured requests. Results go to stdout as a markdown table and, with
`--out`, to JSON.
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import reduce
from itertools import count

import requests

from ling_bench.client import (BenchError, Endpoint, RequestResult, Sampling, served_models, stream_request,
                               token_counter)
from ling_bench.probes import GpuMemSampler, SpecCounters, read_spec_settled
from ling_bench.prompts import SETS, Prompt, build_prompts

SCHEMA = "ling-bench/1"
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
    requests: list[RequestResult]  # measured only: warm-up requests are never stored
    output_tok_s: list[float]  # per repetition: all completion tokens / wall time (includes prefill)
    spec: SpecCounters | None  # counter deltas over the measured repetitions

    def stats(self) -> dict[str, Stat | None]:
        rs = self.requests
        return {
            "ttft_s": Stat.of([r.ttft_s for r in rs]),
            "prefill_tok_s": Stat.of([r.prefill_tok_s for r in rs]),
            "decode_tok_s": Stat.of([d for r in rs if (d := r.decode_tok_s) is not None]),
            "output_tok_s": Stat.of(self.output_tok_s),
            "completion_tokens": Stat.of([r.completion_tokens for r in rs]),
            "chunks": Stat.of([r.chunks for r in rs]),
        }

    def to_json(self) -> dict:
        p = self.prompt
        return {
            "name": p.name, "set": p.kind, "target_tokens": p.target_tokens,
            "prompt_tokens": self.requests[0].prompt_tokens, "prompt_tokens_counted": p.tokens,
            "prompt_sha256": hashlib.sha256(p.text.encode()).hexdigest(),
            **{k: asdict(s) if s else None for k, s in self.stats().items()},
            "spec": self.spec.to_json() if self.spec else None,
            "requests": [
                {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens, "chunks": r.chunks,
                 "ttft_s": r.ttft_s, "prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s}
                for r in self.requests
            ],
        }


class Runner:
    """Sends batches of identical prompts, one keep-alive session per concurrent lane."""

    def __init__(self, ep: Endpoint, sampling: Sampling, concurrency: int, prefix_cache: bool = False):
        self.ep, self.sampling, self.prefix_cache = ep, sampling, prefix_cache
        self.sessions = [requests.Session() for _ in range(concurrency)]
        self._run_id, self._seq = uuid.uuid4().hex[:12], count()  # salts unique across runs too

    def batch(self, text: str) -> tuple[list[RequestResult], float]:
        """One repetition: all lanes at once. Returns (results, completion tokens per wall second)."""
        salts = [None if self.prefix_cache else f"ling-bench-{self._run_id}-{next(self._seq)}"
                 for _ in self.sessions]
        with ThreadPoolExecutor(len(self.sessions)) as pool:
            results = list(pool.map(lambda s, salt: stream_request(s, self.ep, text, self.sampling, salt),
                                    self.sessions, salts))
        wall = max(r.end for r in results) - min(r.start for r in results)
        return results, sum(r.completion_tokens for r in results) / wall if wall > 0 else 0.0

    def case(self, prompt: Prompt, warmup: int, repeats: int) -> CaseResult:
        for _ in range(warmup):
            self.batch(prompt.text)
        before = read_spec_settled(self.sessions[0], self.ep)
        reps = [self.batch(prompt.text) for _ in range(repeats)]
        after = read_spec_settled(self.sessions[0], self.ep)
        spec = after - before if before and after else None
        return CaseResult(prompt, [r for rs, _ in reps for r in rs], [tps for _, tps in reps], spec)

    def close(self) -> None:
        for s in self.sessions:
            s.close()


def _fmt(stat: Stat | None, scale: float = 1.0, digits: int = 1) -> str:
    """`median (min-max)`."""
    if stat is None:
        return "-"
    return f"{stat.median * scale:.{digits}f} ({stat.min * scale:.{digits}f}-{stat.max * scale:.{digits}f})"


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _row(c: CaseResult) -> str:
    s, spec = c.stats(), c.spec
    cells = [
        c.prompt.name, str(c.requests[0].prompt_tokens), _fmt(s["completion_tokens"], digits=0),
        _fmt(s["ttft_s"], 1000), _fmt(s["prefill_tok_s"], digits=0), _fmt(s["decode_tok_s"]),
        _fmt(s["output_tok_s"]), _num(spec and spec.acceptance_rate, ".1%"),
        _num(spec and spec.mean_acceptance_length, ".2f"),
    ]
    return "| " + " | ".join(cells) + " |"


def _spec_line(spec: dict | None) -> str:
    if spec is None:
        return "Spec decode: no `vllm:spec_decode_*` counters on /metrics (speculation off or no metrics)."
    if spec["acceptance_rate"] is None:
        return "Spec decode: counters present, but nothing was drafted during the measured requests."
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
        f"{cfg['repeats']} repetitions after {cfg['warmup']} warm-up, concurrency {cfg['concurrency']}, "
        f"seed {cfg['seed']}; prompt sizes from {sizes}; cells are median (min-max)",
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
    p.add_argument("--warmup", type=_int_at_least(0), default=1, help="discarded batches per case")
    p.add_argument("--repeats", type=_int_at_least(1), default=5, help="measured batches per case")
    p.add_argument("--concurrency", type=_int_at_least(1), default=1, help="parallel requests per batch")
    p.add_argument("--prefix-cache", action="store_true",
                   help="allow prefix-cache hits (default: a fresh vLLM cache_salt per request)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--gpu-mem", action="store_true", help="record peak nvidia-smi memory.used")
    p.add_argument("--out", help="write the JSON report here")
    return p


def _resolve(args: argparse.Namespace, session: requests.Session) -> tuple[Endpoint, int | None]:
    models = served_models(session, args.base_url, args.api_key)
    if args.model is None and not models:
        raise BenchError(f"{args.base_url}/v1/models listed no model; is the server up? Else pass --model")
    if args.model is not None and models and args.model not in models:
        raise BenchError(f"--model {args.model!r} is not served at {args.base_url}; "
                         f"it serves {sorted(models)}")
    model = args.model or next(iter(models))
    return Endpoint(args.base_url, model, args.chat, args.api_key, args.timeout), models.get(model)


def _check_fits(long_tokens: list[int], max_tokens: int, max_model_len: int | None) -> None:
    if max_model_len and (too_long := [t for t in long_tokens if t + max_tokens > max_model_len]):
        raise BenchError(
            f"--long-tokens {too_long} + --max-tokens {max_tokens} exceed the server's max_model_len "
            f"{max_model_len}; use sizes up to {max_model_len - max_tokens} "
            "or raise --max-model-len on the server"
        )


def run(args: argparse.Namespace) -> tuple[dict, list[CaseResult]]:
    """Build the prompts, measure every case; returns (JSON report, finished cases).

    A failure mid-run (say HTTP 400 on the 64K case) keeps the finished cases and records the error.
    """
    with requests.Session() as session:
        ep, max_model_len = _resolve(args, session)
        if "long" in args.sets:
            _check_fits(args.long_tokens, args.max_tokens, max_model_len)
        count_tokens, source = token_counter(session, ep)
        prompts = build_prompts(args.sets, args.seed, args.num_prompts, args.long_tokens, count_tokens)
    runner = Runner(ep, Sampling(args.max_tokens, args.temperature, args.ignore_eos),
                    args.concurrency, args.prefix_cache)
    cases: list[CaseResult] = []
    error, t0 = None, time.time()
    gpu = GpuMemSampler() if args.gpu_mem else None
    try:
        with gpu or nullcontext():
            for i, prompt in enumerate(prompts, 1):
                print(f"[{i}/{len(prompts)}] {prompt.name}: {prompt.tokens} prompt tokens",
                      file=sys.stderr, flush=True)
                cases.append(runner.case(prompt, args.warmup, args.repeats))
    except (BenchError, requests.RequestException) as e:
        error = f"{prompts[len(cases)].name}: {e}"
    finally:
        runner.close()
    specs = [c.spec for c in cases if c.spec]
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


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
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
