"""One benchmark case through `vllm bench serve`'s own engine: `vllm.benchmarks.serve.benchmark()`.

vLLM's benchmark streams the requests with its OpenAI clients, times TTFT and every chunk, counts
output tokens from `usage.completion_tokens` (it asks for `stream_options.include_usage`) and takes
the spec-decode counter deltas from /metrics around the run. What ling-bench adds per case is what
its CLI cannot express: a fresh vLLM `cache_salt` per request (so the prefix cache never hides
prefill), warm-up requests that are separate from the measured ones, per-request prefill and decode
rates, and a refusal to guess token counts when a server streams no usage.

`benchmark()` keeps the same keyword arguments in vLLM 0.32, 0.33 and 0.34; we pass only those.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ling_bench.client import BenchError, Endpoint

from ling_common.metrics import SpecCounters  # the one home of spec-decode counter arithmetic


@dataclass(frozen=True)
class Sampling:
    """Greedy, fixed-length decoding by default, so every repetition decodes the same tokens."""

    max_tokens: int = 256
    temperature: float = 0.0
    ignore_eos: bool = True  # vLLM extension: decode exactly max_tokens


@dataclass(frozen=True)
class RequestResult:
    """One measured request, from vLLM's per-request lists."""

    prompt_tokens: int  # usage.prompt_tokens
    completion_tokens: int  # usage.completion_tokens
    chunks: int  # streamed chunks vLLM's client timed; fewer than completion_tokens under spec decode
    ttft_s: float
    latency_s: float  # first byte sent to last token chunk
    max_gap_s: float = 0.0  # the longest wait between two streamed chunks: one stall, or every step slower?

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens / TTFT: the prompt is processed before the first token can exist."""
        return self.prompt_tokens / self.ttft_s

    @property
    def decode_tok_s(self) -> float | None:
        """(completion_tokens - 1) / (latency - TTFT) = 1 / vLLM's TPOT: the first token belongs to prefill."""
        span = self.latency_s - self.ttft_s
        return (self.completion_tokens - 1) / span if self.completion_tokens > 1 and span > 0 else None


@dataclass(frozen=True)
class CaseRun:
    requests: list[RequestResult]
    output_tok_s: float  # vLLM's output throughput: all completion tokens / the case's wall time
    spec: SpecCounters | None  # None: no draft tokens counted (speculation off, or no /metrics)


class _UsageOnly:
    """Handed to vLLM as the tokenizer. vLLM counts output tokens from `usage` and re-tokenises the
    generated text only for a stream that carried none; we have no tokenizer to guess with (and chunks
    undercount spec decode), so a call marks the run as unusable (raised once vLLM has cleaned up)."""

    def __init__(self) -> None:
        self.called = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.called = True
        return SimpleNamespace(input_ids=[])


def _spec(result: dict[str, Any]) -> SpecCounters | None:
    if "spec_decode_num_drafts" not in result:  # vLLM reports the deltas only when draft tokens moved
        return None
    drafts = int(result["spec_decode_num_drafts"])
    per_pos = tuple(round(r * drafts) for r in result.get("spec_decode_per_position_acceptance_rates") or ())
    return SpecCounters(drafts=drafts, draft_tokens=int(result["spec_decode_draft_tokens"]),
                        accepted=int(result["spec_decode_accepted_tokens"]), per_pos=per_pos)


def _requests(result: dict[str, Any]) -> list[RequestResult]:
    """Per-request records; latency is TTFT plus the chunk gaps."""
    return [RequestResult(int(n_in), int(n_out), 1 + len(itl), ttft, ttft + sum(itl), max(itl, default=0.0))
            for n_in, n_out, ttft, itl in zip(result["input_lens"], result["output_lens"], result["ttfts"],
                                              result["itls"])]


def _failure(result: dict[str, Any]) -> str | None:
    errors = [e for e in result["errors"] if e]
    if not errors:
        return None
    last_line = errors[0].strip().splitlines()[-1] if errors[0].strip() else "unknown error"
    return f"{len(errors)} of {len(result['errors'])} requests failed: {last_line}"


def benchmark(ep: Endpoint, text: str, sampling: Sampling, salts: list[str | None], concurrency: int) -> dict:
    """`len(salts)` identical requests of `text`, at most `concurrency` in flight, through vLLM's
    benchmark; returns its result dict. vLLM's own summary goes to stderr."""
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.serve import TaskType
    from vllm.benchmarks.serve import benchmark as vllm_benchmark

    usage_only = _UsageOnly()
    requests = [SampleRequest(prompt=text, prompt_len=0, expected_output_len=sampling.max_tokens,
                              chat_messages=[{"role": "user", "content": text}] if ep.chat else None,
                              request_overrides={"cache_salt": salt} if salt else None)
                for salt in salts]
    run = vllm_benchmark(
        task_type=TaskType.GENERATION, endpoint_type="openai-chat" if ep.chat else "openai",
        api_url=ep.url("/v1/chat/completions" if ep.chat else "/v1/completions"), base_url=ep.base_url.rstrip("/"),
        model_id=ep.model, model_name=ep.model, tokenizer=usage_only, input_requests=requests, logprobs=None,
        request_rate=float("inf"), burstiness=1.0, disable_tqdm=True, num_warmups=0, profile=False,
        selected_percentile_metrics=["ttft", "tpot", "itl", "e2el"], selected_percentiles=[50.0, 99.0],
        ignore_eos=sampling.ignore_eos, goodput_config_dict={}, max_concurrency=concurrency, lora_modules=None,
        extra_headers=ep.headers or None, extra_body={"temperature": sampling.temperature},
        ready_check_timeout_sec=0,  # its ready check would send request 0 (and its salt) once more
    )
    with contextlib.redirect_stdout(sys.stderr):
        result = asyncio.run(run)
    if usage_only.called:
        raise BenchError("a stream carried no usage; the server must honour stream_options.include_usage "
                         "(tokens are never counted from stream chunks)")
    return result


def run_case(ep: Endpoint, text: str, sampling: Sampling, warmup_salts: list[str | None],
             salts: list[str | None], concurrency: int) -> CaseRun:
    """Warm-up requests (discarded, their own salts), then the measured ones."""
    if warmup_salts:
        if error := _failure(benchmark(ep, text, sampling, warmup_salts, concurrency)):
            raise BenchError(f"warm-up: {error}")
    result = benchmark(ep, text, sampling, salts, concurrency)
    if error := _failure(result):
        raise BenchError(error)
    return CaseRun(_requests(result), float(result["output_throughput"]), _spec(result))
