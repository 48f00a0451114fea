"""data=builtin / text / hf: corpus reading, tokenizer training and caching, held-out split."""

import json
import multiprocessing as mp

import numpy as np
import pytest
import torch

from optimus.config import ConfigError, DataConfig
from optimus.data import DataError, build_data, load_tokenizer, train_bpe
from optimus.data.sources import stdlib_docs

SEQ = 32


def _stream(ds) -> np.ndarray:
    """The token stream behind a TokenWindows dataset."""
    return ds.stream.read(0, len(ds.stream))


def _split_at_eos(tokens: np.ndarray, eos: int) -> list[tuple[int, ...]]:
    cuts = np.flatnonzero(tokens == eos)
    return [tuple(d) for d in np.split(tokens, cuts + 1)[:-1]]


def _direct_docs(tok, docs, eos):
    return [tuple(e.ids) + (eos,) for e in tok.encode_batch(docs, add_special_tokens=False)]


def _builtin_cfg(**kw) -> DataConfig:
    return DataConfig(name="builtin", max_chars=60_000, vocab_size=400, val_fraction=0.1, **kw)


def test_builtin_corpus_is_capped_and_ordered():
    docs = stdlib_docs(50_000)
    assert sum(map(len, docs)) == 50_000
    assert docs == stdlib_docs(50_000)
    assert stdlib_docs(100_000)[: len(docs) - 1] == docs[:-1]  # a bigger cap extends the same file order


def test_builtin_build_is_deterministic_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUS_CACHE", str(tmp_path / "a"))
    a = build_data(_builtin_cfg(), SEQ, seed=0)
    cached = build_data(_builtin_cfg(), SEQ, seed=1)
    monkeypatch.setenv("OPTIMUS_CACHE", str(tmp_path / "b"))
    fresh = build_data(_builtin_cfg(), SEQ, seed=0)  # tokenizer trained again from scratch
    for other in (cached, fresh):
        assert other.tokenizer_id == a.tokenizer_id
        assert np.array_equal(_stream(other.train), _stream(a.train))
        assert np.array_equal(_stream(other.val), _stream(a.val))
    assert a.vocab_size <= 400 and a.eos_id == 0 and len(a.val) > 0
    assert not list((tmp_path / "a").rglob("*.tmp"))


def test_builtin_tokens_are_the_documents_tokenised_and_split_by_document():
    cfg = _builtin_cfg()
    b = build_data(cfg, SEQ, seed=0)
    docs = stdlib_docs(cfg.max_chars)
    direct = _direct_docs(b.tokenizer, docs, b.eos_id)
    train, val = (_split_at_eos(_stream(d), b.eos_id) for d in (b.train, b.val))
    assert sorted(train + val) == sorted(direct)  # every document exactly once, whole
    assert set(train).isdisjoint(val)
    val_tokens = sum(map(len, val))
    assert val_tokens >= 0.1 * (val_tokens + sum(map(len, train)))
    assert train == [d for d in direct if d in set(train)]  # documents keep their corpus order
    assert b.tokenizer.decode(list(direct[0])[:-1]) == docs[0]


def test_several_processes_build_the_same_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OPTIMUS_CACHE", str(tmp_path))
    ctx = mp.get_context("fork")
    with ctx.Pool(3) as pool:
        ids = pool.starmap(_build_id, [(i,) for i in range(3)])
    assert len(set(ids)) == 1
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    assert len([p for p in (tmp_path / "tokens").iterdir() if p.is_dir()]) == 1
    assert not list(tmp_path.rglob("*.tmp"))


def _build_id(i):
    b = build_data(_builtin_cfg(), SEQ, seed=i)
    return b.tokenizer_id, _stream(b.train).tobytes()


@pytest.mark.slow
def test_default_builtin_uses_the_user_cache(monkeypatch):
    monkeypatch.delenv("OPTIMUS_CACHE")  # the real cache: built once per machine (~30 s), then < 2 s
    b = build_data(DataConfig(), 256, seed=0)
    assert b.vocab_size == 8192 and b.eos_id == 0
    assert len(b.train) > 10_000 and len(b.val) > 100
    assert b.train[0].shape == (257,) and b.train[0].dtype == torch.int64
    assert int(max(b.train[i].max() for i in range(100))) < b.vocab_size


@pytest.fixture
def text_dir(tmp_path):
    d = tmp_path / "texts"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40, encoding="utf-8")
    (d / "sub" / "b.txt").write_text("Grüße aus Köln. " * 60, encoding="utf-8")
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(30):
            f.write(json.dumps({"body": f"record {i}: " + "lorem ipsum dolor " * (i % 5 + 1)}) + "\n")
    (d / "ignored.bin").write_bytes(b"\xff\xfe")
    return d


def _text_docs(d):
    docs = [(d / "a.txt").read_text()]
    docs += [json.loads(line)["body"] for line in (d / "c.jsonl").read_text().splitlines()]
    return docs + [(d / "sub" / "b.txt").read_text()]  # sorted path order: a.txt, c.jsonl, sub/b.txt


def test_text_with_a_trained_tokenizer(text_dir):
    b = build_data(DataConfig(name="text", path=str(text_dir), text_field="body", vocab_size=300), 16, seed=0)
    direct = _direct_docs(b.tokenizer, _text_docs(text_dir), b.eos_id)
    got = _split_at_eos(_stream(b.train), b.eos_id) + _split_at_eos(_stream(b.val), b.eos_id)
    assert sorted(got) == sorted(direct)


def test_text_with_a_given_tokenizer_and_a_list_of_paths(text_dir, tmp_path):
    tok = train_bpe(["some other text to train on " * 50], 280)
    tok.save(str(tmp_path / "tok.json"))
    paths = [str(text_dir / "a.txt"), str(text_dir / "sub")]
    b = build_data(DataConfig(name="text", path=paths, tokenizer=str(tmp_path / "tok.json")), 16, seed=0)
    assert b.tokenizer_id == load_tokenizer(str(tmp_path / "tok.json")).id
    docs = [(text_dir / "a.txt").read_text(), (text_dir / "sub" / "b.txt").read_text()]
    direct = _direct_docs(tok, docs, b.eos_id)
    got = _split_at_eos(_stream(b.train), b.eos_id) + _split_at_eos(_stream(b.val), b.eos_id)
    assert sorted(got) == sorted(direct)


def test_single_text_file_holds_out_its_tail(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("the cat routes tokens. a dog eats fish. " * 200, encoding="utf-8")
    b = build_data(DataConfig(name="text", path=str(path), vocab_size=300, val_fraction=0.1), 16, seed=0)
    whole = np.concatenate([_stream(b.train), _stream(b.val)])
    assert np.array_equal(whole, np.array(_direct_docs(b.tokenizer, [path.read_text()], b.eos_id)[0]))
    assert len(b.val) >= 1 and len(_stream(b.val)) >= 0.1 * len(whole)


def test_hf_local_saved_dataset(tmp_path):
    import datasets

    texts = [f"example number {i} " * (i % 7 + 1) for i in range(60)] + [""]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": texts})}).save_to_disk(str(tmp_path / "ds"))
    cfg = DataConfig(name="hf", path=str(tmp_path / "ds"), text_field="content", vocab_size=300)
    b = build_data(cfg, 16, seed=0)
    direct = _direct_docs(b.tokenizer, [t for t in texts if t], b.eos_id)
    got = _split_at_eos(_stream(b.train), b.eos_id) + _split_at_eos(_stream(b.val), b.eos_id)
    assert sorted(got) == sorted(direct)
    with pytest.raises(DataError, match="no split 'test'"):
        build_data(DataConfig(name="hf", path=str(tmp_path / "ds"), hf_split="test"), 16, seed=0)
    with pytest.raises(DataError, match="no column 'text'"):
        build_data(DataConfig(name="hf", path=str(tmp_path / "ds")), 16, seed=0)


def test_text_input_errors(tmp_path, text_dir):
    with pytest.raises(DataError, match="data.path is empty"):
        build_data(DataConfig(name="text"), 16, seed=0)
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'} does not exist"):
        build_data(DataConfig(name="text", path=str(tmp_path / "nope")), 16, seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no .txt"):
        build_data(DataConfig(name="text", path=str(tmp_path / "empty")), 16, seed=0)
    (tmp_path / "blank.txt").write_text("")
    with pytest.raises(DataError, match="no non-empty documents"):
        build_data(DataConfig(name="text", path=str(tmp_path / "blank.txt")), 16, seed=0)
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt is not valid UTF-8"):
        build_data(DataConfig(name="text", path=str(tmp_path / "latin1.txt")), 16, seed=0)
    with pytest.raises(DataError, match=r"c.jsonl line 1 has no field 'text'"):
        build_data(DataConfig(name="text", path=str(text_dir)), 16, seed=0)
    with pytest.raises(DataError, match="too few for a training window"):
        build_data(DataConfig(name="text", path=str(text_dir / "a.txt"), vocab_size=300), 4096, seed=0)
    with pytest.raises(ConfigError, match="val_fraction"):
        build_data(DataConfig(name="text", path=str(text_dir), val_fraction=1.0), 16, seed=0)
    with pytest.raises(DataError, match="tokenizers JSON"):
        (tmp_path / "bad.json").write_text("{}")
        build_data(DataConfig(name="text", path=str(text_dir / "a.txt"), tokenizer=str(tmp_path / "bad.json")), 16, 0)
