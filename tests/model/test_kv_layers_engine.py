"""Which layers own a KV cache in vLLM's pool, with MTP on and off, on a real CPU engine: the watchdog's memory
preflight counts the main stack's MLA layers and, with MTP on, the draft's own MLA layer
(tests/watchdog/test_defaults_match_model.py ties those counts to the bundled config by the same layer rule;
docs/ops-walls.md, "Memory model of the preflight").

vLLM (0.32, vllm/v1/worker/gpu_model_runner.py `get_kv_cache_spec`) gives a KV spec to every attention layer in
the static forward context; the MTP draft is built with the same compilation config, so its MLA layer lands
there, and `llm_base_proposer.load_model` finds it as the one layer the target did not register. Nothing marks
it to share a target layer's cache (`kv_sharing_target_layer_name`), so it gets pages of its own.
"""

from __future__ import annotations

import re

import pytest
from model_helpers import config_of
from shared_engines import ECHO, ECHO_MTP, declare

from vllm_ling.layout import is_mla_layer, num_mtp_layers

pytest.importorskip("vllm")
pytestmark = pytest.mark.engine

JOB = {"prompts": [[5, 6, 7]], "max_tokens": 2, "prompt_logprobs": False, "kv_cache_layers": True}
PLAIN, MTP = declare(ECHO, "kv-layers", **JOB), declare(ECHO_MTP, "kv-layers", **JOB)


@pytest.fixture(scope="module")
def runs(shared_engine):
    from ling_tools.tiny import ensure_tiny

    return config_of(ensure_tiny(variant="mtp_echo")), shared_engine(PLAIN)["kv_cache"], shared_engine(MTP)["kv_cache"]


def index(layer_name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", layer_name)[1])


def attention_layers(kv: dict) -> list[int]:
    """Layers with an attention KV cache of their own (KDA layers hold a MambaSpec state instead)."""
    return sorted(index(n) for n, spec in kv["specs"].items() if spec != "MambaSpec")


def test_the_layers_with_kv_are_the_mla_layers_plus_the_drafts_with_mtp(runs):
    config, plain, mtp = runs
    n, draft = config["num_hidden_layers"], num_mtp_layers(config)
    main = [i for i in range(n) if is_mla_layer(config, i)]
    drafts = [i for i in range(n, n + draft) if is_mla_layer(config, i)]
    assert draft >= 1 and drafts, "the tiny checkpoint has an MLA draft layer"
    assert attention_layers(plain) == main
    assert attention_layers(mtp) == main + drafts  # one more KV layer, as the preflight counts
    assert [index(name) for name in mtp["draft"]] == drafts


def test_the_drafts_cache_is_its_own_pages_in_the_same_pool(runs):
    _, _, mtp = runs
    assert mtp["shared"] == {}  # no layer borrows another's cache
    (draft,) = mtp["draft"]
    group = next(g for g in mtp["groups"] if draft in g)
    assert any(index(name) < index(draft) for name in group)  # grouped with the target's MLA layers
    assert len(set(mtp["blocks"].values())) == 1  # every layer's cache is cut from the same pool of blocks
