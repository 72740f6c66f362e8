"""An agent's turn on one engine: `new` tokens after a `history` the prefix cache holds, against the same length
prefilled fresh (`python -m ling_bench.fullsize MODEL --prefill= --turn 32768+2048`).

An agent re-sends its whole conversation every turn; with the prefix cache the engine prefills only what follows
the last cached block boundary (for this hybrid model, the last KDA state checkpoint: vLLM's `mamba_cache_mode`
"align", whose block is the attention block widened to a KDA state page, 1,920 tokens at full size on vLLM 0.34).
The served agent workload (`ling-bench --workload agent`) measures turns through the HTTP server and the watchdog;
this phase times the same turn inside the engine, so a slow cached turn is the engine's, with each request's hits
read from vLLM's own prefix-cache counters and, with `--kernels`, the CUDA kernels of a cached and a fresh turn.

Per repeat, fresh token ids: a fresh prompt of history + new tokens (no hits: nothing shares its ids); then the
history alone (it primes the cache, as the previous turn did) and the history with new tokens after it (the
cached turn), each request generating 1 + `decode` tokens. Times are vLLM's own for each request
(`RequestOutput.metrics`, kept with log stats on): the time to its first token from its arrival at the engine's
front end, and its decode step, the span from its first token to its last over `decode`. Both come from the one
request, so no difference of two noisy wall times can go negative.
"""

from __future__ import annotations

import random
import statistics

from ling_common.metrics import PREFIX_HITS, PREFIX_QUERIES
from ling_tuning.step_kernels import greedy, request_kernels, timed

# vLLM's counters as `LLM.get_metrics()` names them: the Prometheus family names, without the exposition's `_total`
HITS, QUERIES = PREFIX_HITS.removesuffix("_total"), PREFIX_QUERIES.removesuffix("_total")
TOP = 15  # kernels a turn's profile lists by name


def parse_turns(text: str) -> list[tuple[int, int]]:
    """`32768+2048,61440+2048` -> [(32768, 2048), (61440, 2048)]: history and new tokens, each at least 1.
    Raises ValueError naming the rule and an example."""
    turns = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        history, plus, new = item.partition("+")
        try:
            turn = (int(history), int(new))
        except ValueError:
            turn = None
        if not plus or turn is None or min(turn) < 1:
            raise ValueError(f"{item!r}: a turn is HISTORY+NEW, two whole numbers of tokens, each at least 1, "
                             f"e.g. 32768+2048")
        turns.append(turn)
    if not turns:
        raise ValueError(f"{text!r}: no turn given; e.g. 32768+2048 or 16384+2048,61440+2048")
    return turns


def _counters(llm) -> tuple[float, float]:
    """(queries, hits) of vLLM's prefix cache so far: prompt tokens looked up, and found."""
    got = {m.name: getattr(m, "value", 0) for m in llm.get_metrics() if m.name in (HITS, QUERIES)}
    return got.get(QUERIES, 0.0), got.get(HITS, 0.0)


def _request(llm, prompt: list[int], max_tokens: int) -> tuple[float, float, float]:
    """One greedy request: (seconds to its first token, seconds a decode step, prompt tokens the prefix cache
    gave it), the times from vLLM's request stats (first_token_latency; last_token_ts - first_token_ts over the
    tokens after the first)."""
    hits = _counters(llm)[1]
    stats = greedy(llm, prompt, max_tokens)[0].metrics
    if stats is None or not stats.first_token_ts:
        raise RuntimeError("vLLM returned no request stats (RequestOutput.metrics): the engine needs log stats on")
    step = (stats.last_token_ts - stats.first_token_ts) / (max_tokens - 1)
    return stats.first_token_latency, step, _counters(llm)[1] - hits


def turn_phase(llm, history: int, new: int, decode: int, repeats: int, vocab: int, kernels: bool = False) -> dict:
    """The cached turn against the fresh prompt of the same length: medians of `repeats` (module docstring)."""
    rng = random.Random(history * 100_003 + new)

    def draw(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    fresh, cached = [], []
    for _ in range(repeats):
        fresh.append(_request(llm, draw(history + new), decode + 1))
        past = draw(history)
        timed(llm, past, 1)  # the previous turn: its prefill leaves the history's checkpoints in the cache
        cached.append(_request(llm, past + draw(new), decode + 1))
    (first_fresh, step_fresh, _), (first, step, hits) = ([statistics.median(x) for x in zip(*runs)]
                                                        for runs in (fresh, cached))
    result = {
        "history": history, "new": new, "prompt": history + new,
        "fresh_first_token_s": first_fresh, "cached_first_token_s": first,
        "cached_over_fresh": first / first_fresh,
        "cached_tokens": hits, "fresh_cached_tokens": max(h for _, _, h in fresh),
        "prefilled_tokens_cached": history + new - hits,
        "fresh_decode_step_ms": 1e3 * step_fresh, "cached_decode_step_ms": 1e3 * step,
    }
    if kernels:
        past = draw(history)
        timed(llm, past, 1)
        result["kernels"] = {"cached": request_kernels(llm, past + draw(new), TOP),
                             "fresh": request_kernels(llm, draw(history + new), TOP)}
    return result
