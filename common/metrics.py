"""The one home of our `/metrics` scrapes: vLLM's Prometheus counters, read with prometheus_client's parser.

Used by the watchdog's liveness probe (engine progress) and traffic line, the start-up self-check (draft acceptance,
prefix-cache hit rate) and the benchmark harness. vLLM's counters are cumulative since the server started: a rate over a
window is the difference of two scrapes. Sample names are matched, not family names: a counter family
also carries a `_created` sample (its start time), which must never be summed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import zip_longest

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

TOKENS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUESTS = "vllm:request_success_total"  # finished requests, one sample per finish reason (0.32-0.34)
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"  # prompt tokens looked up in the prefix cache (0.32-0.34)
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # ... and the ones found cached


def samples(text: str) -> Iterator[Sample]:
    """Every sample of a Prometheus text exposition."""
    for family in text_string_to_metric_families(text):
        yield from family.samples


def tokens_total(text: str) -> float:
    """Prompt + generated tokens so far, over all engines: any forward progress of the engine moves it."""
    return sum(s.value for s in samples(text) if s.name in TOKENS)


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's spec-decode counters, summed over engines. Per vLLM (`SpecDecodingProm`): acceptance rate =
    accepted / draft tokens; mean acceptance length = 1 + accepted / drafts; per position = accepted / drafts."""

    draft_tokens: int
    accepted: int
    drafts: int | None = None  # absent on servers that predate the counter
    per_pos: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        drafts = None if self.drafts is None or other.drafts is None else self.drafts + sign * other.drafts
        per_pos = tuple(a + sign * b for a, b in zip_longest(self.per_pos, other.per_pos, fillvalue=0))
        return SpecCounters(self.draft_tokens + sign * other.draft_tokens, self.accepted + sign * other.accepted,
                            drafts, per_pos)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step, counting the bonus token: 1 + accepted / drafts."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_pos_rate(self) -> list[float] | None:
        """Accepted per draft at each draft position (None without drafts)."""
        return [a / self.drafts for a in self.per_pos] if self.drafts else None

    def to_json(self) -> dict:
        """ling-bench's report fields (the names of vLLM's counters)."""
        return {
            "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens, "num_accepted_tokens": self.accepted,
            "accepted_per_pos": list(self.per_pos), "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_pos": self.per_pos_rate,
        }


ZERO = SpecCounters(0, 0, 0)


def spec_counters(text: str) -> SpecCounters | None:
    """The spec-decode counters of a scrape, or None when the server runs without speculation."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for s in samples(text):
        if s.name == PER_POS:
            pos = int(s.labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
        elif s.name in (DRAFTS, DRAFT_TOKENS, ACCEPTED):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    if DRAFT_TOKENS not in sums or ACCEPTED not in sums:
        return None
    drafts = round(sums[DRAFTS]) if DRAFTS in sums else None
    pos = tuple(round(per_pos.get(i, 0.0)) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(round(sums[DRAFT_TOKENS]), round(sums[ACCEPTED]), drafts, pos)


@dataclass(frozen=True)
class PrefixCache:
    """vLLM's prefix-cache counters (prompt tokens), summed over engines; a window's numbers are a difference."""

    queries: int
    hits: int

    def __sub__(self, before: PrefixCache) -> PrefixCache:
        return PrefixCache(self.queries - before.queries, self.hits - before.hits)

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None

    def to_json(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "hit_rate": self.hit_rate}


def prefix_cache(text: str) -> PrefixCache | None:
    """The prefix-cache counters of a scrape; None when the server exports neither."""
    sums: dict[str, float] = {}
    for s in samples(text):
        if s.name in (PREFIX_QUERIES, PREFIX_HITS):
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return PrefixCache(round(sums.get(PREFIX_QUERIES, 0.0)), round(sums.get(PREFIX_HITS, 0.0))) if sums else None


@dataclass(frozen=True)
class Counters:
    """What one scrape says the engine has done since it started; a window is the difference of two."""

    tokens: float  # prompt + generated
    cache: PrefixCache | None
    spec: SpecCounters | None
    requests: float | None = None  # finished, whatever the reason (None: not exported)

    def __sub__(self, before: Counters) -> Counters:
        return Counters(self.tokens - before.tokens,
                        self.cache - before.cache if self.cache and before.cache else self.cache,
                        self.spec - before.spec if self.spec and before.spec else self.spec,
                        None if self.requests is None or before.requests is None else self.requests - before.requests)


def counters(text: str) -> Counters:
    requests = [s.value for s in samples(text) if s.name == REQUESTS]
    return Counters(tokens_total(text), prefix_cache(text), spec_counters(text), sum(requests) if requests else None)


def read_metrics(url: str, headers: Mapping[str, str] | None = None, timeout: float = 5.0) -> str:
    """GET {url}/metrics as text; raises requests' errors and on a non-200 answer."""
    import requests

    r = requests.get(f"{url.rstrip('/')}/metrics", headers=dict(headers or {}), timeout=timeout)
    r.raise_for_status()
    return r.text


def read_spec_counters(url: str, headers: Mapping[str, str] | None = None,
                       timeout: float = 5.0) -> SpecCounters | None:
    """Scrape the server's spec-decode counters; None when it speculates not (no such counters)."""
    return spec_counters(read_metrics(url, headers, timeout))
