"""Wide verifies and more lanes within a GB10's shared memory, emulated on a bigger GPU (docs/ops-walls.md W3, W5).

On a GB10 (101,376 B per block) MTP k = 3 and four lanes crashed on KDA kernels that wanted ~133 KB, so the preflight
refused k > 1 there; since these engines passed it refuses above 8. Every Triton kernel an engine launches is held to
101,376 B, as a GB10's driver holds it (`ling_tuning.smem.emulate_launch_limit`: Triton's own OutOfResources at the
first launch of a kernel over the limit), with the KDA autotune guard on at that limit (LING_SMEM_LIMIT), and engines
that verify wide or batch many lanes must run to the end:
- MTP k = 3 (a 4-token verify) and plain decoding with 8 lanes, on the tiny checkpoints (head dim 128 and the KDA
  kernels of the full model; shared memory follows the tiles, not the head count), bf16, CUDA graphs;
- DSpark K = 8 (a 9-token verify) with the tiny agreeing drafter.
Each records every Triton kernel it launched with its shared memory. The control shows the emulation is live: a
kernel compiled over a limit raises at launch under it and runs without it. CUDA kernels (FlashAttention, Marlin,
Humming) choose their shared memory per architecture and are not emulated: on sm_121 they run their sm_120 builds.
Run on the device: LING_GPU_RESULTS=$OUT python -m pytest tests/gpu/test_spec_smem_gpu.py -q
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_helpers import GPU_ENV, record  # noqa: E402  (skips the module without CUDA)
from model_helpers import NO_CLAMPS, random_prompts, run_scripts, spec_acceptance  # noqa: E402

from ling_tuning.smem import GB10_SMEM_PER_BLOCK, SMEM_LIMIT_ENV, emulate_launch_limit  # noqa: E402

PROMPT_LENGTHS = [3, 17, 64, 130, 700, 40, 90, 260]  # eight lanes; 700 takes the chunked-prefill kernels
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.08, "engine_kwargs": {"kv_cache_memory_bytes": 1 << 30}}
ENV = {**GPU_ENV, SMEM_LIMIT_ENV: str(GB10_SMEM_PER_BLOCK)}


@triton.jit
def _tile(a, c, B: tl.constexpr):
    offs = tl.arange(0, B)
    x = tl.load(a + offs[:, None] * B + offs[None, :])
    tl.store(c + offs[:, None] * B + offs[None, :], tl.dot(x, x))


def test_the_emulated_limit_fails_a_kernel_over_it_and_only_under_it():
    a = torch.randn(128, 128, device="cuda", dtype=torch.float16)
    c = torch.empty(128, 128, device="cuda", dtype=torch.float32)
    launched = emulate_launch_limit(1024)  # far below what a 128 x 128 tl.dot stages
    with pytest.raises(triton.runtime.errors.OutOfResources):
        _tile[(1,)](a, c, B=128)
    assert launched and max(launched.values()) > 1024
    emulate_launch_limit(1 << 30)  # lifted: the same compiled kernel launches
    _tile[(1,)](a, c, B=128)
    torch.testing.assert_close(c, a.float() @ a.float(), rtol=1e-2, atol=1e-1)


def _engine(model: str, **extra) -> dict:
    return {"model": model, "prompts": random_prompts(PROMPT_LENGTHS, seed=21), "max_tokens": 48,
            "dtype": "bfloat16", "enforce_eager": False, "max_model_len": 2048, "max_num_batched_tokens": 512,
            "max_num_seqs": len(PROMPT_LENGTHS), "prompt_logprobs": False, "hf_overrides": NO_CLAMPS,
            "smem_limit": GB10_SMEM_PER_BLOCK, **SIDE_BY_SIDE, **extra}


@pytest.fixture(scope="module")
def mtp_and_lanes(tmp_path_factory) -> dict[str, dict]:
    from ling_tools.tiny import ensure_tiny

    tmp = tmp_path_factory.mktemp("spec-smem")
    jobs = [("engine_runner.py", _engine(str(ensure_tiny(variant="mtp_echo")), speculative_config={
                "method": "mtp", "num_speculative_tokens": 3}), "mtp3"),
            ("engine_runner.py", _engine(str(ensure_tiny(seed=0))), "lanes8")]
    out = dict(zip(["mtp3", "lanes8"], run_scripts(jobs, tmp, ENV)))
    record("spec_smem_mtp_lanes", {name: {"triton_smem": r["triton_smem"], "spec_decode": r.get("spec_decode"),
                                          "seconds": r.get("seconds")} for name, r in out.items()})
    return out


@pytest.fixture(scope="module")
def dspark(tmp_path_factory) -> dict:
    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark

    tmp = tmp_path_factory.mktemp("spec-smem-dspark")
    target = ensure_tiny(variant="mtp_echo")
    draft = make_tiny_dspark(tmp / "draft", target, agree=True)
    run = run_scripts([("engine_runner.py", _engine(str(target), speculative_config={
        "method": "dspark", "model": str(draft), "num_speculative_tokens": 8, "attention_backend": "FLASH_ATTN",
        "enable_adaptive_verification": False}), "dspark8")], tmp, ENV)[0]
    record("spec_smem_dspark", {"triton_smem": run["triton_smem"], "spec_decode": run["spec_decode"],
                                "seconds": run.get("seconds")})
    return run


def _check(run: dict, name: str) -> None:
    smem = run["triton_smem"]
    assert smem, f"{name}: no Triton kernel launched under the emulation (was it installed in the engine?)"
    assert max(smem.values()) <= GB10_SMEM_PER_BLOCK  # what launched fits (a kernel over it stops the engine)
    assert all(len(o["token_ids"]) == 48 for o in run["outputs"]), f"{name}: a sequence stopped early"


def test_mtp_k3_verifies_within_a_gb10s_shared_memory(mtp_and_lanes):
    run = mtp_and_lanes["mtp3"]
    _check(run, "MTP k=3")
    assert spec_acceptance(run) > 0.3, "MTP k=3 on the echo target accepted too little to have verified wide"


def test_eight_lanes_decode_within_a_gb10s_shared_memory(mtp_and_lanes):
    _check(mtp_and_lanes["lanes8"], "8 lanes")


def test_dspark_k8_verifies_within_a_gb10s_shared_memory(dspark):
    _check(dspark, "DSpark K=8")
    assert spec_acceptance(dspark) > 0.3, "the agreeing drafter was accepted too little to have verified wide"
