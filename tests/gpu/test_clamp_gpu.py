"""The routed-expert SwiGLU clamp on a GPU, as our model configures vLLM's fused MoE, on whichever release runs it.

Ling-3.0 clamps as min(SiLU(g), L) · clamp(u, ±L) (docs/architecture.md §MoE). `compat.routed_clamp_activation`
says which FusedMoE activation our model passes and which form that computes on this release (the trained one
from vLLM 0.34, SiLU(min(g, L)) on 0.33). Two checks that it does:
- the activation kernel the Marlin and Triton experts call (`apply_moe_activation`), on rows whose gates exceed L;
- the whole MoE block in the engine: the tiny checkpoint's routed layers 4 and 5 (L = 1, where the forms differ
  most: SiLU(1) = 0.73) against the fp64 reference in the declared form, for BF16 (Triton) and INT4 experts on
  Marlin, Triton and Humming (where vLLM has it), and measurably farther from the other form.
Run: pytest tests/gpu/test_clamp_gpu.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from gpu_helpers import GPU_ENV, record, run_scripts  # importing gpu_helpers skips the module without CUDA

from vllm_ling import compat
from vllm_ling.ops.moe import clamped_swiglu

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from references import checkpoint_tensors, moe_reference, swiglu_silu_of_min, swiglu_trained  # noqa: E402

LAYERS = (4, 5)  # the tiny config's routed clamp, L = 1.0
MOE_FLAG = compat.has_intree_ling3()  # --moe-backend picks the INT4 expert kernel
SIDE_BY_SIDE = {"gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": 1 << 30}
ENGINE_TOL = 2e-2  # bf16 activations against an fp64 reference
FORMS = {compat.CLAMP_TRAINED: swiglu_trained, compat.CLAMP_SILU_OF_MIN: swiglu_silu_of_min}


def _served() -> tuple[str, str]:
    activation, form = compat.routed_clamp_activation()
    return activation, form


def _other(form: str) -> str:
    return next(f for f in FORMS if f != form)


@pytest.mark.parametrize("limit", [1.0, 4.0])
def test_fused_moe_activation_kernel_computes_the_declared_form(limit):
    from vllm.model_executor.layers.fused_moe.activation import (
        ApplyMoEActivationConfig, MoEActivation, apply_moe_activation,
    )

    activation, form = _served()
    gen = torch.Generator().manual_seed(int(limit))
    x = (torch.randn(256, 2 * 512, generator=gen) * 2 * limit).to(torch.bfloat16)  # many gates above L
    assert (x[:, :512] > limit).float().mean() > 0.2
    out = torch.empty(256, 512, dtype=torch.bfloat16, device="cuda")
    apply_moe_activation(MoEActivation.from_str(activation), out, x.cuda(),
                         activation_config=ApplyMoEActivationConfig(clamp_limit=limit))
    g, u = x.double().chunk(2, dim=-1)
    got = out.double().cpu()
    err, err_other = (_max_rel(got, FORMS[f](g, u, limit), limit) for f in (form, _other(form)))
    record(f"clamp_activation_L{limit:g}", {"release": str(compat.vllm_version()), "activation": activation,
                                            "form": form, "max_rel_err": err, "max_rel_err_other_form": err_other})
    # bf16 rounding is 2^-9 relative; the forms part by up to 1 - σ(L) where g > L (27% at L = 1, 1.8% at 4)
    assert err < 5e-3, f"{activation} at L={limit}: {err:.3g} from {form}"
    assert err_other > 1.2e-2, f"{activation} at L={limit} also matches {_other(form)} ({err_other:.3g})"
    if form == compat.CLAMP_TRAINED:  # and it is what our CPU path computes
        assert _max_rel(got, clamped_swiglu(g, u, limit).double(), limit) < 5e-3


def _max_rel(got: torch.Tensor, want: torch.Tensor, limit: float) -> float:
    """Largest |got − want| / |want| over the elements of some size (|want| > L/10)."""
    big = want.abs() > 0.1 * limit
    return ((got - want).abs()[big] / want.abs()[big]).max().item()


def _configs() -> dict[str, tuple[str, dict]]:
    """name -> (checkpoint, engine kwargs): BF16 experts on vLLM's Triton MoE, INT4 on each kernel we serve."""
    def moe(backend: str) -> dict:
        return {"moe_backend": backend} if MOE_FLAG else {}

    configs = {"bf16": ("bf16", {}), "int4_marlin": ("int4", moe("marlin"))}
    if MOE_FLAG:
        configs |= {"int4_triton": ("int4", moe("triton")), "int4_humming": ("int4", moe("humming"))}
    return configs


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict[str, tuple[dict, str, str]]:
    from ling_tools.tiny import dequantize_checkpoint, ensure_tiny

    tmp = tmp_path_factory.mktemp("clamp-gpu")
    models = {"bf16": str(ensure_tiny(seed=0)), "int4": str(ensure_tiny(seed=0, int4=True))}
    references = {"bf16": models["bf16"], "int4": str(dequantize_checkpoint(models["int4"], tmp / "dequantized"))}
    prompt = [(37 * i + 11) % 590 + 10 for i in range(96)]
    jobs = []
    for name, (ckpt, kwargs) in _configs().items():
        jobs.append(("engine_runner.py", {
            "model": models[ckpt], "prompts": [prompt], "max_tokens": 3, "dtype": "bfloat16",
            "prompt_logprobs": False, "capture_mlp_layers": list(LAYERS), "capture_path": str(tmp / f"{name}.pt"),
            "gpu_memory_utilization": SIDE_BY_SIDE["gpu_memory_utilization"], "max_model_len": 512,
            "engine_kwargs": {"kv_cache_memory_bytes": SIDE_BY_SIDE["kv_cache_memory_bytes"], **kwargs},
        }, name))
    runs = run_scripts(jobs, tmp, env=GPU_ENV)
    return {name: (torch.load(tmp / f"{name}.pt"), references[ckpt], run["moe_method"])
            for (name, (ckpt, _)), run in zip(_configs().items(), runs)}


@pytest.mark.parametrize("name", list(_configs()))
def test_engine_routed_clamp_is_the_declared_form(captured, name):
    activation, form = _served()
    mlps, ref_dir, method = captured[name]
    cfg = json.loads((Path(ref_dir) / "config.json").read_text())
    errs = {}
    for layer in LAYERS:
        assert cfg["expert_swiglu_limit_list"][layer] == 1.0, "the tiny config's routed clamp moved"
        w = checkpoint_tensors(ref_dir, f"model.layers.{layer}.mlp.")
        for step, (x, y) in enumerate(mlps[f"mlp{layer}"]):
            x, y = x.cpu(), y.cpu().double()
            for f, swiglu in FORMS.items():
                want = moe_reference(x, w, cfg, layer, routed_swiglu=swiglu)
                errs.setdefault(f, []).append(((y - want).norm() / want.norm()).item())
    worst, closest_other = max(errs[form]), min(errs[_other(form)])
    record(f"clamp_engine_{name}", {"release": str(compat.vllm_version()), "moe_method": method,
                                    "activation": activation, "form": form, "rel_err": errs[form],
                                    "rel_err_other_form": errs[_other(form)]})
    assert worst < ENGINE_TOL, f"{name} ({method}, {activation}): {worst:.3g} from {form}"
    assert closest_other > 2 * worst, f"{name} ({method}): the other form is as close ({closest_other:.3g})"
