"""Server-side probes: vLLM's spec-decode counters from /metrics, peak GPU memory from nvidia-smi.

vLLM's counters are cumulative since server start, so acceptance for a run is the difference of two
scrapes; per vLLM (`SpecDecodingProm`): acceptance rate = accepted / draft tokens, mean acceptance
length = 1 + accepted / drafts, per-position rate = accepted_per_pos / drafts.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from itertools import zip_longest

import requests
from prometheus_client.parser import text_string_to_metric_families

from ling_bench.client import Endpoint

_DRAFTS = "vllm:spec_decode_num_drafts_total"
_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


@dataclass(frozen=True)
class SpecCounters:
    """Spec-decode counters summed over engines (one sample per `engine` label)."""

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
        return SpecCounters(self.draft_tokens + sign * other.draft_tokens,
                            self.accepted + sign * other.accepted, drafts, per_pos)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify step, counting the bonus token: 1 + accepted / drafts."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def per_pos_rate(self) -> list[float] | None:
        return [a / self.drafts for a in self.per_pos] if self.drafts and self.per_pos else None

    def to_json(self) -> dict:
        return {
            "num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
            "num_accepted_tokens": self.accepted, "accepted_per_pos": list(self.per_pos),
            "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_pos": self.per_pos_rate,
        }


def parse_spec(metrics_text: str) -> SpecCounters | None:
    """Spec counters from Prometheus text, or None when the server runs without speculation."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:  # match sample names: counter families also carry `_created`
            if s.name == _PER_POS:
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            elif s.name in (_DRAFTS, _DRAFT_TOKENS, _ACCEPTED):
                sums[s.name] = sums.get(s.name, 0.0) + s.value
    if _DRAFT_TOKENS not in sums or _ACCEPTED not in sums:
        return None
    drafts = round(sums[_DRAFTS]) if _DRAFTS in sums else None
    pos = tuple(round(per_pos.get(i, 0.0)) for i in range(max(per_pos, default=-1) + 1))
    return SpecCounters(round(sums[_DRAFT_TOKENS]), round(sums[_ACCEPTED]), drafts, pos)


def read_spec(session: requests.Session, ep: Endpoint) -> SpecCounters | None:
    """Scrape GET /metrics; None if the server has no metrics or no spec counters."""
    try:
        resp = session.get(ep.url("/metrics"), headers=ep.headers, timeout=30)
    except requests.RequestException:
        return None
    return parse_spec(resp.text) if resp.status_code == 200 else None


def read_spec_settled(session: requests.Session, ep: Endpoint, pause_s: float = 0.05,
                      tries: int = 20) -> SpecCounters | None:
    """Read until two scrapes agree: the last step's stats may land just after the stream ends."""
    last = read_spec(session, ep)
    for _ in range(tries):
        time.sleep(pause_s)
        now = read_spec(session, ep)
        if now == last:
            break
        last = now
    return last


@dataclass
class GpuMemSampler:
    """Peak `memory.used` (MiB) per GPU, polled from nvidia-smi in a thread while in the `with`.

    Silently records nothing without nvidia-smi, or where it reports [N/A] (unified-memory GB10).
    """

    interval_s: float = 0.5
    command: str = "nvidia-smi"
    peak_mib: list[int] | None = None
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def __enter__(self) -> GpuMemSampler:
        if shutil.which(self.command):
            self._thread = threading.Thread(target=self._poll, name="gpu-mem", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _poll(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self.interval_s):
                self._sample()  # one last reading at the end of the run
                return

    def _sample(self) -> None:
        try:
            out = subprocess.run([self.command, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return
        try:
            used = [int(float(v)) for v in out.split()]
        except ValueError:
            return  # "[N/A]" / "Not Supported"
        if used:
            old = self.peak_mib or [0] * len(used)
            self.peak_mib = [max(a, b) for a, b in zip_longest(old, used, fillvalue=0)]
