"""Run one real vLLM engine on a checkpoint and dump greedy continuations + prompt logprobs as JSON.

A separate process per engine: each test configuration (env vars such as VLLM_MLA_DISABLE, hf_overrides)
gets a fresh vLLM, and nothing leaks between them. Usage: python engine_runner.py SPEC.json OUT.json

A spec with `jobs` ({name: request}) serves several requests on one engine (shared_engines.py): each request is
its own `generate` call, so its batch is what a fresh engine would have scheduled, and its spec-decode counters
and log lines are its own; the result is {"jobs": {name: result}}, each result in the one-request form. A request
holds only REQUEST_KEYS; everything else in the spec configures the engine.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

if os.environ.get("LING_TP_FAULT"):  # negative controls of test_tp.py; at import, so spawned workers get it too
    import tp_faults

    tp_faults.install(os.environ["LING_TP_FAULT"])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# What one request of a shared engine may set (the rest of a spec configures the engine).
REQUEST_KEYS = ("prompts", "max_tokens", "prompt_logprobs", "prompt_topk", "capture_mlp_layers", "capture_path",
                "quant_methods", "log_lines", "kv_cache_layers")


def run(spec: dict) -> dict:
    lines = _Lines()
    if spec.get("log_lines") or any(j.get("log_lines") for j in spec.get("jobs", {}).values()):
        # vllm-ling's own log lines (the draft check, the FP8 summary)
        logging.getLogger("vllm_ling").addHandler(lines)
        logging.getLogger("vllm_ling").setLevel(logging.INFO)
    launched = None
    if spec.get("smem_limit"):  # every Triton kernel this engine launches held to a smaller GPU's shared memory
        from ling_tuning.smem import emulate_launch_limit

        launched = emulate_launch_limit(spec["smem_limit"])
    if spec.get("vllm_kv_block_copy"):  # vLLM's own copy of a partly filled block (tests/model/partial_hit_size.py)
        from vllm_ling import compat

        compat.install_kv_block_copy_per_view = lambda: False
    t0 = time.perf_counter()
    llm = _engine(spec)
    started = time.perf_counter() - t0
    if spec.get("rounds"):
        return _run_rounds(llm, spec)
    if "jobs" not in spec:
        result = _request(llm, spec, lines, lines.lines[:])
        # the first generate includes what JIT compiles on first use (the watchdog's first-request grace covers it)
        result["seconds"] = {"engine_start": started, "first_generate": result.pop("seconds")["generate"]}
        if launched is not None:
            result["triton_smem"] = dict(launched)
        return result
    startup = lines.lines[:]
    return {"jobs": {name: _request(llm, {**spec, **job}, lines, startup) for name, job in spec["jobs"].items()}}


def _engine(spec: dict):
    from vllm import LLM

    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.9),
        max_model_len=spec.get("max_model_len", 1024),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 1024),
        max_num_seqs=spec.get("max_num_seqs", 8),
        enable_prefix_caching=spec.get("prefix_caching", False),
        enforce_eager=spec.get("enforce_eager", True),
        hf_overrides=spec.get("hf_overrides") or None,
        speculative_config=spec.get("speculative_config"),
        seed=0,
        # spec-decode and prefix-cache counters need stats on
        disable_log_stats=not (spec.get("speculative_config") or spec.get("rounds")),
        **spec.get("engine_kwargs", {}),
    )


def _request(llm, spec: dict, lines: _Lines, startup: list[str]) -> dict:
    """One `generate` call of `spec`'s prompts, and what the spec asks of the engine around it. `startup`: the
    log lines of the engine's start; the result's are those and the ones this request logged."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    first_line = len(lines.lines)
    counters = _spec_counters(llm) if spec.get("speculative_config") else {}
    captured: dict[str, list] = {}
    hooks = (llm.apply_model(lambda model: _capture_mlps(model, spec["capture_mlp_layers"], captured))[0]
             if spec.get("capture_mlp_layers") else [])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    topk = spec.get("prompt_topk", 0)  # > 0: also return the top-k prompt logprobs per position
    # max_tokens: one for all prompts, or one per prompt (requests that finish at different steps)
    lengths = spec.get("max_tokens", 32)
    params = [SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True,
        prompt_logprobs=topk if spec.get("prompt_logprobs", True) else None,
        logprobs=0,
    ) for n in (lengths if isinstance(lengths, list) else [lengths] * len(prompts))]
    t1 = time.perf_counter()
    try:
        outputs = llm.generate(prompts, params)
    finally:
        for hook in hooks:
            hook.remove()
    result = {"outputs": [], "seconds": {"generate": time.perf_counter() - t1}}
    for prompt_ids, out in zip(spec["prompts"], outputs):
        completion = out.outputs[0]
        prompt_lp, prompt_top = None, None
        if out.prompt_logprobs is not None:
            # position 0 has no logprob; position i holds log p(prompt[i] | prompt[:i])
            prompt_lp = [None] + [entry[tok].logprob for tok, entry in zip(prompt_ids[1:], out.prompt_logprobs[1:])]
            if topk:
                prompt_top = [None] + [
                    {str(t): lp.logprob for t, lp in entry.items() if lp.rank is not None and lp.rank <= topk}
                    for entry in out.prompt_logprobs[1:]
                ]
        gen_lp = [entry[tok].logprob for tok, entry in zip(completion.token_ids, completion.logprobs or [])]
        result["outputs"].append({
            "token_ids": list(completion.token_ids), "prompt_logprobs": prompt_lp, "logprobs": gen_lp,
            "prompt_topk": prompt_top,
        })
    if spec.get("speculative_config"):  # this request's drafts: the counters' growth over its generate call
        after = _spec_counters(llm)
        result["spec_decode"] = {k: v - counters.get(k, 0.0) for k, v in after.items()}
    result["implementation"] = _on_model(llm, _implementation)[0]
    result["moe_method"] = _on_model(llm, _moe_method)[0]
    result["moe_align"] = _on_model(llm, _moe_align)[0]
    result["kda_gate"] = _on_model(llm, _kda_gate)[0]
    result["router_gemm"] = _on_model(llm, _router_gemm)[0]
    if spec.get("quant_methods"):
        result["quant_methods"] = _on_model(llm, _quant_methods)[0]
    if spec.get("log_lines"):
        result["log_lines"] = startup + lines.lines[first_line:]
    if spec.get("kv_cache_layers"):
        result["kv_cache"] = llm.collective_rpc(_kv_cache_layers)[0]
    if spec.get("engine_kwargs", {}).get("tensor_parallel_size", 1) > 1:
        result["tp_ranks"] = llm.collective_rpc(_tp_rank_info)
    if captured:
        import torch

        torch.save({k: [(x, y) for x, y in v] for k, v in captured.items()}, spec["capture_path"])
        result["capture_path"] = spec["capture_path"]
    return result


def _run_rounds(llm, spec: dict) -> dict:
    """Prefix-cache mode: `generate` once per round on one engine (a round may first empty the prefix cache, or
    submit its prompts together); each round's greedy tokens and logprobs, and the prefix-cache queries and hits
    (vLLM's counters) that round added."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 16), ignore_eos=True, logprobs=0)
    cache = llm.llm_engine.vllm_config.cache_config
    result: dict = {"rounds": [], "block_size": cache.block_size, "num_blocks": cache.num_gpu_blocks,
                    "mamba_cache_mode": str(getattr(cache, "mamba_cache_mode", None))}
    if spec.get("count_passes"):
        _on_model(llm, _count_passes)
    for round_ in spec["rounds"]:
        if round_.get("reset"):
            assert llm.reset_prefix_cache(), "vLLM refused to empty the prefix cache (requests still running)"
        before = _prefix_counters(llm) | _passes(llm, spec)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in round_["prompts"]], params,
                               use_tqdm=False)
        after = _prefix_counters(llm) | _passes(llm, spec)
        result["rounds"].append({
            "name": round_.get("name", ""),
            "outputs": [{"token_ids": list(o.outputs[0].token_ids),
                         "logprobs": [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)],
                         "cached_tokens": o.num_cached_tokens} for o in outputs],
            **{k: after[k] - before[k] for k in after},
        })
    if spec.get("speculative_config"):
        result["spec_decode"] = _spec_counters(llm)
    return result


def _first_kda(model):
    return next(m for m in model.modules() if hasattr(m, "get_state_shape") and hasattr(m, "kv_cache"))


def _count_passes(model) -> None:
    """Count the forward passes (engine steps that run the model) on its first KDA layer, which every pass runs."""
    kda = _first_kda(model)
    kda.ling_passes = 0

    def count(module, args, out):
        module.ling_passes += 1

    kda.register_forward_hook(count)


def _passes(llm, spec: dict) -> dict[str, int]:
    """{"passes": forward passes so far} with `count_passes` (an eager engine: a CUDA graph replays no hook)."""
    if not spec.get("count_passes"):
        return {}
    return {"passes": _on_model(llm, lambda model: _first_kda(model).ling_passes)[0]}


def _prefix_counters(llm) -> dict[str, float]:
    """vLLM's prefix-cache counters so far: queries and hits, in tokens."""
    found = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return {"queries": found.get("vllm:prefix_cache_queries", 0.0), "hits": found.get("vllm:prefix_cache_hits", 0.0)}


def _quant_methods(model) -> dict[str, str]:
    """module name -> the class name of its quant method, for every module that has one."""
    return {name: type(m.quant_method).__name__ for name, m in model.named_modules()
            if getattr(m, "quant_method", None) is not None}


def _on_model(llm, func) -> list:
    """`func(model)` in every worker. With TP > 1 the workers are processes and `apply_model` pickles `func`
    by reference (fails for this script's functions); `collective_rpc` with a callable cloudpickles it by value."""
    if llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 1:
        return llm.apply_model(func)
    return llm.collective_rpc(lambda worker: func(worker.get_model()))


def _implementation(model) -> str:
    return f"{type(model).__module__}.{type(model).__name__}"


def _moe_align(model) -> str:
    """`ours` where vllm_ling.ops.moe_align wraps vLLM's MoE alignment op in this process, else `vllm`."""
    from vllm import _custom_ops as ops

    return "ours" if hasattr(ops.moe_align_block_size, "vllm_ling_wraps") else "vllm"


def _kda_gate(model) -> str | None:
    """`kernel` where our KDA layers hand the raw gate projections to vLLM's kernels, `ours` where they gate
    themselves, None where no layer of ours serves (the in-tree model)."""
    modes = {m.gate_in_kernel for m in model.modules() if hasattr(m, "gate_in_kernel")}
    return None if not modes else ("kernel" if modes == {True} else "ours" if modes == {False} else "mixed")


def _router_gemm(model) -> str | None:
    """`ours` where our MoE layers compute the router logits on our fp32 kernel, `vllm` on GateLinear, None where
    no MoE layer of ours serves (the in-tree model)."""
    modes = {m.router_gemm for m in model.modules() if hasattr(m, "router_gemm")}
    return None if not modes else modes.pop() if len(modes) == 1 else "mixed"


def _tp_rank_info(worker) -> dict:
    """This worker's TP rank and world size, its TP group's collective backend, its parameters' shapes and its
    first KDA layer's state shapes (declared to vLLM, and as allocated: [slots, ...])."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    dist = getattr(group.device_communicator, "dist_module", None)
    model = worker.get_model()
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    kda = next((m for m in model.modules() if hasattr(m, "get_state_shape") and hasattr(m, "kv_cache")), None)
    state = None if kda is None else {"declared": [list(s) for s in kda.get_state_shape()],
                                      "allocated": [list(t.shape) for t in kda.kv_cache]}
    return {"rank": group.rank_in_group, "world_size": group.world_size,
            "communicator": getattr(dist, "__name__", type(dist).__name__), "param_shapes": shapes,
            "kda_state": state}


def _kv_cache_layers(worker) -> dict:
    """The KV cache vLLM allocated: each layer with a cache of its own (its spec class), the pool's groups, layers
    that borrow another layer's cache, the draft's attention layers, and how many blocks each bound cache has."""
    runner = worker.model_runner
    ctx = runner.vllm_config.compilation_config.static_forward_context
    specs = runner.get_kv_cache_spec()
    drafter = getattr(runner, "drafter", None)

    def blocks(cache) -> int:
        return (cache[0] if isinstance(cache, (list, tuple)) else cache).shape[0]

    return {"specs": {name: type(s).__name__ for name, s in specs.items()},
            "groups": [list(g.layer_names) for g in runner.kv_cache_config.kv_cache_groups],
            "shared": dict(runner.shared_kv_cache_layers),
            "draft": sorted(getattr(drafter, "_draft_attn_layer_names", None) or ()),
            "blocks": {name: blocks(ctx[name].kv_cache) for name in specs}}


def _moe_method(model) -> str | None:
    """Class name of the first MoE quant method vLLM built, with the kernel backend it chose where the method
    records one (0.33/0.34: `CompressedTensorsWNA16MoEMethod:humming`)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and "MoE" in type(method).__name__:
            backend = getattr(method, "wna16_backend", None)
            return type(method).__name__ + (f":{getattr(backend, 'value', backend)}" if backend is not None else "")
    return None


def _spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) after the run."""
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            counters[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return counters


def _capture_mlps(model, layers: list[int], store: dict) -> list:
    """Record (input, output) of each listed layer's MLP on every forward (needs the in-process engine); the hook
    handles, removed after the request so that a shared engine's other requests are not recorded."""
    handles = []
    for i in layers:
        def hook(module, inputs, output, key=f"mlp{i}"):
            store.setdefault(key, []).append((inputs[0].detach().clone(), output.detach().clone()))

        handles.append(model.model.layers[i].mlp.register_forward_hook(hook))
    return handles


if __name__ == "__main__":
    from model_helpers import exit_at_once

    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    with open(out_path, "w") as f:
        json.dump(run(spec), f)
    exit_at_once()
