"""ling_bench.cached_turn: an agent's turn timed inside the engine with the prefix cache on (no timing asserts)."""

import json
import os
import subprocess
import sys

import pytest

from ling_bench.cached_turn import HITS, QUERIES, parse_turns
from ling_bench.fullsize import check_turns, main


def test_turns_parse_history_plus_new():
    assert parse_turns("32768+2048") == [(32768, 2048)]
    assert parse_turns("16384+2048, 61440+1024,") == [(16384, 2048), (61440, 1024)]


@pytest.mark.parametrize("text", ["32768", "32768+", "+2048", "0+2048", "32768+0", "a+b", "1.5+2", ","])
def test_a_malformed_turn_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match=r"32768\+2048"):
        parse_turns(text)


def test_the_counter_names_are_vllms_family_names():
    """`LLM.get_metrics()` names counters as Prometheus families, without the exposition's `_total`."""
    assert (QUERIES, HITS) == ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def test_turns_beside_prefill_lengths_are_refused_before_any_engine(capsys):
    check_turns(None, [4096])
    check_turns([(4096, 512)], [])
    with pytest.raises(ValueError, match=r"--prefill 4096,16384 .* pass --prefill= with --turn"):
        check_turns([(4096, 512)], [4096, 16384])
    with pytest.raises(SystemExit) as e:
        main(["/nonexistent", "--turn", "4096+512"])  # the default --prefill lengths
    assert e.value.code == 2 and "pass --prefill= with --turn" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["/nonexistent", "--prefill=", "--turn", "4096"])
    assert e.value.code == 2 and "HISTORY+NEW" in capsys.readouterr().err


def test_a_turn_past_the_models_context_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 65536}))
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path), "--prefill=", "--turn", "16384+2048,64000+2048", "--decode", "128"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a 66048-token prompt" in err and "use prompts of 65344 tokens or less" in err


@pytest.mark.engine
def test_a_cached_turn_prefills_only_past_the_history_the_cache_holds(tmp_path):
    """The tiny model on the CPU engine: the fresh prompt finds nothing cached, the turn after a primed history
    finds the history up to its last KDA checkpoint, and both decode."""
    pytest.importorskip("vllm")
    from ling_tools.tiny import ensure_tiny

    env = {**os.environ, "VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_CI_ENV": "1"}
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "ling_bench.fullsize", str(ensure_tiny()), "--mode", "eager",
                           "--prefill=", "--turn", "600+100", "--decode", "4", "--repeats", "1", "--util", "0.1",
                           "--chunk", "256", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"fullsize exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    r = json.loads(out.read_text())
    assert r["prefix_caching"] is True and [t["prompt"] for t in r["turns"]] == [700]
    turn = r["turns"][0]
    assert turn["fresh_cached_tokens"] == 0, turn  # fresh ids share nothing with earlier prompts
    assert 0 < turn["cached_tokens"] <= 600, turn  # the history, to its last checkpoint; never the new tokens
    assert turn["prefilled_tokens_cached"] == 700 - turn["cached_tokens"]
    assert turn["fresh_first_token_s"] > 0 and turn["cached_first_token_s"] > 0
    assert turn["fresh_decode_step_ms"] > 0 and turn["cached_decode_step_ms"] > 0
    assert "kernels" not in turn
