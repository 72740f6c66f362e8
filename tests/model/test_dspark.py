"""DSpark groundwork that the CPU can prove (docs/dspark.md): the target's aux hidden states, the drafter's config
normalisation and validation, the tiny drafter writer, and the drafter built and loaded as vLLM's DSpark loader does,
in BF16 and under its own quantization ling_fp8 (which modules take FP8, their numbers against the block rule's
reference). vLLM's DSpark runtime is CUDA-only (tests/gpu/test_dspark_gpu.py runs it).

The aux-capture test runs one CPU engine on the tiny checkpoint, asks our model for vLLM's aux layers of a drafter
config through vLLM's own mapping (`get_eagle3_aux_layers_from_config`), and holds the captured tensors against
the transformers oracle's per-layer hidden states. Run as a script (python test_dspark.py engine|oracle SPEC OUT),
this file is also the engine / oracle side of that test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_ling import startup_log

HERE = Path(__file__).parent
# Tiny drafter target ids, SGLang's "after layer i": 1 (KDA), 2 (MLA), 4 (KDA) of the tiny model's 6 layers.
TINY_TARGET_IDS = [1, 2, 4]
TOL = 2e-4  # fp32 engine vs fp32 oracle, relative to the stream's scale


# ---------------------------------------------------------------------------- subprocess sides (script mode)

def _engine(spec: dict) -> dict:
    """One CPU engine; our model captures the aux layers `spec["aux"]`; one prefill of `spec["prompt"]`."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["model"], dtype="float32", max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2,
              enable_prefix_caching=False, enforce_eager=True, hf_overrides=spec["hf_overrides"], seed=0)
    outputs: list[object] = []

    def wrap(model) -> None:
        forward = model.forward

        def forward_keeping_aux(*args, **kwargs):
            out = forward(*args, **kwargs)
            outputs.append(out)
            return out[0] if isinstance(out, tuple) else out

        model.forward = forward_keeping_aux

    def ask(model) -> None:
        model.set_aux_hidden_state_layers(tuple(spec["aux"]))  # vLLM's SupportsEagle3 method, as its runner calls it

    prompt, params = [TokensPrompt(prompt_token_ids=spec["prompt"])], SamplingParams(temperature=0.0, max_tokens=1)
    llm.apply_model(wrap)
    llm.generate(prompt, params)  # no drafter: the model returns a plain tensor
    plain = [type(o).__name__ for o in outputs]
    outputs.clear()
    llm.apply_model(ask)
    llm.generate(prompt, params)
    prefill = next(o for o in outputs if isinstance(o, tuple) and o[0].shape[0] == len(spec["prompt"]))
    torch.save([t.detach().float().cpu().clone() for t in prefill[1]], spec["out_path"])
    return {"plain_types": sorted(set(plain)), "captured": len(prefill[1])}


def _oracle(spec: dict) -> dict:
    """transformers' BailingHybrid (fp32, its torch KDA path): `output_hidden_states` and, to pin its indexing,
    each decoder layer's output by a forward hook."""
    sys.path.insert(0, str(HERE))
    import oracle  # noqa: F401  hides fla / causal_conv1d: transformers' torch path
    from transformers import BailingHybridForCausalLM

    model = BailingHybridForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    after: list[torch.Tensor] = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda _m, _i, out: after.append((out[0] if isinstance(out, tuple) else out)[0]))
    with torch.no_grad():
        out = model(torch.tensor([spec["prompt"]]), output_hidden_states=True)
    torch.save({"hidden_states": [h[0].float() for h in out.hidden_states], "after_layer": after},
               spec["out_path"])
    return {"hidden_states": len(out.hidden_states), "layers": len(after)}


def _route(spec: dict) -> dict:
    """vLLM's speculative config for method "dspark" with a tiny Ling drafter, the plugin loaded as vLLM loads
    it: where the drafter's config ends up (the engine itself is refused on the CPU: DSpark is MRV2-only), and the
    drafter vLLM builds from it. `spec["options"]` adds speculative config keys (the drafter's own
    `quantization`, `dspark_draft_topk`)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    args = EngineArgs(model=spec["model"], dtype="bfloat16", skip_tokenizer_init=True,
                      speculative_config={"method": "dspark", "model": spec["draft"], **spec.get("options", {})})
    target = args.create_model_config()
    spec_config = args.create_speculative_config(target, ParallelConfig())
    draft = spec_config.draft_model_config
    return {"architectures": list(draft.hf_config.architectures), "model_type": draft.hf_config.model_type,
            "resolved": draft.architecture, "k": spec_config.num_speculative_tokens, "quantization": draft.quantization,
            "aux": list(get_eagle3_aux_layers_from_config(spec_config)), "markov_rank": draft.hf_config.markov_rank,
            "mask": (draft.hf_config.dflash_config or {}).get("mask_token_id"), "built": _build_drafter(spec_config)}


def _build_drafter(spec_config) -> dict:
    """Build and load the drafter as vLLM's DSpark loader does (`load_dspark_model`: the config's quant_config is
    the draft's own, `get_draft_quant_config`, then `get_model` with the draft's model config), and ask its attention
    layers for their KV specs under a hybrid target's cache config (the GPU's block 256, KDA page padded to the MLA
    page): the class vLLM builds, the block each layer plans its cache in, each module's quantization method and
    the drafter's start-up lines; with its own quantization ling_fp8, also its FP8 numbers (`_fp8_numbers`)."""
    import socket

    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.models.utils import get_draft_quant_config

    config = EngineArgs(model=spec_config.target_model_config.model, dtype="bfloat16", skip_tokenizer_init=True,
                        enable_prefix_caching=False).create_engine_config()
    object.__setattr__(config, "speculative_config", spec_config)  # the CPU engine refuses DSpark (MRV2 only)
    config.quant_config = get_draft_quant_config(config)  # load_dspark_model's own line
    torch.accelerator.empty_cache = lambda: None  # no accelerator: what vLLM's CPU model runner sets before loading
    lines = _plugin_lines()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=config, model_config=spec_config.draft_model_config, prefix="draft")
        numbers = _fp8_numbers(model, Path(spec_config.draft_model_config.model)) \
            if spec_config.quantization == "ling_fp8" else None
        methods = {n: type(m.quant_method).__name__ for n, m in model.named_modules()
                   if getattr(m, "quant_method", None) is not None}  # its own, before the target's are installed
        shared = _share_with_a_target(model)
    config.cache_config.block_size, config.cache_config.mamba_page_size_padded = 256, 256 * 1152
    specs = {n: m.get_kv_cache_spec(config) for n, m in model.named_modules()
             if hasattr(m, "attn_type") and hasattr(m, "get_kv_cache_spec")}
    return {"class": type(model).__name__, "methods": methods, "lines": lines, "numbers": numbers, "shared": shared,
            "specs": {n: [type(sp).__name__, sp.block_size, sp.page_size_bytes] for n, sp in specs.items()},
            "gathers": model.model.markov_head.markov_w2._retain_weight_for_gather, **_gather(model)}


def _plugin_lines() -> list[str]:
    """The messages vllm-ling logs from now on in this process (its start-up lines among them)."""
    import logging

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vllm_ling").addHandler(handler)
    logging.getLogger("vllm_ling").setLevel(logging.INFO)
    return lines


def _block_rounding():
    """The block rule's rounding as the oracle writes it (oracle.py: weights per 128 x 128 block, inputs per 1 x 128
    group), with no vllm_ling code: (round_blocks, round_groups)."""
    sys.path.insert(0, str(HERE))
    from oracle import _e4m3_blocks, _e4m3_groups

    return _e4m3_blocks, _e4m3_groups


def _share_with_a_target(draft) -> str:
    """vLLM's sharing code installs a stand-in target's FP8 LM head and its embedding on the built drafter (as
    `load_dspark_model` does after `get_model`); our check then reads them: its verdict line."""
    from vllm_ling.draft import check as draft_check
    from vllm_ling.draft.dspark import check_draft_shares_target

    target = _stand_in_target(draft.config.vocab_size, draft.config.hidden_size)
    draft_check.register_target(target)
    _share_as_vllm_does(draft, target)
    assert draft.lm_head is target.lm_head and draft.model.embed_tokens is target.model.embed_tokens
    return check_draft_shares_target(draft)


def _stand_in_target(vocab: int, hidden: int):
    """A target's FP8 LM head (`--quantization ling_fp8`) and BF16 embedding, random."""
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from vllm_ling import fp8

    torch.manual_seed(0)
    head = ParallelLMHead(vocab, hidden, quant_config=fp8.LingFp8Config(kernel="w8a8"), prefix="lm_head")
    head.weight.weight_loader(head.weight, torch.randn(vocab, hidden, dtype=torch.bfloat16) / 16)
    target = nn.Module()
    target.lm_head, target.model = head, nn.Module()
    target.model.embed_tokens = VocabParallelEmbedding(vocab, hidden)
    return target


def _share_as_vllm_does(draft, target) -> None:
    """What `load_dspark_model` calls once the drafter is built: the target's embedding and LM head modules."""
    from vllm.v1.worker.gpu.spec_decode.eagle import utils

    utils.maybe_share_target_embed(draft, draft.model, target.model)
    if hasattr(utils, "share_target_lm_head"):  # 0.34
        utils.share_target_lm_head(draft, target.lm_head, None, can_share=True)
    else:  # 0.32/0.33 load_dspark_model, inline: replace the draft's head when _should_share says so
        assert utils._should_share(draft, "has_own_lm_head", draft.lm_head, target.lm_head)
        draft.lm_head = target.lm_head


def _gather(model) -> dict:
    """The Markov bias on gathered candidate rows (vLLM's `dspark_draft_topk` path) against the whole bias at those
    rows: the relative distance, or the error vLLM raises."""
    torch.manual_seed(1)
    vocab = model.config.vocab_size
    embed = model.markov_embed(torch.randint(0, vocab, (3,)))
    index = torch.randperm(vocab)[:15].view(3, 5)  # distinct rows: a scatter to one row twice keeps either
    values = torch.randn(3, 5, dtype=embed.dtype)
    logits = torch.full((3, vocab), float("-inf"), dtype=embed.dtype)
    try:
        got = model.apply_markov_bias_gathered(embed, logits, values, index).gather(1, index)
    except RuntimeError as e:
        return {"gather_error": str(e)}
    want = values.float() + model.markov_bias(embed).float().gather(1, index)
    return {"gather_distance": _rel(got.float(), want)}


def _fp8_numbers(model, draft_dir: Path) -> dict[str, list[float]]:
    """Each FP8 matrix of the loaded drafter against the reference written from the block rule alone (oracle.py:
    e4m3 per 128 x 128 weight block and per 1 x 128 input group, fp32 product) and against the plain BF16 product,
    from the checkpoint's own weights: [relative distance to the FP8 reference, to the BF16 product]. The linears
    on random inputs, the Markov head through vLLM's logits processor (`markov_bias`, as DSpark calls it), and the
    context K/V vLLM projects from the target's features (`_project_context_kv`: per layer through the quantized
    q|k|v, where BF16 runs one fused K/V GEMM)."""
    from safetensors.torch import load_file

    _e4m3_blocks, _e4m3_groups = _block_rounding()
    w = {n: t.float() for n, t in load_file(draft_dir / "model.safetensors").items()}
    gen = torch.Generator().manual_seed(2)

    def distances(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> list[float]:
        want = _e4m3_groups(x.float()) @ _e4m3_blocks(weight).t()
        return [_rel(got.float(), want), _rel(got.float(), x.float() @ weight.t())]

    def linear(module, weight: torch.Tensor) -> list[float]:
        x = torch.randn(4, weight.shape[1], generator=gen).bfloat16()
        out = module(x)
        return distances(out[0] if isinstance(out, tuple) else out, x, weight)

    out = {"fc": linear(model.model.fc, w["fc.weight"])}
    qkvs = []
    for i, layer in enumerate(model.model.layers):
        p = f"layers.{i}."
        qkvs.append(torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
        out |= {p + "qkv_proj": linear(layer.self_attn.qkv_proj, qkvs[-1]),
                p + "o_proj": linear(layer.self_attn.o_proj, w[p + "self_attn.o_proj.weight"]),
                p + "gate_up_proj": linear(layer.mlp.gate_up_proj,
                                           torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])),
                p + "down_proj": linear(layer.mlp.down_proj, w[p + "mlp.down_proj.weight"])}
    embed = model.markov_embed(torch.randint(0, model.config.vocab_size, (4,), generator=gen))
    out["markov_w2"] = distances(model.markov_bias(embed), embed, w["markov_head.markov_w2.weight"])
    return out | _context_kv(model, w, qkvs, gen)


def _context_kv(model, w: dict, qkvs: list[torch.Tensor], gen: torch.Generator) -> dict[str, list[float]]:
    """`_fp8_numbers` for the context K/V of every drafter layer (before its K norm and RoPE)."""
    from vllm import _custom_ops as ops

    _e4m3_blocks, _e4m3_groups = _block_rounding()
    attn = model.model.layers[0].self_attn
    n, layers = 5, len(qkvs)
    ctx = torch.randn(n, model.config.hidden_size, generator=gen).bfloat16()
    k, v = model.model._project_context_kv(ctx, n, layers, attn.num_kv_heads, attn.head_dim)
    # the normalised context as vLLM computes it there (its rms_norm op, whose bf16 rounding follows the CPU's
    # vector unit): one element a bf16 step apart moves its 1 x 128 group's e4m3 rounding by up to 2% of the output,
    # and the subject here is the FP8 projection, not the norm (held to the oracle by the model tests)
    x = torch.empty_like(ctx)
    ops.rms_norm(x, ctx, model.model._hidden_norm_weight, model.model._rms_norm_eps)
    x, c = x.float(), ctx.float()
    rms = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + attn.q_norm.variance_epsilon) * w["hidden_norm.weight"]
    assert torch.allclose(x, rms, rtol=1e-2, atol=1e-2)  # the drafter's hidden_norm, to bf16 rounding
    out = {}
    for i, qkv in enumerate(qkvs):
        kv = qkv[attn.q_size:]
        want = (_e4m3_groups(x) @ _e4m3_blocks(qkv)[attn.q_size:].t()).view(n, 2, -1)
        plain = (x @ kv.t()).view(n, 2, -1)
        got = torch.stack([k[i].reshape(n, -1), v[i].reshape(n, -1)], dim=1).float()
        out[f"layers.{i}.context_kv"] = [_rel(got, want), _rel(got, plain)]
    return out


# ---------------------------------------------------------------------------- the aux hidden states

def vllm_aux_layers(draft_config: dict) -> tuple[int, ...]:
    """The aux layer ids vLLM's runner asks the target for, given a drafter's config (vLLM's own mapping)."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(**draft_config)))
    return get_eagle3_aux_layers_from_config(spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def aux_capture(tiny_bf16, tmp_path_factory):
    """(captured aux tensors, oracle hidden states, oracle per-layer outputs, engine facts, aux ids)."""
    from model_helpers import CPU_ENGINE_ENV, NO_CLAMPS, random_prompts, run_scripts

    from vllm_ling.draft.dspark import normalise_draft_config

    tmp = tmp_path_factory.mktemp("dspark-aux")
    draft = normalise_draft_config({"architectures": ["LingDSparkModel"], "model_type": "qwen3",
                                    "dspark_target_layer_ids": TINY_TARGET_IDS, "block_size": 8, "markov_rank": 16})
    aux = vllm_aux_layers(draft)
    prompt = random_prompts([40], seed=11)[0]
    common = {"model": tiny_bf16, "prompt": prompt, "aux": list(aux), "hf_overrides": NO_CLAMPS}
    engine, oracle_out = run_scripts(
        [("test_dspark.py", {**common, "side": "engine", "out_path": str(tmp / "aux.pt")}, "engine"),
         ("test_dspark.py", {**common, "side": "oracle", "out_path": str(tmp / "hs.pt")}, "oracle")],
        tmp, envs=[CPU_ENGINE_ENV, {}])
    ref = torch.load(tmp / "hs.pt")
    return torch.load(tmp / "aux.pt"), ref["hidden_states"], ref["after_layer"], engine, aux


def test_vllm_asks_for_the_stream_after_each_target_layer():
    """vLLM's +1: a DSpark target id i (captured after layer i, SGLang) becomes aux id i + 1 (before layer i + 1)."""
    assert vllm_aux_layers({"dspark_target_layer_ids": [1, 11, 23, 29, 35]}) == (2, 12, 24, 30, 36)


@pytest.mark.engine
def test_aux_hidden_states_equal_the_oracle(aux_capture):
    captured, hidden, after, engine, aux = aux_capture
    assert engine["plain_types"] == ["Tensor"], "with no drafter asking, forward must return a plain tensor"
    assert len(captured) == len(aux) == len(TINY_TARGET_IDS)
    # transformers' hidden_states[j] is the stream entering layer j (0: the embedding) = after layer j - 1
    for j in range(1, len(after)):
        assert _rel(hidden[j], after[j - 1]) < 1e-6, f"oracle hidden_states[{j}] is not the output of layer {j - 1}"
    for target_id, tensor in zip(TINY_TARGET_IDS, captured):
        assert _rel(tensor, after[target_id]) < TOL, f"aux for target layer {target_id} differs from the oracle"


@pytest.mark.engine
def test_an_off_by_one_layer_choice_fails(aux_capture):
    """The comparison can fail: the stream one layer earlier or later is far outside the tolerance."""
    captured, _, after, _, _ = aux_capture
    for target_id, tensor in zip(TINY_TARGET_IDS, captured):
        for wrong in (target_id - 1, target_id + 1):
            assert _rel(tensor, after[wrong]) > 100 * TOL, (target_id, wrong)


# ---------------------------------------------------------------------------- the drafter's config

def _card_drafter(**changes) -> dict:
    """The released drafter's fields (model card) in SGLang's prefixed spelling, before normalisation."""
    config = {"architectures": ["LingDSparkModel"], "model_type": "qwen3", "hidden_size": 2560,
              "vocab_size": 157184, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 32,
              "dspark_block_size": 8, "dspark_markov_rank": 256, "dspark_markov_head_type": "vanilla",
              "dspark_target_layer_ids": [1, 11, 23, 29, 35], "dspark_noise_token_id": 156892,
              "enable_confidence_head": True}
    config.update(changes)
    return config


def test_normalise_puts_lings_drafter_on_vllms_qwen3_dspark_path():
    from vllm_ling.draft.dspark import normalise_draft_config

    c = normalise_draft_config(_card_drafter())
    assert c["architectures"] == ["LingDSparkModel", "Qwen3DSparkModel"]
    assert (c["block_size"], c["markov_rank"], c["markov_head_type"]) == (8, 256, "vanilla")
    assert c["dspark_target_layer_ids"] == [1, 11, 23, 29, 35] and c["use_aux_hidden_state"] is True
    assert c["mask_token_id"] == c["dflash_config"]["mask_token_id"] == 156892
    assert normalise_draft_config(dict(c)) == c  # idempotent: vLLM may apply its override twice
    qwen3 = {"architectures": ["Qwen3DSparkModel"], "block_size": 7}
    assert normalise_draft_config(dict(qwen3)) == qwen3  # other drafters untouched


def test_normalise_reads_the_dflash_config_nesting_vllm_accepts():
    """A drafter converted to the `dflash_config` nesting (vLLM's DFlash/DSpark readers accept it; a published Qwen3
    DSpark config nests markov_rank, markov_head_type and use_confidence_head there) reaches vLLM's Qwen3 DSpark
    model, which reads top-level keys only, with its Markov and confidence heads."""
    from vllm_ling.draft.dspark import normalise_draft_config

    nested = {"architectures": ["LingDSparkModel"], "model_type": "qwen3", "block_size": 8,
              "dflash_config": {"mask_token_id": 156892, "target_layer_ids": [1, 11, 23, 29, 35],
                                "markov_head_type": "vanilla", "markov_rank": 256, "projector_type": "dspark",
                                "use_confidence_head": True, "confidence_head_with_markov": True}}
    c = normalise_draft_config(nested)
    assert (c["markov_rank"], c["markov_head_type"]) == (256, "vanilla")
    assert c["enable_confidence_head"] is True and c["confidence_head_with_markov"] is True
    assert c["dspark_target_layer_ids"] == [1, 11, 23, 29, 35] and c["mask_token_id"] == 156892
    off = normalise_draft_config({"architectures": ["LingDSparkModel"], "dspark_markov_rank": 256})
    assert "enable_confidence_head" not in off  # nothing said: vLLM's default (no head) stands


def test_normalise_refuses_two_spellings_that_disagree():
    from vllm_ling.draft.dspark import normalise_draft_config

    with pytest.raises(ValueError, match=r"block_size twice.*dspark_block_size.*8.*block_size.*4"):
        normalise_draft_config(_card_drafter(block_size=4))


def test_the_released_drafter_fits_flash():
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import drafter_problems, normalise_draft_config

    draft = normalise_draft_config(_card_drafter())
    assert drafter_problems(flash_config(), draft, num_speculative_tokens=7) == []
    assert drafter_problems(flash_config(), draft) == []  # K defaults to block_size


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 4096}, ["hidden_size", "4096", "2560"]),
    ({"dspark_target_layer_ids": [1, 11, 23, 29, 42]}, ["dspark_target_layer_ids", "[42]", "num_hidden_layers=42"]),
    ({"dspark_target_layer_ids": [11, 1]}, ["dspark_target_layer_ids", "strictly increasing"]),
    ({"dspark_markov_rank": None}, ["markov_rank=None", "Markov head"]),
    ({"dspark_markov_head_type": "gated"}, ["markov_head_type='gated'", "vanilla"]),
    ({"vocab_size": 151936}, ["vocab_size", "151936", "157184"]),  # a Qwen3 drafter
])
def test_a_bad_drafter_is_refused_with_the_field_the_values_and_the_fix(change, words):
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import check_drafter, normalise_draft_config

    with pytest.raises(ValueError) as err:
        check_drafter(flash_config(), normalise_draft_config(_card_drafter(**change)))
    for word in [*words, "Fix: serve the drafter trained for this target"]:
        assert word in str(err.value), (word, str(err.value))


def test_k_beyond_the_block_is_refused():
    from vllm_ling.configs import flash_config
    from vllm_ling.draft.dspark import check_drafter, normalise_draft_config

    with pytest.raises(ValueError, match=r"num_speculative_tokens=9 is outside 1..block_size=8"):
        check_drafter(flash_config(), normalise_draft_config(_card_drafter()), num_speculative_tokens=9)


def test_a_ling_drafter_beside_vllms_in_tree_model_is_refused_at_config_time(monkeypatch):
    """vLLM's in-tree Ling model has no aux hidden states: refused where vLLM reads the drafter's config, naming the
    fix, not after loading with vLLM's "Model does not support EAGLE3 interface"; other drafters pass untouched."""
    from vllm_ling import compat

    monkeypatch.setattr(compat, "_VLLM_HF_CONFIG_OVERRIDE", lambda config, *a, **kw: config)
    monkeypatch.setattr(compat, "serving_model", lambda: (compat.VLLM, "VLLM_LING_MODEL=vllm"))
    with pytest.raises(ValueError, match=r"in-tree Ling model does not provide.*VLLM_LING_MODEL=vllm\).*Fix: serve "
                                         r"vllm-ling's model"):
        compat._dspark_hf_config_override(_card_drafter())
    qwen3 = {"architectures": ["Qwen3DSparkModel"], "block_size": 7}
    assert compat._dspark_hf_config_override(dict(qwen3)) == qwen3
    monkeypatch.setattr(compat, "serving_model", lambda: (compat.OURS, "VLLM_LING_MODEL=vllm-ling"))
    assert compat._dspark_hf_config_override(_card_drafter())["architectures"][1] == "Qwen3DSparkModel"


def test_vllm_routes_the_drafter_to_our_qwen3_dspark_class(tiny_bf16, tmp_path):
    """vLLM's own speculative config, the plugin loaded: our drafter class, K = the block size, the aux layers."""
    from model_helpers import run_script

    from ling_tools.tiny.dspark import TINY_TARGET_LAYER_IDS, make_tiny_dspark

    draft = make_tiny_dspark(tmp_path / "draft", Path(tiny_bf16))
    out = run_script("test_dspark.py", {"side": "route", "model": tiny_bf16, "draft": str(draft)}, tmp_path,
                     "route", {"VLLM_LING_FORCE": "1"})
    assert out["resolved"] == "LingDSparkModel" and out["model_type"] == "qwen3"  # not the DeepSeek-V4 branch
    assert out["architectures"] == ["LingDSparkModel", "Qwen3DSparkModel"]
    assert (out["k"], out["markov_rank"]) == (8, 256)
    assert out["aux"] == [i + 1 for i in TINY_TARGET_LAYER_IDS]
    # built as vLLM builds it: ours, and each layer's cache in its own block within the hybrid target's page
    assert out["built"]["class"] == "LingDSparkForCausalLM"
    assert list(out["built"]["specs"].values()) == [["FullAttentionSpec", 128, 128 * 2 * 4 * 128 * 2]] * 2
    # no quantization of its own asked for: BF16 throughout, whatever the target's (the head it shares is FP8 here)
    assert out["quantization"] is None and set(out["built"]["methods"].values()) == set(BF16_METHODS.values())
    assert not any(startup_log.DSPARK_FP8_ON.search(line) for line in out["built"]["lines"])
    assert "shared with the target's (lm_head Fp8" in out["built"]["shared"]


# ---------------------------------------------------------------------------- the drafter's own FP8 weights

# What the tiny drafter's own quantization ling_fp8 takes (written from vLLM's Qwen3 DSpark drafter, not read from
# the code under test): every linear built with the draft's quant config (q|k|v, o, gate|up, down of its 2 layers,
# fc) and markov_w2, the Markov head's ParallelLMHead; the confidence head is built without one (fp32), and the
# drafter's own LM head and embedding too (the target's replace them at load).
FP8_LINEARS = {f"model.layers.{i}.{m}" for i in range(2)
               for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")} | {"model.fc"}
MARKOV_W2 = "model.markov_head.markov_w2"
BF16_METHODS = {"model.confidence_head.proj": "UnquantizedLinearMethod", "lm_head": "UnquantizedEmbeddingMethod",
                "model.embed_tokens": "UnquantizedEmbeddingMethod"}
FP8_TOL = 1e-2  # tests/model/test_fp8.py's block tolerance: relative to the output's scale (bf16 output rounding)
DRAFT_TOPK = 4


@pytest.fixture(scope="module")
def fp8_drafters(tiny_bf16, tmp_path_factory) -> dict[str, dict]:
    """The tiny drafter built and loaded as vLLM's DSpark loader does with `"quantization": "ling_fp8"` in the
    speculative config, block scales: Markov head read whole ("fp8") and by gathered rows ("topk", vLLM's
    dspark_draft_topk)."""
    from model_helpers import run_scripts

    from ling_tools.tiny.dspark import make_tiny_dspark
    from vllm_ling.fp8 import SCHEME_ENV

    tmp = tmp_path_factory.mktemp("dspark-fp8")
    draft = str(make_tiny_dspark(tmp / "draft", Path(tiny_bf16)))
    options = {"fp8": {"quantization": "ling_fp8"},
               "topk": {"quantization": "ling_fp8", "dspark_draft_topk": DRAFT_TOPK}}
    jobs = [("test_dspark.py", {"side": "route", "model": tiny_bf16, "draft": draft, "options": o}, name)
            for name, o in options.items()]
    runs = run_scripts(jobs, tmp, {"VLLM_LING_FORCE": "1", SCHEME_ENV: "block"})
    return {name: run["built"] | {"quantization": run["quantization"]} for name, run in zip(options, runs)}


@pytest.mark.engine
def test_the_drafters_own_quantization_puts_its_linears_and_markov_head_in_fp8(fp8_drafters):
    from vllm_ling.startup_log import DSPARK_FP8_ON, DSPARK_MARKOV_ON

    built = fp8_drafters["fp8"]
    assert built["quantization"] == "ling_fp8"  # vLLM took our registered name for the draft model config
    fp8 = {n for n, m in built["methods"].items() if m.startswith("Fp8")}
    assert fp8 == FP8_LINEARS | {MARKOV_W2} and {built["methods"][n] for n in fp8} == {"Fp8BlockLinearMethod"}
    assert {n: built["methods"][n] for n in BF16_METHODS} == BF16_METHODS
    line = DSPARK_FP8_ON.text(linears=len(FP8_LINEARS), markov=DSPARK_MARKOV_ON, kernel="w8a8", scheme="block")
    assert line in built["lines"]
    # the LM head and embedding are still the target's modules, its FP8 head included (vllm_ling/draft/check.py)
    assert "shared with the target's (lm_head Fp8BlockLinearMethod, float8_e4m3fn)" in built["shared"]


@pytest.mark.engine
def test_the_fp8_drafter_computes_the_block_fp8_reference(fp8_drafters):
    """Every FP8 matrix, the Markov head through vLLM's logits processor and the context K/V vLLM projects
    through the quantized q|k|v: within test_fp8.py's tolerance of the block rule's reference, and far nearer it
    than the BF16 product (the FP8 rounding is there, and it is the rule's)."""
    numbers = fp8_drafters["fp8"]["numbers"]
    assert set(numbers) == {"fc", "markov_w2", *(f"layers.{i}.{m}" for i in range(2) for m in (
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj", "context_kv"))}
    for name, (to_reference, to_bf16) in numbers.items():
        assert to_reference < FP8_TOL, (name, to_reference)
        assert to_bf16 > 5 * to_reference, (name, to_reference, to_bf16)


@pytest.mark.engine
def test_a_markov_head_read_by_gathered_rows_stays_bf16(fp8_drafters):
    """vLLM's top-k Markov path indexes markov_w2.weight and refuses a quantized one (the control: the FP8 head
    raises there); with dspark_draft_topk the head stays BF16 and its gathered bias equals the whole bias at those
    rows, the drafter's linears FP8 as before."""
    from vllm_ling.startup_log import DSPARK_FP8_ON, DSPARK_MARKOV_BF16

    assert not fp8_drafters["fp8"]["gathers"] and "requires unquantized weights" in fp8_drafters["fp8"]["gather_error"]
    topk = fp8_drafters["topk"]
    assert topk["gathers"] and topk["methods"][MARKOV_W2] == "UnquantizedEmbeddingMethod"
    assert {n for n, m in topk["methods"].items() if m.startswith("Fp8")} == FP8_LINEARS
    assert topk["gather_distance"] < FP8_TOL
    line = DSPARK_FP8_ON.text(linears=len(FP8_LINEARS), markov=DSPARK_MARKOV_BF16, kernel="w8a8", scheme="block")
    assert line in topk["lines"]


def test_only_a_gathered_markov_head_is_kept_by_name():
    from vllm_ling import fp8

    prefix = "draft.model.markov_head.markov_w2"
    assert fp8.gathered_rows(SimpleNamespace(dspark_draft_topk=8)) == (fp8.MARKOV_W2,)
    assert fp8.keeps_bf16(prefix, fp8.gathered_rows(SimpleNamespace(dspark_draft_topk=8)))
    assert fp8.gathered_rows(SimpleNamespace()) == () and not fp8.keeps_bf16(prefix)
    assert not fp8.keeps_bf16("draft.model.layers.6.self_attn.qkv_proj", (fp8.MARKOV_W2,))


# ---------------------------------------------------------------------------- the tiny drafter

def test_tiny_drafter_has_the_real_names_and_fits_its_target(tiny_bf16, tmp_path):
    from safetensors.torch import load_file

    from vllm_ling.draft.dspark import check_drafter, check_drafter_tensors, normalise_draft_config, required_tensors
    from ling_tools.tiny.dspark import make_tiny_dspark

    out = make_tiny_dspark(tmp_path / "d", Path(tiny_bf16))
    config = normalise_draft_config(json.loads((out / "config.json").read_text()))
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(required_tensors(config))
    assert not [n for n in tensors if "lm_head" in n or "embed_tokens" in n]  # the target's, shared
    target = json.loads((Path(tiny_bf16) / "config.json").read_text())
    assert tensors["fc.weight"].shape == (target["hidden_size"], 3 * target["hidden_size"])
    assert tensors["markov_head.markov_w2.weight"].shape == (target["vocab_size"], 256)
    check_drafter(target, config)
    check_drafter_tensors(config, tensors)
    with pytest.raises(ValueError, match="lacks markov_head.markov_w1.weight, markov_head.markov_w2.weight"):
        check_drafter_tensors(config, [n for n in tensors if not n.startswith("markov_head.")])


def test_the_agreeing_drafter_drafts_the_echo_targets_next_token(tmp_path):
    """Markov bias argmax = f(prev) for every token; the random drafter's almost never is."""
    from safetensors.torch import load_file

    from ling_tools.tiny import ensure_tiny
    from ling_tools.tiny.dspark import make_tiny_dspark, target_echo

    target = ensure_tiny(variant="mtp_echo")
    echo = target_echo(target, json.loads((target / "config.json").read_text()))

    def markov_choice(agree: bool) -> torch.Tensor:
        w = load_file(make_tiny_dspark(tmp_path / str(agree), target, agree=agree) / "model.safetensors")
        return (w["markov_head.markov_w1.weight"].float() @ w["markov_head.markov_w2.weight"].float().T).argmax(-1)

    assert (markov_choice(True) == echo).float().mean() == 1.0
    assert (markov_choice(False) == echo).float().mean() < 0.01


# ---------------------------------------------------------------------------- the shared (FP8) LM head

@pytest.fixture
def fp8_target(tiny_bf16):
    from vllm_layers import vllm_layer_context

    from vllm_ling.draft import check as draft_check

    with vllm_layer_context(tiny_bf16):
        target = _stand_in_target(512, 256)
        draft_check._targets.clear()
        draft_check.register_target(target)
        yield target
        draft_check._targets.clear()


def _draft_without_head(target):
    """A drafter as vLLM's DSpark loader builds it: its own BF16 head and embedding, no checkpoint tensors
    for them (has_own_lm_head / has_own_embed_tokens stay False)."""
    from torch import nn
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    draft = nn.Module()
    draft.lm_head, draft.model = ParallelLMHead(512, 256, prefix="lm_head"), nn.Module()
    draft.model.embed_tokens = VocabParallelEmbedding(512, 256)
    return draft


def test_vllms_dspark_loader_installs_the_targets_fp8_head_module_itself(fp8_target, tiny_bf16):
    from vllm_layers import vllm_layer_context

    from vllm_ling.draft.dspark import check_draft_shares_target

    with vllm_layer_context(tiny_bf16):
        draft = _draft_without_head(fp8_target)
        _share_as_vllm_does(draft, fp8_target)
    assert draft.lm_head is fp8_target.lm_head and draft.model.embed_tokens is fp8_target.model.embed_tokens
    line = check_draft_shares_target(draft)
    assert "shared with" in line and "Fp8" in line and "float8_e4m3fn" in line


def test_a_drafter_reading_the_fp8_bytes_through_a_bf16_head_is_refused(fp8_target, tiny_bf16):
    from vllm_layers import vllm_layer_context

    from vllm_ling.draft.dspark import check_draft_shares_target

    with vllm_layer_context(tiny_bf16):
        draft = _draft_without_head(fp8_target)
    draft.lm_head.weight = fp8_target.lm_head.weight  # the FP8 tensor under UnquantizedEmbeddingMethod
    draft.model.embed_tokens = fp8_target.model.embed_tokens
    with pytest.raises(RuntimeError, match=r"DSpark drafter's lm_head runs Unquantized.* where the target runs Fp8"):
        check_draft_shares_target(draft)


def test_our_drafter_class_refuses_missing_tensors_and_checks_its_head(fp8_target, tiny_bf16, tmp_path, monkeypatch):
    """`LingDSparkForCausalLM` (what vLLM builds for the drafter): vLLM's loading underneath, our two checks on top."""
    from safetensors.torch import load_file
    from torch import nn
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_ling.draft.dspark import LingDSparkForCausalLM, normalise_draft_config
    from ling_tools.tiny.dspark import make_tiny_dspark

    assert issubclass(LingDSparkForCausalLM, Qwen3DSparkForCausalLM)
    out = make_tiny_dspark(tmp_path / "d", Path(tiny_bf16))
    monkeypatch.setattr(Qwen3DSparkForCausalLM, "load_weights", lambda self, weights: [n for n, _ in weights])
    drafter = LingDSparkForCausalLM.__new__(LingDSparkForCausalLM)
    nn.Module.__init__(drafter)
    drafter.config = normalise_draft_config(json.loads((out / "config.json").read_text()))
    tensors = load_file(out / "model.safetensors")
    drafter.load_weights(tensors.items())
    with pytest.raises(ValueError, match="lacks markov_head.markov_w2.weight"):
        drafter.load_weights((n, t) for n, t in tensors.items() if n != "markov_head.markov_w2.weight")
    assert any(n.startswith("confidence_head.") for n in tensors)  # the tiny drafter has one, as the released does
    drafter.config["enable_confidence_head"] = False  # a config spelling the head in a way we did not read
    with pytest.raises(ValueError, match=r"holds confidence_head\.proj\.bias, confidence_head\.proj\.weight, and its "
                                         r"config turns the confidence head off.*enable_confidence_head"):
        drafter.load_weights(tensors.items())
    drafter.lm_head, drafter.model = fp8_target.lm_head, nn.Module()
    drafter.model.embed_tokens = fp8_target.model.embed_tokens
    drafter._check_shares_once()
    assert drafter._shares_checked



def _kv_specs(mla_block: int, kda_page: int, draft_heads: int) -> dict:
    """A hybrid target's KV specs as vLLM plans them (MLA 576 wide at the block vLLM grew for KDA, the KDA page
    padded to the MLA page) beside a drafter's dense layer at the same block, as vLLM would build it unaided."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    mla = MLAAttentionSpec(block_size=mla_block, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    draft = FullAttentionSpec(block_size=mla_block, num_kv_heads=draft_heads, head_size=128, dtype=torch.bfloat16)
    assert kda_page <= mla.page_size_bytes
    return {"mla": mla, "draft": draft}


@pytest.mark.parametrize("mla_block, draft_heads, want", [
    (256, 4, 128),     # the tiny target (vLLM's block 256 on the GPU) and the tiny drafter: 4 KV heads of 128
    (1920, 32, 128),   # full size: vLLM's block for a 2.1 MB KDA state (MLA: a multiple of 128), the
                       # released drafter's 32 KV heads of 128
])
def test_the_drafters_kv_block_fits_the_hybrid_targets_page(mla_block, draft_heads, want):
    """vLLM cannot give an MLA page the drafter's larger page (its unifier raises); with the drafter's own block
    its page is the smaller one, which vLLM pads, and every layer ends on one page size."""
    from vllm.v1.core.kv_cache_utils import unify_kv_cache_spec_page_size

    from vllm_ling.draft.dspark import draft_kv_block

    specs = _kv_specs(mla_block, kda_page=0, draft_heads=draft_heads)
    page = specs["mla"].page_size_bytes
    with pytest.raises(NotImplementedError, match="cannot be padded"):
        unify_kv_cache_spec_page_size(dict(specs))
    per_token = specs["draft"].page_size_bytes // mla_block
    block = draft_kv_block(per_token, mla_block, page)
    assert block == want and mla_block % block == 0 and block * per_token <= page
    specs["draft"] = specs["draft"].copy_with_new_block_size(block)
    unified = unify_kv_cache_spec_page_size(specs)
    assert {s.page_size_bytes for s in unified.values()} == {page}
    assert unified["mla"] == specs["mla"]


def test_the_drafters_kv_block_is_left_alone_where_it_fits():
    from vllm_ling.draft.dspark import draft_kv_block

    assert draft_kv_block(2048, 256, None) == 256             # no hybrid page: vLLM's block
    assert draft_kv_block(1024, 256, 294_912) == 256          # already no larger than the target's page
    assert draft_kv_block(1 << 20, 256, 294_912) == 256       # not even 16 tokens fit: vLLM's own error stands


def test_our_drafter_class_takes_what_vllm_passes_a_model():
    """vLLM builds a model with the keyword arguments its constructor's signature names (`vllm_config`, `prefix`):
    ours must name the same ones as vLLM's drafter, or the engine passes nothing and fails at start-up."""
    import inspect

    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    from vllm_ling.draft.dspark import LingDSparkForCausalLM

    ours, theirs = (inspect.signature(c.__init__).parameters for c in (LingDSparkForCausalLM, Qwen3DSparkForCausalLM))
    assert [(n, p.kind) for n, p in ours.items()] == [(n, p.kind) for n, p in theirs.items()]


def test_our_drafter_layers_plan_their_cache_in_their_own_block():
    """`_own_kv_block` on a layer: the spec vLLM asks for carries the drafter's block; other specs pass through."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_ling.draft.dspark import _own_kv_block

    layer = SimpleNamespace(attn_type="decoder", get_kv_cache_spec=lambda cfg: FullAttentionSpec(
        block_size=cfg.cache_config.block_size, num_kv_heads=4, head_size=128, dtype=torch.bfloat16))
    _own_kv_block(layer)
    hybrid = SimpleNamespace(cache_config=SimpleNamespace(block_size=256, mamba_page_size_padded=294_912))
    plain = SimpleNamespace(cache_config=SimpleNamespace(block_size=16, mamba_page_size_padded=None))
    assert layer.get_kv_cache_spec(hybrid).block_size == 128
    assert layer.get_kv_cache_spec(plain).block_size == 16


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = {"engine": _engine, "oracle": _oracle, "route": _route}[spec["side"]](spec)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    from model_helpers import exit_at_once  # this script's folder is on sys.path

    exit_at_once()
