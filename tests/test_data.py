"""Corpora, tokenizers, Hugging Face loaders (on local copies in the hub's formats) and packing."""

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.data import (
    BPETokenizer,
    ByteTokenizer,
    PackedBatches,
    Tokenizer,
    count_tokens,
    doc_causal_mask,
    get_tokenizer,
    hf_corpus,
    load_corpus,
    local_corpus,
    pack_documents,
    positions_in_doc,
    sequential_batches,
    split_of,
    stdlib_files,
    tinystories,
    wikitext103,
    wikitext_articles,
)
from attnlab.data.cache import WriteError, atomic_write_text
from attnlab.data.corpus import stdlib_root

# ----------------------------------------------------------------------------- corpus


def test_split_rule_is_the_documented_hash():
    for rel in ["json/decoder.py", "os.py", "asyncio/tasks.py", "a/b/c.txt"]:
        bucket = int(hashlib.sha256(rel.encode()).hexdigest()[:16], 16) % 100
        assert split_of(rel) == ("test" if bucket < 2 else "val" if bucket < 4 else "train")
    counts = {s: 0 for s in ("train", "val", "test")}
    for i in range(20000):
        counts[split_of(f"pkg/module_{i}.py")] += 1
    assert 0.015 < counts["test"] / 20000 < 0.025 and 0.015 < counts["val"] / 20000 < 0.025


@pytest.mark.heavy
def test_stdlib_corpus_splits_are_disjoint_and_follow_the_rules():
    files = {s: stdlib_files(s) for s in ("train", "val", "test")}
    every = stdlib_files("all")
    assert sorted(files["train"] + files["val"] + files["test"]) == every
    assert len(every) > 300 and files["val"] and files["test"]
    for s, rels in files.items():
        assert all(split_of(r) == s for r in rels)
    for rel in every:
        parts = rel.split("/")
        assert rel.endswith(".py") and not parts[-1].startswith("_sysconfigdata_")
        assert not {"site-packages", "dist-packages", "test", "tests", "encodings"} & set(parts[:-1])
    assert "os.py" in every and "json/decoder.py" in every
    docs = load_corpus("stdlib", "val")
    assert len(docs) == len(files["val"]) and all(isinstance(d, str) and d for d in docs)
    assert docs[0] == (stdlib_root() / files["val"][0]).read_text(encoding="utf-8")


def test_local_folder_and_single_file(tmp_path):
    root = tmp_path / "texts"
    for i in range(300):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i}.txt").write_text(f"document {i}\n")
    (root / "skip.bin").write_bytes(b"\x00\x01")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.txt").write_text("hidden\n")
    got = {s: local_corpus(root, s) for s in ("train", "val", "test")}
    assert sum(len(v) for v in got.values()) == 300
    assert "hidden\n" not in sum(got.values(), [])
    want_val = sorted(f"document {i}\n" for i in range(300) if split_of(f"d{i % 3}/f{i}.txt") == "val")
    assert sorted(got["val"]) == want_val
    assert load_corpus(str(root), "test") == got["test"]

    single = tmp_path / "book.txt"
    text = "".join(f"line {i}\n" for i in range(1000))
    single.write_text(text)
    parts = [local_corpus(single, s)[0] for s in ("train", "val", "test")]
    assert "".join(parts) == text and all(p.endswith("\n") for p in parts)
    assert 0.95 < len(parts[0]) / len(text) < 0.97
    assert local_corpus(single, "all") == [text]


def test_corpus_errors_name_the_argument(tmp_path):
    with pytest.raises(ValueError, match="split"):
        load_corpus("stdlib", "validation")
    with pytest.raises(ValueError, match="source"):
        load_corpus("no-such-corpus")
    with pytest.raises(ValueError, match="max_docs"):
        load_corpus("stdlib", max_docs=0)
    few = tmp_path / "few"
    few.mkdir()
    (few / "a.txt").write_text("x")
    with pytest.raises(ValueError, match="empty"):
        local_corpus(few, "val" if split_of("a.txt") != "val" else "test")
    with pytest.raises(ValueError, match="no files"):
        local_corpus(few, "all", extensions=(".md",))


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip_and_ids():
    tok = get_tokenizer("byte")
    assert isinstance(tok, Tokenizer) and tok.vocab_size == 257 and tok.eos_id == 256
    text = "def f():\n    return 'é✓'\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids + [tok.eos_id]) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert np.array_equal(tok.encode_batch([text])[0], np.array(ids, dtype=np.uint8))
    with pytest.raises(ValueError, match="ids"):
        tok.decode([300])
    with pytest.raises(TypeError, match="text"):
        tok.encode(b"bytes")
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer("byte", vocab_size=512)
    with pytest.raises(ValueError, match="kind"):
        get_tokenizer("wordpiece")


def test_bpe_trains_caches_atomically_and_roundtrips(tmp_path):
    texts = [f"def function_{i}(value):\n    return value * {i} + len('text {i}')\n" for i in range(200)]
    tok = get_tokenizer("bpe", vocab_size=400, texts=texts, corpus="toy", cache_dir=tmp_path)
    assert isinstance(tok, BPETokenizer) and isinstance(tok, Tokenizer)
    assert tok.eos_id == 0 and 258 <= tok.vocab_size <= 400
    cached = list((tmp_path / "bpe").iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("toy-") and cached[0].name.endswith("-v400.json")
    assert not [p for p in (tmp_path / "bpe").iterdir() if p.name.endswith(".tmp")]
    sample = "def function_7(value):\n    return 'ünïcode' + value\n"
    ids = tok.encode(sample)
    assert tok.decode(ids) == sample and tok.eos_id not in ids
    assert len(tok.encode(texts[3])) < len(texts[3].encode()) / 2  # merges were learned
    again = get_tokenizer("bpe", vocab_size=400, texts=texts, corpus="toy", cache_dir=tmp_path)
    assert again.encode(sample) == ids and again.vocab_size == tok.vocab_size
    retrained = get_tokenizer("bpe", vocab_size=400, texts=texts, corpus="toy", cache_dir=tmp_path / "other")
    assert retrained.encode(sample) == ids  # training is deterministic
    assert [a.tolist() for a in tok.encode_batch(texts[:3])] == [tok.encode(t) for t in texts[:3]]
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer("bpe", texts=texts)
    with pytest.raises(ValueError, match="vocab_size"):
        get_tokenizer("bpe", vocab_size=100, texts=texts)


def test_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    atomic_write_text(path, "old")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(WriteError, match=r"could not write file '.*f\.json': disk full"):
        atomic_write_text(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.json"]


# ----------------------------------------------------------------------------- Hugging Face formats


def _write_parquet(path: Path, texts):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)


STORIES = [f"Once upon a time there was a cat number {i}. It was happy." for i in range(40)]


def test_tinystories_loader_on_a_local_copy_of_the_repo(tmp_path):
    repo = tmp_path / "TinyStories"
    _write_parquet(repo / "data" / "train-00000-of-00001.parquet", STORIES[:30])
    _write_parquet(repo / "data" / "validation-00000-of-00001.parquet", STORIES[30:])
    kw = dict(path=str(repo), cache_dir=tmp_path / "hf")
    assert tinystories("train", **kw) == STORIES[:30]
    val, test = tinystories("val", **kw), tinystories("test", **kw)
    assert sorted(val + test) == sorted(STORIES[30:]) and not set(val) & set(test)
    assert tinystories("train", max_docs=5, **kw) == STORIES[:5]  # streaming path


WIKI_ROWS = [
    "", " = Alpha = \n", "", " Alpha is a letter . \n", "", " = = History = = \n", "", " It is old . \n",
    "", " = Beta = \n", "", " Beta follows alpha . \n", "",
]


def test_wikitext_articles_grouping():
    arts = list(wikitext_articles(WIKI_ROWS))
    assert len(arts) == 2
    assert arts[0].startswith(" = Alpha = \n") and " = = History = = \n" in arts[0] and "Beta" not in arts[0]
    assert arts[1] == " = Beta = \n\n Beta follows alpha . \n"


def test_wikitext103_loader_on_a_local_copy_of_the_repo(tmp_path):
    repo = tmp_path / "wikitext"
    cfg = "wikitext-103-raw-v1"
    for split, rows in [("train", WIKI_ROWS), ("validation", WIKI_ROWS[9:]), ("test", WIKI_ROWS[:9])]:
        _write_parquet(repo / cfg / f"{split}-00000-of-00001.parquet", rows)
    card = ["---", "configs:", f"- config_name: {cfg}", "  data_files:"]
    for split in ("train", "validation", "test"):
        card += [f"  - split: {split}", f"    path: {cfg}/{split}-*"]
    (repo / "README.md").write_text("\n".join(card + ["---", ""]))
    kw = dict(path=str(repo), cache_dir=tmp_path / "hf")
    assert len(wikitext103("train", **kw)) == 2
    assert wikitext103("val", **kw) == [" = Beta = \n\n Beta follows alpha . \n"]
    assert wikitext103("test", **kw)[0].startswith(" = Alpha = ")
    assert wikitext103("train", max_docs=1, **kw) == wikitext103("test", **kw)


def test_generic_hf_source_and_json_builder(tmp_path):
    data = tmp_path / "js" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({"body": t}) + "\n" for t in STORIES[:7]))
    got = hf_corpus("json", split="train", text_field="body", data_files={"train": str(data)}, cache_dir=tmp_path / "hf")
    assert got == STORIES[:7]
    with pytest.raises(ValueError, match="text_field"):
        hf_corpus("json", split="train", data_files={"train": str(data)}, cache_dir=tmp_path / "hf")
    repo = tmp_path / "ds"
    _write_parquet(repo / "data" / "train-00000-of-00001.parquet", STORIES[:4])
    assert load_corpus(f"hf:{repo}", "train", cache_dir=tmp_path / "hf") == STORIES[:4]


# ----------------------------------------------------------------------------- packing


DOCS = ["ab", "cde", "", "fghij"]


def test_pack_layout_and_doc_ids():
    tok = ByteTokenizer()
    s = pack_documents(DOCS, tok)
    E = tok.eos_id
    want = [E, 97, 98, E, 99, 100, 101, E, E, 102, 103, 104, 105, 106, E]
    assert s.tokens.tolist() == want and len(s) == count_tokens(DOCS)
    assert s.doc_starts.tolist() == [0, 3, 7, 8, 14] and s.num_docs == 4
    assert s.doc_ids_at(torch.arange(len(s))).tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 4]
    assert count_tokens(DOCS, tok) == len(s)


def test_windows_cover_every_target_once_and_shift_by_one():
    s = pack_documents(DOCS * 5, ByteTokenizer())
    T = 4
    n = s.num_windows(T)
    batches = list(sequential_batches(s, T, 3))
    x = torch.cat([b.x for b in batches])
    y = torch.cat([b.y for b in batches])
    assert x.shape == (n, T) and n == (len(s) - 1) // T
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y.flatten(), s.tokens[1 : n * T + 1].long())
    assert len(list(sequential_batches(s, T, 3, max_batches=2))) == 2


def test_doc_causal_mask_and_positions_match_a_loop():
    doc_ids = torch.tensor([[3, 3, 4, 4, 4, 5], [0, 0, 0, 0, 1, 1]])
    m = doc_causal_mask(doc_ids)
    assert m.shape == (2, 1, 6, 6) and m.dtype == torch.bool
    for b in range(2):
        for i in range(6):
            for j in range(6):
                assert bool(m[b, 0, i, j]) == (j <= i and doc_ids[b, i] == doc_ids[b, j])
    assert positions_in_doc(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    s = pack_documents(DOCS * 3, ByteTokenizer())
    b = PackedBatches(s, 5, 2, cross_doc=False).batch(0)
    assert torch.equal(b.mask, doc_causal_mask(b.doc_ids))
    assert PackedBatches(s, 5, 2).batch(0).mask is None


def test_batches_are_deterministic_resumable_and_shard_like_one_process():
    s = pack_documents(load_corpus("stdlib", "test")[:3], ByteTokenizer())
    T, B = 32, 4
    a = PackedBatches(s, T, B, seed=7)
    run = [next(a).x for _ in range(6)]
    state = None
    b = PackedBatches(s, T, B, seed=7)
    for i in range(3):
        next(b)
    state = b.state_dict()
    c = PackedBatches(s, T, B, seed=7)
    c.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(next(c).x, run[i]) for i in range(3, 6))
    assert not torch.equal(PackedBatches(s, T, B, seed=8).batch(0).x, run[0])
    # two ranks with B/2 each read exactly the single-process batch of B
    ranks = [PackedBatches(s, T, B // 2, seed=7, rank=r, world_size=2) for r in range(2)]
    for step in range(6):
        assert torch.equal(torch.cat([r.batch(step).x for r in ranks]), run[step])
    with pytest.raises(ValueError, match="global_batch_size"):
        PackedBatches(s, T, 3, seed=7).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        PackedBatches(s, T, B, rank=2, world_size=2)


def test_every_window_once_per_epoch_across_the_epoch_boundary():
    s = pack_documents(DOCS * 7, ByteTokenizer())
    T, B = 3, 5
    it = PackedBatches(s, T, B, seed=1)
    n = it.num_windows
    idx = torch.cat([it.window_indices(st) for st in range(2 * n // B + 1)])
    assert sorted(idx[:n].tolist()) == list(range(n))
    assert sorted(idx[n : 2 * n].tolist()) == list(range(n))
    assert not torch.equal(idx[:n], idx[n : 2 * n])
    assert it.epoch(n) == pytest.approx(B)


def test_packing_errors():
    s = pack_documents(["abc"], ByteTokenizer())
    with pytest.raises(ValueError, match="too short"):
        PackedBatches(s, 64, 2)
    with pytest.raises(ValueError, match="seq_len"):
        PackedBatches(s, 0, 2)
    with pytest.raises(TypeError, match="docs"):
        pack_documents("abc", ByteTokenizer())
    with pytest.raises(ValueError, match="docs"):
        pack_documents([], ByteTokenizer())
    with pytest.raises(TypeError, match="stream"):
        PackedBatches([1, 2, 3], 2, 1)
