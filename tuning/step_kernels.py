"""CUDA kernels per decode step, from vLLM's engine under the torch profiler: what `ling_bench.fullsize --kernels`
reports and what ling-tune's engine comparison times a MoE backend by (`ling_tuning.engine_compare`)."""

from __future__ import annotations

import time

TOP_KERNELS = 80  # kernels a profile lists by name (30 until 2026-12-02: 171 µs of a plain step went unnamed)


def greedy(llm, prompt: list[int] | list[list[int]], max_tokens: int) -> list:
    """vLLM's outputs of `max_tokens` greedy tokens (EOS ignored, no detokenizing) for one prompt of token ids, or
    for a batch of prompts decoding together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def timed(llm, prompt: list[int] | list[list[int]], max_tokens: int) -> float:
    """Seconds to generate `max_tokens` greedily for one prompt, or for a batch of prompts decoding together."""
    start = time.perf_counter()
    greedy(llm, prompt, max_tokens)
    return time.perf_counter() - start


def cuda_events(llm, prompt: list[int] | list[list[int]], max_tokens: int) -> tuple[float, list]:
    """One `timed` request under the torch profiler: its seconds and its CUDA kernel events (CUPTI; kernels
    replayed from CUDA graphs included)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        seconds = timed(llm, prompt, max_tokens)
    return seconds, [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernels_per_step(llm, prompt: list[int] | list[list[int]], decode: int) -> dict:
    """CUDA kernels and their summed GPU time per decode step: a (1 + decode)-token request minus a 1-token one,
    so the prefill cancels out (torch profiler over CUPTI; kernels replayed from CUDA graphs are counted). A list
    of prompts is one batch decoding together (ling_tuning.engine_compare's batch-M step)."""
    import collections

    one, many = cuda_events(llm, prompt, 1)[1], cuda_events(llm, prompt, 1 + decode)[1]
    busy_us = (busy_us_of(many) - busy_us_of(one)) / decode
    count, us = collections.Counter(), collections.Counter()
    for sign, events in ((-1, one), (1, many)):
        for e in events:
            count[e.name] += sign
            us[e.name] += sign * e.time_range.elapsed_us()
    top = sorted(us, key=lambda n: -us[n])[:TOP_KERNELS]
    return {"kernels_per_step": (len(many) - len(one)) / decode, "gpu_us_per_step": sum(us.values()) / decode,
            "gpu_busy_us_per_step": busy_us,
            "top": [{"name": n[:140], "count": count[n] / decode, "us": us[n] / decode} for n in top]}


def request_kernels(llm, prompt: list[int], top: int = TOP_KERNELS) -> dict:
    """The CUDA kernels of one 1-token request (its prefill): count, summed and busy GPU microseconds, the `top`
    kernels by time (torch profiler over CUPTI)."""
    import collections

    seconds, events = cuda_events(llm, prompt, 1)
    count, us = collections.Counter(), collections.Counter()
    for e in events:
        count[e.name] += 1
        us[e.name] += e.time_range.elapsed_us()
    return {"seconds_profiled": seconds, "kernels": len(events), "gpu_us": sum(us.values()),
            "gpu_busy_us": busy_us_of(events),
            "top": [{"name": n[:140], "count": count[n], "us": us[n]} for n in sorted(us, key=lambda n: -us[n])[:top]]}


def busy_us_of(events) -> float:
    """Microseconds in which at least one kernel ran: the union of the kernels' intervals over every stream. Kernel
    time summed counts overlapped streams twice; the wall-clock step adds the host's gaps (on 2026-12-02 a recipe step took
    0.7 ms more than an earlier run's that day with the same kernel time). The union is the GPU's share of a step, overlap included."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy
