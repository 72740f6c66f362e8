"""The draft-vocabulary tool (tools/draft_vocab.py) on the tiny checkpoint's real tokenizer: the ids it
picks are checked against an independent count of the same text, and every refused input exits 2 and
writes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from ling_tools import draft_vocab as tool

CORPUS = Path(tool.__file__).parent / "tiny" / "corpus.txt"
SIZE = 256


@pytest.fixture(scope="module")
def model(tiny_bf16):
    """(model dir, tokenizer, vocab_size, the specials in the order the file must list them)."""
    d = Path(tiny_bf16)
    config = json.loads((d / "config.json").read_text())
    added = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    cfg = [config[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id") if config.get(k) is not None]
    specials = list(dict.fromkeys(cfg + sorted(t["id"] for t in added if t["special"])))
    return d, Tokenizer.from_file(str(d / "tokenizer.json")), config["vocab_size"], specials


def _count(tok: Tokenizer, texts: list[str]) -> Counter:
    """The independent count: each text encoded whole, one at a time."""
    counts: Counter = Counter()
    for text in texts:
        counts.update(tok.encode(text, add_special_tokens=False).ids)
    return counts


def _problems(ids: list[int], counts: Counter, specials: list[int], size: int, vocab_size: int) -> list[str]:
    """Everything wrong with `ids` as the draft vocabulary of `counts` (empty when right)."""
    out = []
    if len(ids) != size or len(set(ids)) != len(ids):
        out.append(f"{len(ids)} ids, {len(set(ids))} unique, want {size} unique")
    if not all(0 <= i < vocab_size for i in ids):
        out.append("an id outside the vocabulary")
    if ids[:len(specials)] != specials:
        out.append(f"specials first: {ids[:len(specials)]} != {specials}")
    rest = ids[len(specials):]
    ranked = [i for i in rest if counts[i] > 0 and i not in specials]
    filler = rest[len(ranked):]
    if rest[:len(ranked)] != ranked:
        out.append("a seen id after an unseen one")
    keys = [(-counts[i], i) for i in ranked]
    if keys != sorted(keys):
        out.append("seen ids not in descending count, ties by smaller id")
    left = [(-counts[i], i) for i in counts if i not in ids and i < vocab_size]
    if keys and left and min(left) < keys[-1]:
        out.append(f"id {min(left)[1]} (count {-min(left)[0]}) left out for id {keys[-1][1]} "
                   f"(count {-keys[-1][0]})")
    unseen = [i for i in range(vocab_size) if counts[i] == 0 and i not in specials]
    if filler != unseen[:len(filler)]:
        out.append(f"filler {filler[:5]}... is not the smallest unseen ids {unseen[:5]}...")
    return out


def _coverage(counts: Counter, ids: list[int]) -> float:
    return sum(c for i, c in counts.items() if i in set(ids)) / sum(counts.values())


def _run(capsys, *args) -> tuple[int, str]:
    rc = tool.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def test_corpus_file_is_the_top_ids_of_an_independent_count(model, tmp_path, capsys):
    d, tok, vocab, specials = model
    out = tmp_path / "dv.json"
    rc, err = _run(capsys, d, "--text", CORPUS, "--size", SIZE, "--out", out)
    assert rc == 0, err
    data = json.loads(out.read_text())
    counts = _count(tok, [CORPUS.read_text(encoding="utf-8")])
    ids = data["token_ids"]
    assert specials[0] == 977 and specials == list(range(977, 990))  # the tiny tokenizer's eos, pad, then markup
    assert _problems(ids, counts, specials, SIZE, vocab) == []
    assert {k: data[k] for k in ("format", "version", "size", "vocab_size", "sources")} == {
        "format": "vllm-ling draft vocabulary", "version": 1, "size": SIZE, "vocab_size": vocab,
        "sources": ["corpus.txt"]}
    assert data["counted_tokens"] == sum(counts.values()) > 1000
    assert data["distinct_tokens_seen"] == len(counts)
    assert data["coverage"] == pytest.approx(_coverage(counts, ids), abs=1e-12)
    assert 0.5 < data["coverage"] < 1  # 256 of ~700 seen ids: most but not all tokens
    assert data["tokenizer_sha256"] == hashlib.sha256((d / "tokenizer.json").read_bytes()).hexdigest()
    assert f"counted {sum(counts.values()):,} tokens" in err and f"{data['coverage']:.2%} at {SIZE}" in err
    assert f"at {SIZE // 2}" in err and f"at {2 * SIZE}" in err and str(out) in err


def test_the_checks_fail_on_a_wrong_file(model, tmp_path, capsys):
    """Negative control: the same checks reject a list with two ranked ids swapped, one missing its top id,
    a wrong coverage and specials out of place."""
    d, tok, vocab, specials = model
    out = tmp_path / "dv.json"
    assert _run(capsys, d, "--text", CORPUS, "--size", SIZE, "--out", out)[0] == 0
    ids = json.loads(out.read_text())["token_ids"]
    counts = _count(tok, [CORPUS.read_text(encoding="utf-8")])
    n = len(specials)
    swapped = ids[:n] + [ids[n + 1], ids[n]] + ids[n + 2:]
    assert counts[ids[n]] != counts[ids[n + 1]] and _problems(swapped, counts, specials, SIZE, vocab)
    lost_top = ids[:n] + ids[n + 1:] + [1999]  # the most frequent id out, an unseen one in
    assert counts[1999] == 0
    assert _problems(lost_top, counts, specials, SIZE, vocab)
    assert _problems(ids[1:] + ids[:1], counts, specials, SIZE, vocab)
    assert _coverage(counts, lost_top) != pytest.approx(_coverage(counts, ids))
    other = _count(tok, ["def main():\n    return json.dumps({'a': 1})\n" * 50])  # another text's counts
    assert _problems(ids, other, specials, SIZE, vocab)


def test_fewer_seen_ids_than_size_fill_with_the_smallest_unseen(model, tmp_path, capsys):
    d, tok, vocab, specials = model
    text = "The cat sat on the mat. The dog sat too.\n"
    (tmp_path / "small.txt").write_text(text)
    out = tmp_path / "dv.json"
    rc, err = _run(capsys, d, "--text", tmp_path / "small.txt", "--size", 100, "--out", out)
    assert rc == 0, err
    data = json.loads(out.read_text())
    counts = _count(tok, [text])
    assert len(counts) < 100 - len(specials) and data["coverage"] == 1.0
    assert _problems(data["token_ids"], counts, specials, 100, vocab) == []
    assert "never seen" in err


def test_config_specials_come_first_eos_list_included(model, tmp_path, capsys):
    """config.json's eos (an int or a list), bos and pad come before the tokenizer's added specials."""
    d, tok, vocab, _ = model
    alt = tmp_path / "alt"
    alt.mkdir()
    shutil.copy(d / "tokenizer.json", alt / "tokenizer.json")
    config = json.loads((d / "config.json").read_text())
    (alt / "config.json").write_text(json.dumps({**config, "eos_token_id": [5, 977], "bos_token_id": 7}))
    out = tmp_path / "dv.json"
    rc, err = _run(capsys, alt, "--text", CORPUS, "--size", 100, "--out", out)
    assert rc == 0, err
    specials = [5, 977, 7, 978] + list(range(979, 990))
    counts = _count(tok, [CORPUS.read_text(encoding="utf-8")])
    assert _problems(json.loads(out.read_text())["token_ids"], counts, specials, 100, vocab) == []
    (alt / "config.json").write_text(json.dumps({**config, "eos_token_id": [5, 4096]}))
    rc, err = _run(capsys, alt, "--text", CORPUS, "--size", 100, "--out", tmp_path / "x.json")
    assert rc == 2 and "eos_token_id=[5, 4096] must be token ids in 0..2047" in err
    assert not (tmp_path / "x.json").exists()


def test_select_ids_by_hand():
    counts = Counter({5: 3, 2: 3, 9: 7, 4: 1, 7: 0})
    assert tool.select_ids(counts, [8, 9, 8], 5, 10) == [8, 9, 2, 5, 4]  # specials deduped, ties: smaller id
    assert tool.select_ids(counts, [8], 7, 10) == [8, 9, 2, 5, 4, 0, 1]  # then the smallest unseen
    assert tool.select_ids(Counter({12: 5, 1: 1}), [], 2, 10) == [1, 0]  # an id beyond the vocab is never picked


def test_jsonl_text_and_chat_messages(model, tmp_path, capsys):
    d, tok, vocab, specials = model
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    chat = [{"role": "system", "content": lines[0]},
            {"role": "user", "content": [{"type": "text", "text": lines[1]}, {"type": "image_url"}]},
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "assistant", "content": "<think>" + lines[2]}]  # a special token in the text counts too
    rows = [{"messages": lines[3], "id": 1}, {"messages": chat}, {"messages": lines[4]}]
    path = tmp_path / "traffic.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n")
    out = tmp_path / "dv.json"
    rc, err = _run(capsys, d, "--text", path, "--jsonl-field", "messages", "--size", 64, "--out", out)
    assert rc == 0, err
    data = json.loads(out.read_text())
    counts = _count(tok, [lines[3], lines[0], lines[1], "<think>" + lines[2], lines[4]])
    assert counts[tok.token_to_id("<think>")] == 1
    assert data["counted_tokens"] == sum(counts.values()) and data["distinct_tokens_seen"] == len(counts)
    assert data["coverage"] == pytest.approx(_coverage(counts, data["token_ids"]), abs=1e-12)
    assert _problems(data["token_ids"], counts, specials, 64, vocab) == []
    assert data["sources"] == ["traffic.jsonl"]


def _no_tokenizer(model, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(model[0] / "config.json", bare / "config.json")
    return bare


def _write(path: Path, body: str) -> Path:
    path.write_text(body)
    return path


BAD = {  # name: (MODEL_DIR, --text, extra args, out, what the message must say)
    "no tokenizer.json": (lambda m, t: (_no_tokenizer(m, t), CORPUS, [], t / "dv.json"),
                          ["no tokenizer.json", "bare", "checkpoint folder"]),
    "size 0": (lambda m, t: (m[0], CORPUS, ["--size", "0"], t / "dv.json"),
               ["--size 0 must be in 1..vocab_size (2048)", "leave --size out for 2048"]),
    "size > vocab": (lambda m, t: (m[0], CORPUS, ["--size", "2049"], t / "dv.json"),
                     ["--size 2049 must be in 1..vocab_size (2048)"]),
    "size < specials": (lambda m, t: (m[0], CORPUS, ["--size", "5"], t / "dv.json"),
                        ["smaller than the 13 special ids", "--size 13 or more"]),
    "empty text": (lambda m, t: (m[0], _write(t / "e.txt", ""), [], t / "dv.json"),
                   ["no tokens counted", "e.txt", "pass files with text"]),
    "missing text": (lambda m, t: (m[0], t / "nope.txt", [], t / "dv.json"), ["not a file", "nope.txt"]),
    "jsonl not JSON": (lambda m, t: (m[0], _write(t / "t.jsonl", '{"text": "ok"}\n{"text": oops}\n'),
                                     ["--jsonl-field", "text"], t / "dv.json"),
                       ["t.jsonl:2: not a JSON object", "fix or drop the line"]),
    "jsonl no field": (lambda m, t: (m[0], _write(t / "t.jsonl", '{"text": "ok"}\n\n{"body": "x"}\n'),
                                     ["--jsonl-field", "text"], t / "dv.json"),
                       ["t.jsonl:3: no field 'text'", "['body']"]),
    "jsonl no text": (lambda m, t: (m[0], _write(t / "t.jsonl", '{"text": ""}\n{"text": null}\n'),
                                    ["--jsonl-field", "text"], t / "dv.json"),
                      ["no tokens counted", "(field 'text')"]),
    "out dir missing": (lambda m, t: (m[0], CORPUS, [], t / "no" / "such" / "dv.json"),
                        ["does not exist", "mkdir -p"]),
    "out is a dir": (lambda m, t: (m[0], CORPUS, [], t), ["is a directory", "draft_vocab.json"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_names_the_rule_and_writes_nothing(case, model, tmp_path, capsys):
    make, says = BAD[case]
    model_dir, text, extra, out = make(model, tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    rc, err = _run(capsys, model_dir, "--text", text, *extra, "--out", out)
    assert rc == 2, err
    assert "error:" in err and "nothing written" in err
    for phrase in says:
        assert phrase in err, (phrase, err)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing new or changed


def test_an_existing_file_survives_a_failed_write(model, tmp_path, capsys, monkeypatch):
    """The atomic write: a write that dies half-way (here json.dump after its first bytes) or a failed rename
    leaves the old file as it was and no temp file behind."""
    d = model[0]
    out = tmp_path / "dv.json"
    out.write_text("old\n")

    def dies_half_way(obj, f, **kw):
        f.write('{"format": "vllm-ling draft voc')
        raise RuntimeError("disk gone")

    monkeypatch.setattr(tool.json, "dump", dies_half_way)
    with pytest.raises(RuntimeError, match="disk gone"):
        tool.main([str(d), "--text", str(CORPUS), "--size", "64", "--out", str(out)])
    monkeypatch.undo()
    assert out.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["dv.json"]

    def no_rename(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tool.os, "replace", no_rename)
    rc, err = _run(capsys, d, "--text", CORPUS, "--size", 64, "--out", out)
    assert rc == 2 and "cannot write --out" in err and "No space left" in err
    assert out.read_text() == "old\n" and sorted(os.listdir(tmp_path)) == ["dv.json"]


def test_large_file_pieces_count_as_the_whole(model, monkeypatch):
    """A plain-text file is encoded in pieces; cut after a line end that a word follows, the counts are those
    of the whole text (here with pieces of 50..5000 characters)."""
    tok = model[1]
    whole = _count(tok, [CORPUS.read_text(encoding="utf-8")])
    for piece in (50, 333, 5000):
        monkeypatch.setattr(tool, "PIECE_CHARS", piece)
        pieces = list(tool._plain_pieces(CORPUS))
        assert "".join(pieces) == CORPUS.read_text(encoding="utf-8") and max(map(len, pieces)) <= piece
        assert len(pieces) > 1 and tool.count_tokens(tok, pieces) == whole


def test_the_served_side_reads_the_file_back(model, tmp_path, capsys):
    """vllm_ling/draft/vocab_file.py's reader, the one the MTP draft uses, takes what the tool writes."""
    from vllm_ling.draft.vocab_file import load_ids

    d, _, vocab, _ = model
    out = tmp_path / "dv.json"
    assert _run(capsys, d, "--text", CORPUS, "--size", 300, "--out", out)[0] == 0
    assert load_ids(out, vocab) == json.loads(out.read_text())["token_ids"]
    with pytest.raises(ValueError):  # made for a bigger vocabulary than the model's
        load_ids(out, 900)


def test_the_module_runs_as_a_command(model, tmp_path):
    out = tmp_path / "dv.json"
    cmd = [sys.executable, "-m", "ling_tools.draft_vocab", str(model[0]), "--text", str(CORPUS), "--out"]
    done = subprocess.run(cmd + [str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "using 2,048" in done.stderr and json.loads(out.read_text())["size"] == 2048  # default, clamped
    done = subprocess.run(cmd + [str(tmp_path / "no" / "dv.json")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, ling_tools.draft_vocab; print(sorted(sys.modules))"],
        capture_output=True, text=True, timeout=60).stdout
