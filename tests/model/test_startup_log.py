"""The plugin's start-up lines and the self-check's reading of them share one definition (vllm_ling.startup_log):
each line reads back the fields it was written with, the plugin logs every one, and the self-check spells none
of them itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vllm_ling import startup_log

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = [  # (line, the values it is written with)
    (startup_log.REGISTERED, dict(arch="BailingMoeV3ForCausalLM", who=startup_log.INTREE, version="0.34.0",
                                  why="vLLM 0.34 (measured); not yet measured", env="VLLM_LING_MODEL")),
    (startup_log.REGISTRATION_FAILED, dict(error="ValueError: bad (really)")),
    (startup_log.FP8_ON, dict(linears=279, head=startup_log.FP8_HEAD_BF16, kernel="w8a16", scheme="channel")),
    (startup_log.DSPARK_FP8_ON, dict(linears=36, markov=startup_log.DSPARK_MARKOV_ON, kernel="w8a8", scheme="block")),
    (startup_log.KDA_GATE_IN_KERNEL, dict(env="VLLM_LING_KDA_GATE")),
    (startup_log.KDA_GATE_FELL_BACK, dict(reason="strides are (1, 2, 3); VLLM_LING_KDA_GATE=kernel serves as ours")),
    (startup_log.KDA_PREFILL, dict(kernel="Triton chunk_kda", why="FlashKDA's contract does not hold: CUDA "
                                   "capability (8, 0) (FlashKDA is built for majors (9, 10, 12))")),
    (startup_log.KDA_CHECKPOINT, dict(state="ON", why="FlashKDA writes the state at the last block boundary inside a "
                                                     "prompt's final pass, on a 16-token grid "
                                                     "(VLLM_LING_KDA_PREFILL_CHECKPOINT=0 turns them off)")),
    (startup_log.DRAFT_VOCAB, dict(ids=32768, vocab=157184, env="VLLM_LING_DRAFT_VOCAB", mib=21.0,
                                   dtype="torch.float8_e4m3fn")),
]


def test_every_line_has_a_sample():
    assert [line.template for line, _ in SAMPLES] == [line.template for line in startup_log.LINES]


@pytest.mark.parametrize(("line", "values"), SAMPLES, ids=lambda x: getattr(x, "template", "")[11:40])
def test_a_line_reads_back_what_it_was_written_with(line, values):
    log = f"noise\n(EngineCore pid=7) INFO 12-03 [x.py:1] {line.text(**values)}\nmore noise\n"
    expected = {k: format(v, ".0f") if k == "mib" else str(v) for k, v in values.items()}
    assert line.search(log) == expected
    assert line.search("noise only") is None


def _source(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text(encoding="utf-8")


def test_the_plugin_logs_every_line():
    names = {name for name, value in vars(startup_log).items() if any(value is line for line in startup_log.LINES)}
    writers = ["vllm_ling/plugin", "vllm_ling/fp8", "vllm_ling/kda", "vllm_ling/kda_core", "vllm_ling/draft/vocab"]
    used = {name for w in writers for name in names if f"startup_log.{name}" in _source(w)}
    assert used == names


def test_the_self_check_spells_no_plugin_line_itself():
    tree = ast.parse(_source("tools/selfcheck"))
    spelled = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and "vllm-ling: " in n.value and n.value.startswith("vllm-ling: ")]
    assert spelled == []
