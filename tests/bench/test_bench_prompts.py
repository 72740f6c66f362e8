from __future__ import annotations

import pytest
from bench_fake_server import fake_count

from ling_bench.prompts import build_prompts, code_prompts, estimate_tokens, long_prompt, prose_prompts

LINE_TOKENS = 40  # a log line is at most ~20 words + "Entry NNNNNN:" + punctuation


@pytest.mark.parametrize("make", [code_prompts, prose_prompts])
def test_short_set_is_identical_for_the_same_seed(make):
    assert make(3, 4) == make(3, 4)


@pytest.mark.parametrize("make", [code_prompts, prose_prompts])
def test_short_set_differs_across_seeds(make):
    assert make(0, 4) != make(1, 4)


@pytest.mark.parametrize("make", [code_prompts, prose_prompts])
def test_short_set_prompts_are_distinct(make):
    prompts = make(0, 8)
    assert len(set(prompts)) == 8


@pytest.mark.parametrize("target", [300, 1000, 4096, 20000])
def test_long_prompt_lands_within_one_line_under_target_with_server_tokenizer(target):
    text, n = long_prompt(0, target, fake_count)
    assert n == fake_count(text)
    assert target - LINE_TOKENS < n <= target


@pytest.mark.parametrize("target", [300, 4096, 65536])
def test_long_prompt_lands_under_target_with_char_estimate(target):
    text, n = long_prompt(0, target, estimate_tokens)
    assert n == -(-len(text) // 4)
    assert target - LINE_TOKENS < n <= target


def test_long_prompt_grows_its_line_pool_for_a_sparse_tokenizer():
    def sparse(text: str) -> int:  # 20 chars/token: the first pool is far too short
        return len(text) // 20

    text, n = long_prompt(0, 2000, sparse)
    assert 2000 - LINE_TOKENS < n <= 2000 and n == sparse(text)


def test_long_prompt_is_deterministic_by_seed_and_differs_across_seeds():
    assert long_prompt(5, 2048, fake_count) == long_prompt(5, 2048, fake_count)
    assert long_prompt(5, 2048, fake_count)[0] != long_prompt(6, 2048, fake_count)[0]


def test_long_prompt_shorter_than_its_question_is_rejected():
    with pytest.raises(ValueError, match="at least 256"):
        long_prompt(0, 10, fake_count)


def test_build_prompts_orders_cases_and_records_counted_tokens():
    prompts = build_prompts(["code", "prose", "long"], 0, 2, [512, 1024], fake_count)
    assert [p.name for p in prompts] == ["code-0", "code-1", "prose-0", "prose-1", "long-512", "long-1024"]
    assert all(p.tokens == fake_count(p.text) for p in prompts)
    assert [p.target_tokens for p in prompts[-2:]] == [512, 1024]


def test_build_prompts_rejects_an_unknown_set_naming_the_choices():
    with pytest.raises(ValueError, match="'poetry'.*code, prose, long"):
        build_prompts(["poetry"], 0, 1, [], fake_count)


def test_build_prompts_rejects_more_prompts_than_a_set_holds():
    with pytest.raises(ValueError, match="--num-prompts 99"):
        build_prompts(["code"], 0, 99, [], fake_count)
