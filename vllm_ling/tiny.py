"""Tiny random-weight Ling-3.0 (BailingMoeV3) checkpoints: the test fixtures and the README's default model.

The tiny model keeps every structural feature of Ling-3.0-flash at toy width (ling3-architecture.md §11):
KDA layers with the MLA layer every ``layer_group_size``-th, a dense first layer, grouped sigmoid routing
with a correction bias, shared + routed experts with per-layer SwiGLU clamps, and one MTP layer. Names,
shapes and the INT4 layout are those of the real checkpoints (§8.1, §8.2); the config is the bundled
full-size Flash config with smaller values, so the field set is the real one.

Weights are drawn per tensor from a generator seeded by ``(seed, name)``: the same seed gives
byte-identical files, and the BF16 and INT4 variants (or the ``qlora`` variant) share every tensor
they have in common.

    ling-make-tiny OUT [--seed N] [--int4] [--variant qlora] [--force]   # write a checkpoint to OUT
    ling-make-tiny [--int4]               # build once into the cache (ensure_tiny) and print its path
    ling-make-tiny OUT --full-config      # full-size Flash INT4 config.json for --load-format dummy
    ling-make-tiny OUT --dequantize INT4  # INT4 checkpoint -> BF16 (the oracle's input)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

GENERATOR_VERSION = 2  # bump when the weights, config or tokenizer recipe change: stale caches rebuild
FULL_CONFIG_DIR = Path(__file__).parent / "configs" / "ling-3.0-flash-int4"
STAMP_FILE = "vllm_ling_tiny.json"
NUM_SHARDS = 2  # more than one, so multi-shard loading is exercised
VARIANTS = ("default", "qlora", "mtp_echo", "stable_router")
INT4_GROUP_SIZE = 32

# Tiny values on top of the full Flash config (§11). The clamp limits are tuned to the weight scales
# below: gate/up pre-activations have std ~1, so these limits bind on a good share of the channels.
TINY_VALUES: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 6,
    "layer_group_size": 3,  # MLA at layers 2 and 5, KDA at 0, 1, 3, 4
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 128,  # KDA head dim: P = 512, like the real kernels' d
    "max_position_embeddings": 4096,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "moe_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
    # Routed clamps only in the last two layers, shared clamps from one layer earlier and a different
    # value in the last one, like Flash (layers 35-41 / 34-39 / 40-41). MTP (layer 6) is past the lists.
    "expert_swiglu_limit_list": [0, 0, 0, 0, 1.0, 1.0],
    "share_expert_swiglu_limit_list": [0, 0, 0, 1.25, 1.25, 1.5],
}
QLORA_VALUES: dict[str, Any] = {"q_lora_rank": 64}  # Ling-3.0-tiny style q_a/q_b projections

SPECIAL_TOKENS = (
    "<|endoftext|>",  # eos
    "<|pad|>",
    "<role>",
    "</role>",
    "<|role_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)
TOKENIZER_VOCAB = 1000

# GLM-like turns with Ling's <role> markers. Thinking is on unless `enable_thinking`/`thinking` is false
# (ling3-architecture.md §9): the generation prompt then opens the think block.
CHAT_TEMPLATE = (
    "{%- set think = not ((enable_thinking is defined and not enable_thinking)"
    " or (thinking is defined and not thinking)) -%}"
    "{%- if tools -%}<role>SYSTEM</role>"
    "{%- if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif -%}"
    "# Tools\nYou may call functions. Their signatures:\n<tools>"
    "{%- for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n"
    "Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>."
    "<|role_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{%- if not tools -%}<role>SYSTEM</role>{{ m.content }}<|role_end|>"
    "{%- endif -%}"
    "{%- elif m.role == 'user' -%}<role>HUMAN</role>{{ m.content }}<|role_end|>"
    "{%- elif m.role == 'assistant' -%}<role>ASSISTANT</role>"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{{- m.content if m.content else '' -}}"
    "{%- for tc in (m.tool_calls or []) -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}<tool_call>{{ f.name }}"
    "{%- if f.arguments is mapping -%}{%- for k, v in f.arguments.items() -%}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>"
    "{%- endfor -%}{%- else -%}{{ f.arguments }}{%- endif -%}</tool_call>"
    "{%- endfor -%}<|role_end|>"
    "{%- elif m.role == 'tool' -%}<role>OBSERVATION</role>{{ m.content }}<|role_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<role>ASSISTANT</role>{%- if think %}<think>\n{% endif -%}{%- endif -%}"
)

# Training text for the byte-level BPE: plain English and a little Python/JSON, written for this file.
_CORPUS = r'''
The morning was cold and clear, and the river ran fast under the old stone bridge. A small boat
waited at the dock while two friends checked the map, counted the water bottles and argued about
the weather. "It will rain after lunch," said one of them. "Then we should leave now," said the other.
They packed bread, cheese, apples, a warm coat and a book about birds. Along the bank they saw herons,
ducks and a quiet kingfisher that flashed blue over the water and was gone.
In the village the bakery opened at seven. People came for fresh bread, coffee and the local news.
The baker knew every name, every dog and every birthday, and she always saved the last loaf for the
teacher who walked past at half past eight with a stack of papers under her arm.
Cooking is a kind of patient experiment. Heat the pan, add a little oil, then the onions; stir them
until they turn soft and golden. Add garlic, tomatoes and a pinch of salt. Let the sauce simmer for
twenty minutes, taste it, and adjust. A good recipe is a starting point, not a rule.
Science asks simple questions and answers them carefully. Why is the sky blue? Sunlight contains
many colors, and the air scatters short blue waves more strongly than long red ones. At sunset the
light travels through more air, the blue is scattered away, and the clouds glow orange and red.
A computer program is a list of instructions. The machine follows them exactly, one step at a time,
which is why a single missing line can change the result. Good programmers write small functions,
choose clear names, test their code and read the error messages slowly before they change anything.
Mathematics gives us tools to count, measure and reason. The sum of the first n numbers is n times
n plus one, divided by two. A prime number has exactly two divisors. The square root of two is not
a ratio of whole numbers, and the proof is short enough to fit on the back of a ticket.
Questions and answers: What is the capital of France? Paris. How many days are in a week? Seven.
Which planet is the largest? Jupiter. What do bees make? Honey. Who wrote the letter? Nobody knows.
Please summarize the report in three sentences. Translate the following text into English. Explain
the difference between a list and a tuple. Write a short poem about the sea. Think step by step.
The library closes at nine on weekdays and at noon on Saturday. Members may borrow up to ten books
for three weeks, and they can renew them online unless another reader has placed a hold. Children
under twelve need a parent to sign the form. The reading room on the second floor is quiet; phones
must be switched to silent, and food is not allowed near the old maps and newspapers.
Our train left the station twenty minutes late because of a signal problem near the tunnel. The
conductor apologized twice, offered free tea, and promised that we would still arrive before dark.
Outside the window the fields changed from green to brown to gold, and small towns appeared and
disappeared like pages in a picture book: a church, a market square, a school, a row of red roofs.
Dear team, thank you for your work this month. The new release fixed forty bugs, improved the start
time by a third and added support for two languages. Next week we will plan the roadmap for spring.
Please send your ideas before Friday, and remember to update the documentation when you merge a change.
Health tips: drink enough water, sleep seven to nine hours, walk every day and eat vegetables, fruit,
beans and whole grains. Stretch after long meetings. Wash your hands before meals. Ask a doctor when
a cough lasts longer than three weeks or when a fever does not go down.
History is a long conversation between the past and the present. Old letters, coins, tools and
buildings tell us how people lived, what they believed and what they feared. Historians compare many
sources, because every witness sees only part of the story and every record was written for a reason.
The garden needs attention in April. Plant beans and peas after the last frost, water the young
tomatoes in the evening, pull the weeds while they are small and cover the soil with straw so that it
stays moist. Bees visit the lavender, and in summer the sunflowers grow taller than the fence.
User: Can you help me plan a trip to the mountains? Assistant: Of course. How many days do you have,
and do you prefer hiking, skiing or a quiet cabin by a lake? User: Three days, hiking, not too hard.
Assistant: Then start with an easy trail by the valley, take the cable car on the second day, and
keep the third day for a lake walk and a slow lunch. Check the weather forecast the night before.
Music lessons begin with rhythm. The teacher claps a simple pattern, the students repeat it, and
then they play it on drums, on the piano and finally with their voices. Later they learn scales,
chords and short songs, and by the end of the year every class performs a concert for the parents.
The city council voted on Tuesday to build a new bicycle lane along the river, plant two hundred
trees and extend the night bus service. Some shop owners worried about parking; others expected more
visitors. The work will start in June and should finish before the winter holidays.
A good email is short and polite. Start with a clear subject line, say what you need in the first
sentence, give the important details, and end with a thank you. Read it again before you press send,
check the names and the dates, and attach the file you promised to attach.
Weather report: cloudy in the north with light rain in the afternoon, sunny and warm in the south,
strong winds along the coast. Tomorrow will be colder, with temperatures between four and eleven
degrees, and there is a chance of snow on the highest hills during the night.
Every good story needs a person who wants something, a problem that stands in the way, and a change
by the end. The young painter wanted to see the ocean, but the road was long and the money was short,
so she painted signs for shops along the way, and each town paid her in bread, in stories or in rides.
When she finally reached the coast she did not paint the ocean at all; she painted the people she met.
Shopping list: milk, eggs, butter, flour, sugar, rice, pasta, olive oil, onions, carrots, potatoes,
lemons, coffee, tea, soap, paper towels and batteries for the kitchen clock.
Instructions: open the box, remove the cable, connect the device to power, wait until the light turns
green, then press the button for three seconds. If the light turns red, unplug the device, wait ten
seconds and try again. Contact support if the problem continues.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


def read_config(path: str) -> dict:
    import json
    with open(path, "r", encoding="utf-8") as handle:
        return json.load(handle)


for index, name in enumerate(["alpha", "beta", "gamma"]):
    if index % 2 == 0:
        print(f"{index}: {name}")
    else:
        print("skip", name)


def binary_search(items: list[int], target: int) -> int:
    """Return the index of target in the sorted list, or -1."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


async def fetch_all(urls: list[str], timeout: float = 10.0) -> dict[str, int]:
    results: dict[str, int] = {}
    for url in urls:
        response = await client.get(url, timeout=timeout)
        results[url] = response.status_code
    return results


@dataclass
class Point:
    x: float
    y: float

    def distance(self, other: "Point") -> float:
        return ((self.x - other.x) ** 2 + (self.y - other.y) ** 2) ** 0.5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Process some files.")
    parser.add_argument("paths", nargs="+", help="input files")
    parser.add_argument("--verbose", action="store_true", help="print more output")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args()
    for path in args.paths:
        with open(path) as handle:
            lines = handle.readlines()
        print(path, len(lines))

result = {"name": "get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}
numbers = [x * x for x in range(10) if x > 2]
total = sum(numbers) / max(len(numbers), 1)
assert total > 0, "total must be positive"
try:
    value = int("42")
except ValueError as error:
    raise RuntimeError("bad value") from error
import torch
x = torch.zeros(4, 8, dtype=torch.float32)
y = torch.nn.functional.silu(x @ x.T)
print(y.shape, y.dtype)
SELECT id, name, price FROM products WHERE price > 10 ORDER BY price DESC LIMIT 5;
{"id": 7, "tags": ["red", "green"], "active": true, "score": 0.95, "owner": null}
'''


# ---------------------------------------------------------------------------------------------- config


def full_config() -> dict[str, Any]:
    """The bundled Ling-3.0-flash-int4 config.json (§1 values + the INT4 quantization_config)."""
    return json.loads((FULL_CONFIG_DIR / "config.json").read_text())


def tiny_config(variant: str = "default", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Flash config with the tiny values; token ids are filled in from the tokenizer later."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is unknown; use one of {VARIANTS}")
    config = full_config()
    config.pop("quantization_config", None)
    config.update(copy.deepcopy(TINY_VALUES))
    if variant == "qlora":
        config.update(QLORA_VALUES)
    config.update(copy.deepcopy(overrides or {}))
    return config


def is_mla_layer(layer: int, config: dict[str, Any]) -> bool:
    """MLA iff (i+1) % G == 0, or i is in an incomplete final group; MTP layers (i >= L) are MLA (§2, §7)."""
    n, g = config["num_hidden_layers"], config["layer_group_size"]
    return layer >= n or (layer + 1) % g == 0 or layer >= (n // g) * g


def is_moe_layer(layer: int, config: dict[str, Any]) -> bool:
    return layer >= config["first_k_dense_replace"]


def validate_config(config: dict[str, Any], *, int4: bool = False) -> None:
    """Reject configs the generator (or Ling's structure) cannot express, naming the value and the fix."""
    n = config["num_hidden_layers"]
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if len(config[key]) != n:
            raise ValueError(
                f"{key} has {len(config[key])} entries but num_hidden_layers={n}; "
                f"give one limit per main layer (0 = no clamp)"
            )
    e, groups, topk_group, k = (
        config["num_experts"], config["n_group"], config["topk_group"], config["num_experts_per_tok"])
    if e % groups or topk_group > groups or k > topk_group * (e // groups):
        raise ValueError(
            f"num_experts={e}, n_group={groups}, topk_group={topk_group}, num_experts_per_tok={k}: "
            f"need num_experts % n_group == 0, topk_group <= n_group and "
            f"num_experts_per_tok <= topk_group * num_experts / n_group"
        )
    if not config.get("no_kda_lora", True):
        raise ValueError("no_kda_lora=false (low-rank KDA f/g) is not a Ling-3.0 layout; keep it true")
    if config["gated_attention_proj_granularity_type"] not in ("head_wise", "element_wise"):
        raise ValueError(
            f"gated_attention_proj_granularity_type={config['gated_attention_proj_granularity_type']!r}; "
            f"use 'head_wise' (Flash) or 'element_wise'"
        )
    if int4:
        for key in ("hidden_size", "moe_intermediate_size"):
            if config[key] % INT4_GROUP_SIZE:
                raise ValueError(
                    f"{key}={config[key]} is not a multiple of the INT4 group size {INT4_GROUP_SIZE}; "
                    f"pick a multiple of 32 (Marlin also wants hidden_size % 128 == 0)"
                )


# ---------------------------------------------------------------------------------------------- tensors


@dataclass(frozen=True)
class TensorSpec:
    """Shape and init recipe of one checkpoint tensor (§11)."""

    shape: tuple[int, ...]
    init: str  # "linear" | "lm_head" | "embedding" | "norm" | "conv" | "a_log" | "dt_bias" | "expert_bias"
    fp32: bool = False  # A_log, dt_bias, conv and expert_bias are fp32 on disk (see _init_tensor)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _linear(out_features: int, in_features: int) -> TensorSpec:
    return TensorSpec((out_features, in_features), "linear")


def _norm(width: int) -> TensorSpec:
    return TensorSpec((width,), "norm")


def _kda_specs(c: dict[str, Any]) -> dict[str, TensorSpec]:
    h, heads, d, k = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["short_conv_kernel_size"]
    p = heads * d
    specs = {f"{x}_proj.weight": _linear(p, h) for x in "qkvfg"}
    specs |= {f"{x}_conv1d.weight": TensorSpec((p, 1, k), "conv", fp32=True) for x in "qkv"}
    specs |= {
        "b_proj.weight": _linear(heads, h),
        "A_log": TensorSpec((heads,), "a_log", fp32=True),
        "dt_bias": TensorSpec((p,), "dt_bias", fp32=True),
        "o_norm.weight": _norm(d),
        "o_proj.weight": _linear(h, p),
    }
    return specs


def _mla_specs(c: dict[str, Any]) -> dict[str, TensorSpec]:
    h, heads, r_kv = c["hidden_size"], c["num_attention_heads"], c["kv_lora_rank"]
    nope, rope, v = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    q_out = heads * (nope + rope)
    if c.get("q_lora_rank"):
        r_q = c["q_lora_rank"]
        specs = {"q_a_proj.weight": _linear(r_q, h), "q_a_layernorm.weight": _norm(r_q),
                 "q_b_proj.weight": _linear(q_out, r_q)}
    else:
        specs = {"q_proj.weight": _linear(q_out, h)}
    gate_out = heads if c["gated_attention_proj_granularity_type"] == "head_wise" else heads * v
    specs |= {
        "kv_a_proj_with_mqa.weight": _linear(r_kv + rope, h),
        "kv_a_layernorm.weight": _norm(r_kv),
        "kv_b_proj.weight": _linear(heads * (nope + v), r_kv),
        "g_proj.weight": _linear(gate_out, h),
        "dense.weight": _linear(h, heads * v),
    }
    return specs


def _swiglu_specs(hidden: int, inter: int) -> dict[str, TensorSpec]:
    return {"gate_proj.weight": _linear(inter, hidden), "up_proj.weight": _linear(inter, hidden),
            "down_proj.weight": _linear(hidden, inter)}


def _moe_specs(c: dict[str, Any]) -> dict[str, TensorSpec]:
    h, e = c["hidden_size"], c["num_experts"]
    shared = c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"]
    specs = {"gate.weight": _linear(e, h), "gate.expert_bias": TensorSpec((e,), "expert_bias", fp32=True)}
    specs |= {f"shared_experts.{k}": s for k, s in _swiglu_specs(h, shared).items()}
    for j in range(e):
        specs |= {f"experts.{j}.{k}": s for k, s in _swiglu_specs(h, c["moe_intermediate_size"]).items()}
    return specs


def tensor_specs(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every checkpoint tensor, in file order, named as the real checkpoint names it (§8.1)."""
    h, n, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    specs = {"model.word_embeddings.weight": TensorSpec((vocab, h), "embedding")}
    for i in range(n + config["num_nextn_predict_layers"]):
        pre = f"model.layers.{i}."
        if i >= n:  # MTP: z = eh_proj [enorm(emb); hnorm(h)], then an MLA + MoE block, then final_layernorm
            specs |= {pre + "enorm.weight": _norm(h), pre + "hnorm.weight": _norm(h),
                      pre + "eh_proj.weight": _linear(h, 2 * h)}
        specs |= {pre + "input_layernorm.weight": _norm(h)}
        attn = _mla_specs(config) if is_mla_layer(i, config) else _kda_specs(config)
        specs |= {pre + "attention." + k: s for k, s in attn.items()}
        specs |= {pre + "post_attention_layernorm.weight": _norm(h)}
        mlp = _moe_specs(config) if is_moe_layer(i, config) else _swiglu_specs(h, config["intermediate_size"])
        specs |= {pre + "mlp." + k: s for k, s in mlp.items()}
        if i >= n:
            specs |= {pre + "final_layernorm.weight": _norm(h)}
    specs |= {"model.norm.weight": _norm(h), "lm_head.weight": TensorSpec((vocab, h), "lm_head")}
    return specs


def is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _init_tensor(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    """Draw one tensor (§11 recipe, rescaled so that activations stay O(1) through the layers).

    Linears are N(0, 1/fan_in): each projection keeps unit variance, so KDA/MLA/MoE outputs are O(1),
    the router logits have std ~1 and the expert gate/up pre-activations have std ~1 (the clamps bind).
    The lm_head has 3x that gain: logits std ~3, a peaked next-token distribution. The routing bias
    N(0, 0.05) is comparable to the spread of the sigmoid scores, so top-k with the bias differs from
    top-k without it on many tokens. A_log, dt_bias, conv and expert_bias are stored in fp32: their
    real on-disk dtype is unverified (§10.7), so loaders must cast whatever they find.
    """
    shape = spec.shape

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if spec.init == "linear":
        x = normal(shape[1] ** -0.5)
    elif spec.init == "lm_head":
        x = normal(3.0 * shape[1] ** -0.5)
    elif spec.init == "embedding":
        x = normal(1.0)
    elif spec.init == "norm":
        x = 1.0 + normal(0.05)
    elif spec.init == "conv":
        x = normal(0.3)  # ~kaiming for fan-in 4: keeps SiLU out of its linear region
    elif spec.init == "a_log":
        x = torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    elif spec.init == "dt_bias":  # inverse softplus of dt ~ logU(1e-3, 1e-1)
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        x = dt + torch.log(-torch.expm1(-dt))
    elif spec.init == "expert_bias":
        x = normal(0.05)
    else:
        raise ValueError(f"unknown init {spec.init!r}")
    return x.float() if spec.fp32 else x.to(torch.bfloat16)


def random_weights(config: dict[str, Any], seed: int, live_vocab: int | None = None) -> dict[str, torch.Tensor]:
    """All tensors of `tensor_specs(config)`. Ids >= `live_vocab` (past the tokenizer) are padding, as in
    the real vocab: their lm_head rows are zero, so their logit 0 sits far below the top live logits and
    greedy decoding never emits an id the tokenizer cannot decode."""
    tensors = {name: _init_tensor(spec, _generator(seed, name)) for name, spec in tensor_specs(config).items()}
    if live_vocab is not None:
        tensors["lm_head.weight"][live_vocab:] = 0
    return tensors


# ---------------------------------------------------------------------------------------------- INT4


def int4_scheme():
    """compressed-tensors W4A16: symmetric int4, group 32, weights only (§8.2)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                               group_size=INT4_GROUP_SIZE)
    return QuantizationScheme(targets=["Linear"], weights=weights)


def int4_ignore_list(config: dict[str, Any]) -> list[str]:
    """Every non-routed-expert Linear (2-D weight other than the embedding), with `.attention.` names."""
    return [
        name.removesuffix(".weight")
        for name, spec in tensor_specs(config).items()
        if len(spec.shape) == 2 and spec.init != "embedding" and not is_routed_expert(name)
    ]


def int4_quantization_config(config: dict[str, Any]):
    from compressed_tensors.quantization import QuantizationConfig

    return QuantizationConfig(config_groups={"group_0": int4_scheme()}, format="pack-quantized",
                              quantization_status="compressed", ignore=int4_ignore_list(config))


def write_quantization_config(model_dir: Path, config: dict[str, Any]) -> None:
    """Add `quantization_config` to config.json exactly as compressed-tensors' ModelCompressor writes it."""
    from compressed_tensors.compressors import ModelCompressor

    ModelCompressor(quantization_config=int4_quantization_config(config)).update_config(str(model_dir))


def quantize_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace each routed expert `.weight` by `weight_packed` int32 [out, in/8] (nibble = q + 8, LE),
    `weight_scale` bf16 [out, in/32] and `weight_shape` [2], via compressed-tensors' pack-quantized
    compressor; everything else passes through."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme = int4_scheme()
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if not is_routed_expert(name):
            out[name] = w
            continue
        scale, _ = compute_dynamic_scales_and_zp(w, scheme.weights, module=None)  # absmax / 7.5 per group
        packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        prefix = name.removesuffix("weight")
        out |= {prefix + k: packed[k].contiguous() for k in ("weight_packed", "weight_scale", "weight_shape")}
    return out


def dequantize_checkpoint(int4_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the INT4 checkpoint back as BF16 (w = (nibble - 8) * scale, by compressed-tensors' own
    decompressor): the oracle that full-precision references run on."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, dst = Path(int4_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config.pop("quantization_config"))
    if qconfig.format != "pack-quantized" or len(qconfig.config_groups) != 1:
        raise ValueError(f"{src}: expected one pack-quantized config group, got format={qconfig.format!r} "
                         f"with groups {list(qconfig.config_groups)}")
    scheme = next(iter(qconfig.config_groups.values()))
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard_of = index["weight_map"]  # a module's packed/scale/shape triple may straddle two shards
    tensors = {k: v for shard in sorted(set(shard_of.values())) for k, v in load_file(src / shard).items()}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        shard = shard_of[name]
        if name.endswith(".weight_packed"):
            prefix = name.removesuffix("weight_packed")
            local = {k: tensors[prefix + k] for k in ("weight_packed", "weight_scale", "weight_shape")}
            name, t = prefix + "weight", PackedQuantizationCompressor.decompress(local, scheme)["weight"]
        elif name.endswith((".weight_scale", ".weight_shape")):
            continue
        shards.setdefault(shard, {})[name] = t
    weight_map: dict[str, str] = {}
    for shard, out in sorted(shards.items()):
        save_file(out, dst / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, shard)
    _write_index(dst, weight_map)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json", STAMP_FILE):
            shutil.copy2(f, dst / f.name)
    return dst


# ---------------------------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """A ~1000-token byte-level BPE trained on `_CORPUS`; special tokens are appended after the merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_VOCAB - len(SPECIAL_TOKENS), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.strip().split("\n"), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def _write_tokenizer(out_dir: Path, max_length: int) -> tuple[int, int, int]:
    """Write tokenizer.json + tokenizer_config.json; return (eos_id, pad_id, number of tokens)."""
    tok = build_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                        "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|pad|>"), tok.get_vocab_size()


# ---------------------------------------------------------------------------------------------- writing


def _write_index(out_dir: Path, weight_map: dict[str, str]) -> None:
    total = sum((out_dir / f).stat().st_size for f in set(weight_map.values()))  # HF: sum of file sizes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_shards(out_dir: Path, tensors: dict[str, torch.Tensor], num_shards: int = NUM_SHARDS) -> None:
    """Split in file order into `num_shards` files of about equal bytes, plus the HF index."""
    budget = sum(t.numel() * t.element_size() for t in tensors.values()) / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    used = 0
    for name, t in tensors.items():
        if used >= budget * len(shards) and len(shards) < num_shards:
            shards.append({})
        shards[-1][name] = t
        used += t.numel() * t.element_size()
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out_dir / fname, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    _write_index(out_dir, weight_map)


def _json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


@contextlib.contextmanager
def _single_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy machine each op waits for all of
    them (16 s instead of 1 s for the INT4 packing on 2 loaded cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def make_tiny_checkpoint(out_dir: str | os.PathLike, *, seed: int = 0, int4: bool = False,
                         variant: str = "default", overrides: dict[str, Any] | None = None,
                         force: bool = False) -> Path:
    """Write a tiny random Ling-3.0 checkpoint (config, 2 safetensors shards + index, generation config,
    tokenizer) to `out_dir`. Same arguments -> byte-identical files."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if not force:
            raise FileExistsError(f"{out} exists and is not empty; pass force=True (--force) to overwrite "
                                  f"it, or choose an empty directory")
        shutil.rmtree(out)
    config = tiny_config(variant, overrides)
    validate_config(config, int4=int4)
    out.mkdir(parents=True, exist_ok=True)
    eos, pad, live_vocab = _write_tokenizer(out, config["max_position_embeddings"])
    if live_vocab > config["vocab_size"]:
        raise ValueError(f"vocab_size={config['vocab_size']} does not cover the tokenizer "
                         f"({live_vocab} tokens); use vocab_size >= {live_vocab}")
    config |= {"eos_token_id": eos, "pad_token_id": pad}
    with _single_thread():
        tensors = random_weights(config, seed, live_vocab)
        if variant == "mtp_echo":
            make_draft_agree(tensors, config)
        if variant == "stable_router":  # bf16 comparisons: expert choice set by a wide bias, not by near-ties
            for name, t in tensors.items():
                if name.endswith("mlp.gate.expert_bias"):
                    t.mul_(STABLE_BIAS_GAIN)
        if int4:
            tensors = quantize_experts(tensors)
    _write_shards(out, tensors)
    _json(out / "config.json", config)
    if int4:
        write_quantization_config(out, config)
    _json(out / "generation_config.json", {"eos_token_id": eos, "pad_token_id": pad})
    _json(out / STAMP_FILE, _stamp(seed, int4, variant, overrides))
    return out


STABLE_BIAS_GAIN = 100.0  # expert_bias N(0, 0.05) -> N(0, 5): selection set by the bias, far above bf16 noise
ECHO_DAMPING = 0.03  # scale of every layer's output projection in the mtp_echo variant


def make_draft_agree(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Turn a random checkpoint into one whose MTP draft predicts what the target will say (variant mtp_echo).

    Every main layer's output projections (KDA o_proj, MLA dense, MLP down) are damped ×ECHO_DAMPING,
    so the target's next token is mostly f(current token) = argmax lm_head(norm(embed(t))) while KDA and
    MLA state still shape the logits. The draft passes its embedding through untouched (eh_proj = [I, 0],
    its attention and MoE outputs zeroed, norms = the target's final norm), so it predicts f(t+1): the
    target's next token after t+1. Acceptance is then high but not forced, so both the accept and the
    reject paths of verification run.
    """
    n, h = config["num_hidden_layers"], config["hidden_size"]
    outputs = (".attention.o_proj.weight", ".attention.dense.weight", "down_proj.weight")
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(outputs):
            layer = int(name.split(".")[2])
            t.mul_(0.0 if layer >= n else ECHO_DAMPING)
    mtp = f"model.layers.{n}."
    eye = torch.zeros(h, 2 * h, dtype=tensors[mtp + "eh_proj.weight"].dtype)
    eye[:, :h] = torch.eye(h)
    tensors[mtp + "eh_proj.weight"] = eye
    for norm in ("enorm", "hnorm", "input_layernorm", "post_attention_layernorm"):
        tensors[f"{mtp}{norm}.weight"].fill_(1.0)
    tensors[mtp + "final_layernorm.weight"] = tensors["model.norm.weight"].clone()


def _stamp(seed: int, int4: bool, variant: str, overrides: dict[str, Any] | None) -> dict[str, Any]:
    return {"generator_version": GENERATOR_VERSION, "seed": seed, "int4": int4, "variant": variant,
            "overrides": overrides or {}}


def default_tiny_dir(*, seed: int = 0, int4: bool = False, variant: str = "default") -> Path:
    """Cache location: `$VLLM_LING_TINY_DIR` (a cache root) or ~/.cache/vllm-ling, then
    `tiny-<variant>-<int4|bf16>-seed<N>`."""
    root = Path(os.environ.get("VLLM_LING_TINY_DIR") or Path.home() / ".cache" / "vllm-ling")
    return root / f"tiny-{variant}-{'int4' if int4 else 'bf16'}-seed{seed}"


def _is_current(path: Path, stamp: dict[str, Any]) -> bool:
    try:
        return json.loads((path / STAMP_FILE).read_text()) == stamp
    except (OSError, ValueError):
        return False


def ensure_tiny(*, seed: int = 0, int4: bool = False, variant: str = "default") -> Path:
    """Return the cached tiny checkpoint, building it first if absent or stale. The build goes to a
    temporary sibling that is renamed into place, so a concurrent or interrupted build never leaves a
    half-written model at the final path."""
    final = default_tiny_dir(seed=seed, int4=int4, variant=variant)
    stamp = _stamp(seed, int4, variant, None)
    if _is_current(final, stamp):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        make_tiny_checkpoint(tmp, seed=seed, int4=int4, variant=variant)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the final dir should read like any model dir
        if final.exists():  # stale: move it aside first (rename is atomic, rmtree is not)
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, old / "stale")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
    except OSError:
        if not _is_current(final, stamp):  # not a lost race with another builder
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------------- full size


def write_full_config(out_dir: str | os.PathLike, *, force: bool = False) -> Path:
    """Copy the bundled Ling-3.0-flash-int4 config.json + generation_config.json into a model dir, e.g.
    for `vllm ... --load-format dummy --skip-tokenizer-init` (there is no tokenizer for it here)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        if (out / name).exists() and not force:
            raise FileExistsError(f"{out / name} exists; pass force=True (--force) to overwrite it")
        shutil.copyfile(FULL_CONFIG_DIR / name, out / name)
    return out


def param_counts(config: dict[str, Any]) -> dict[str, int]:
    """Parameter counts from the config (§8.4): `main` (without MTP), `mtp`, `total`, and `active` per
    token = every non-routed main parameter except the input embedding + top-k/E of the routed ones."""
    n, k, e = config["num_hidden_layers"], config["num_experts_per_tok"], config["num_experts"]
    main = mtp = routed = 0
    for name, spec in tensor_specs(config).items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layer >= n:
            mtp += spec.numel
            continue
        main += spec.numel
        routed += spec.numel if is_routed_expert(name) else 0
    embedding = config["vocab_size"] * config["hidden_size"]
    active = main - routed - embedding + routed * k // e
    return {"main": main, "mtp": mtp, "total": main + mtp, "active": active}


# ---------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ling-make-tiny",
        description="Write a tiny random-weight Ling-3.0 checkpoint (or the full-size Flash INT4 config).")
    parser.add_argument("out", type=Path, nargs="?",
                        help="output directory (default: the cache, see default_tiny_dir)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> identical files)")
    parser.add_argument("--int4", action="store_true", help="routed experts as compressed-tensors INT4")
    parser.add_argument("--variant", choices=VARIANTS, default="default",
                        help="'qlora': MLA q_a_proj/q_b_proj (q_lora_rank 64) instead of q_proj")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--full-config", action="store_true",
                      help="write the full-size Ling-3.0-flash-int4 config.json + generation_config.json "
                           "(no weights: use vLLM's --load-format dummy --skip-tokenizer-init)")
    mode.add_argument("--dequantize", type=Path, metavar="INT4_DIR",
                      help="write INT4_DIR's checkpoint dequantized to BF16 into OUT")
    args = parser.parse_args(argv)
    if args.out is None and (args.full_config or args.dequantize):
        parser.error("--full-config and --dequantize need an output directory")
    try:
        if args.out is None:
            path = ensure_tiny(seed=args.seed, int4=args.int4, variant=args.variant)
        elif args.full_config:
            path = write_full_config(args.out, force=args.force)
        elif args.dequantize:
            path = dequantize_checkpoint(args.dequantize, args.out)
        else:
            path = make_tiny_checkpoint(args.out, seed=args.seed, int4=args.int4, variant=args.variant,
                                        force=args.force)
    except (FileExistsError, ValueError) as err:
        print(f"ling-make-tiny: error: {err}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
