"""Shared by the whole-model tests: running the engine / oracle scripts in subprocesses, comparing logprobs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
# The CPU engine recipe (docs/vllm-seams.md §MLA): MLA as decompressed standard attention, a small
# KV budget, the in-process engine core (so tests can hook modules), and our plugin over vLLM's in-tree model.
CPU_ENGINE_ENV = {
    "VLLM_LING_FORCE": "1",
    "VLLM_MLA_DISABLE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_CI_ENV": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
# One engine script's limit: a device step sets it below its own (tests/gpu/run_on_device.sh), so a slow engine fails
# here, with every engine's log tail, instead of being killed with the step and leaving nothing to read.
TIMEOUT_S = int(os.environ.get("LING_ENGINE_TIMEOUT", "900"))
# transformers' BailingHybrid (the oracle) has no SwiGLU clamps: every engine run judged against it turns ours off
# (the tiny checkpoints have 6 layers; tests/model/test_moe_reference.py pins the clamps themselves).
NO_CLAMPS = {"expert_swiglu_limit_list": [0] * 6, "share_expert_swiglu_limit_list": [0] * 6}


# Which of the oracle's linears each implementation serves as one (oracle.py `fp8_merged`), in the served row order,
# for the FP8 reference of the model as served. Ours computes KDA's q|k|v|β|f|g as one in_proj padded to a multiple
# of 16 outputs, so always FP8 (vllm_ling/kda.py): the group rounds β (b_proj, one output a head) with the rest, and
# under the block scheme its 128-row blocks run across the parts (β's rows shift f and g off the block grid;
# transformers nests f_proj under forget_gate). vLLM's in-tree model (>= 0.28) computes q|k|v|β as one qkvb_proj,
# unpadded, which ling_fp8 keeps BF16 where that width is no multiple of 16: the tiny checkpoints' 3·512 + 4 =
# 1,540 (4 heads); Ling-3.0-flash's 3·4,096 + 32 = 12,320 is FP8; its f_proj and g_proj are linears of their own.
# A 0.33 run once scored the in-tree model against ours and failed by 3.5 points. `served_as`: the merged linear's
# name on the engine, whose quant method the GPU model test holds against what the reference rounds for the first
# member (oracle.py reads names and pad only).
FP8_MERGED = {"vllm-ling": [{"names": ["q_proj", "k_proj", "v_proj", "b_proj", "forget_gate.f_proj", "g_proj"],
                             "pad": True, "served_as": "in_proj"}],
              "vllm": [{"names": ["q_proj", "k_proj", "v_proj", "b_proj"], "pad": False, "served_as": "qkvb_proj"}]}


def exit_at_once() -> None:
    """End an engine or oracle script whose result is written, skipping the teardown: an in-process engine's
    shutdown (vLLM's gc.collect of its whole heap) and the interpreter's release of torch cost ~3 s an engine run,
    ~1 s an oracle run, and check nothing. A script that started processes of its own (TP > 1 workers) returns to
    exit normally, which stops them."""
    import psutil

    if psutil.Process().children():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt of each length, token ids drawn from [10, 900) (inside every tiny vocabulary, past its specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 900) for _ in range(n)] for n in lengths]


def draft_vocab_file(tmp: Path, name: str, ids: list[int]) -> str:
    """A draft vocabulary file (vllm_ling/draft/vocab.py's format) holding `ids`, for VLLM_LING_DRAFT_VOCAB."""
    from vllm_ling.draft.vocab_file import document

    path = tmp / f"{name}.json"
    path.write_text(json.dumps(document(ids)))
    return str(path)


def run_script(script: str, spec: dict, tmp: Path, name: str, env: dict | None = None) -> dict:
    return run_scripts([(script, spec, name)], tmp, env)[0]


def run_scripts(jobs: list[tuple[str, dict, str]], tmp: Path, env: dict | None = None,
                envs: list[dict] | None = None) -> list[dict]:
    """Run (script, spec, name) jobs at the same time, one process each; their results in job order.
    `env` is added to every job's environment, `envs[i]` to job i's.

    Independent engines share a GPU this way (each must then size its own KV cache, see test_mtp_gpu.py),
    so their start-up (torch.compile, graph capture, Triton JIT) overlaps. Every process is waited for,
    and on a failure or timeout the others are killed: none is left behind."""
    procs = []
    try:
        for i, (script, spec, name) in enumerate(jobs):
            spec_path, out_path = tmp / f"{name}.spec.json", tmp / f"{name}.out.json"
            spec_path.write_text(json.dumps(spec))
            log = open(tmp / f"{name}.log", "w+")
            job_env = {**os.environ, **(env or {}), **(envs[i] if envs else {})}
            proc = subprocess.Popen([sys.executable, str(HERE / script), str(spec_path), str(out_path)],
                                    env=job_env, stdout=log, stderr=subprocess.STDOUT)
            procs.append((script, proc, log, out_path))
        deadline = time.monotonic() + TIMEOUT_S
        for script, proc, log, _ in procs:
            try:
                rc = proc.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{len(procs)} engine scripts not done in {TIMEOUT_S} s "
                                     f"(LING_ENGINE_TIMEOUT); their logs end:\n" + _tails(procs)) from None
            if rc != 0:
                log.seek(0)
                raise AssertionError(f"{script} failed ({rc}):\n{log.read()[-12000:]}")
        return [json.loads(out_path.read_text()) for *_, out_path in procs]
    finally:
        for _, proc, log, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


def _tails(procs: list, lines: int = 15) -> str:
    """The last lines of each job's log, for a timeout's message: which engine was where."""
    out = []
    for _, proc, log, out_path in procs:
        log.flush()
        text = Path(log.name).read_text(errors="replace").splitlines()
        out.append(f"--- {out_path.name.removesuffix('.out.json')} ({'running' if proc.poll() is None else 'done'}):")
        out += text[-lines:]
    return "\n".join(out)


def spec_acceptance(run: dict) -> float:
    """Accepted / drafted tokens from an engine_runner result's spec-decode counters."""
    c = run["spec_decode"]
    return c.get("num_accepted_tokens", 0.0) / max(c.get("num_draft_tokens", 0.0), 1.0)


MARGIN_BANDS = (0.0, 0.2, 0.5, 1.0, 2.0, float("inf"))  # nats of the reference's top-1 minus top-2 logprob


def by_margin(pairs, bands: tuple[float, ...] = MARGIN_BANDS) -> dict:
    """Top-1 agreement per band of the reference's margin, from (agrees, margin) pairs: where the
    disagreements sit (a rounding flips close calls; a bug flips decided ones too)."""
    pairs = list(pairs)
    out = {}
    for lo, hi in zip(bands, bands[1:]):
        inside = [ok for ok, m in pairs if lo <= m < hi]
        out[f"{lo}-{hi}"] = {"positions": len(inside), "top1": sum(inside) / max(len(inside), 1)}
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where two greedy continuations part, or None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def max_abs_diff(a: list, b: list) -> float:
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    assert pairs and len(a) == len(b), "nothing to compare"
    return max(abs(x - y) for x, y in pairs)


def read_checkpoint(model_dir: Path) -> dict:
    """Every tensor of a (sharded) safetensors checkpoint, by name."""
    from safetensors.torch import load_file

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    return {k: v for shard in shards for k, v in load_file(model_dir / shard).items()}


def config_of(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())
