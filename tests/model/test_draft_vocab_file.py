"""The draft vocabulary file (vllm_ling/draft/vocab_file.py): what the MTP draft accepts from VLLM_LING_DRAFT_VOCAB,
and every way a file is refused, each naming its rule and the way out."""

from __future__ import annotations

import json

import pytest

from vllm_ling.draft.vocab_file import ENV, FORMAT, load_ids

V = 300


def _file(tmp_path, doc) -> str:
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_a_valid_file_gives_its_ids_in_order(tmp_path):
    assert load_ids(_file(tmp_path, {"format": FORMAT, "token_ids": [7, 0, 299]}), V) == [7, 0, 299]


@pytest.mark.parametrize("doc, rule", [
    ({"token_ids": [1, 2]}, "not a draft vocabulary file"),
    ({"format": FORMAT, "token_ids": []}, "non-empty list of ints"),
    ({"format": FORMAT, "token_ids": [1, "2"]}, "non-empty list of ints"),
    ({"format": FORMAT, "token_ids": [1, True]}, "non-empty list of ints"),
    ({"format": FORMAT, "token_ids": [1, 300, -1]}, r"2 ids outside this model's vocabulary \[0, 300\)"),
    ({"format": FORMAT, "token_ids": [4, 5, 4]}, "repeat"),
    ([1, 2, 3], "not a draft vocabulary file"),
])
def test_a_bad_file_is_refused_naming_the_rule_and_the_way_out(tmp_path, doc, rule):
    with pytest.raises(ValueError, match=rule) as err:
        load_ids(_file(tmp_path, doc), V)
    assert "ling_tools.draft_vocab" in str(err.value) and ENV in str(err.value)


def test_a_missing_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read a draft vocabulary"):
        load_ids(tmp_path / "absent.json", V)
