"""`optimus data prepare` / `tokenizer`, data=tokens, mixtures, and the checks on shards."""

import gzip
import hashlib
import json

import numpy as np
import pytest
import torch

from optimus.commands.data import main as cli_main
from optimus.config import ConfigError, DataConfig
from optimus.data import BatchLoader, DataError, build_data, open_tokens, train_bpe
from optimus.data.prepare import prepare  # the package attribute `prepare` may be the submodule
from optimus.data.shards import ShardWriter

SEQ = 16


def _docs(n, seed):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "эпсилон", "zeta", "\n", "  ", "42", "fox", "🙂"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 60)))) for _ in range(n)]


@pytest.fixture
def inputs(tmp_path):
    """The same kind of documents in every supported file type; returns (paths, documents in read order)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    d = tmp_path / "in"
    d.mkdir()
    docs = {name: _docs(40, i) for i, name in enumerate(["a", "b", "c", "d"])}
    with open(d / "a.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(docs["a"]))
    with gzip.open(d / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in docs["b"])
    raw = "".join(json.dumps({"text": t}) + "\n" for t in docs["c"]).encode()
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    pq.write_table(pa.table({"text": docs["d"]}), d / "d.parquet")
    (d / "e.txt").write_text("a plain text file\nwith two lines\n", encoding="utf-8")
    return d, docs["a"] + docs["b"] + docs["c"] + docs["d"] + [(d / "e.txt").read_text()]


def _direct(tok_file, docs):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_file))
    eos = tok.token_to_id("<|endoftext|>")
    return np.concatenate([np.array([*e.ids, eos]) for e in tok.encode_batch(docs, add_special_tokens=False)])


@pytest.mark.parametrize("num_proc", [1, 2])
def test_prepare_then_load_reproduces_direct_tokenisation(inputs, tok_file, tmp_path, num_proc):
    d, docs = inputs
    meta = prepare([str(d)], tmp_path / "out", str(tok_file), num_proc=num_proc, progress=False, shard_tokens=500)
    expected = _direct(tok_file, docs)
    src = open_tokens(tmp_path / "out")
    assert np.array_equal(src.stream.read(0, len(src.stream)), expected)
    assert len(meta["shards"]) > 2 and meta["n_docs"] == len(docs) and meta["n_tokens"] == len(expected)
    assert meta["dtype"] == "uint16"
    for shard in meta["shards"]:
        assert hashlib.sha256((tmp_path / "out" / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    ends = np.cumsum([len(e) + 1 for e in _direct_ids(tok_file, docs)])
    assert np.array_equal(src.doc_ends, ends)
    # data=tokens: train is the stream up to a document start, val the rest; windows are its strided slices.
    b = build_data(DataConfig(name="tokens", path=str(tmp_path / "out"), val_fraction=0.1), SEQ, seed=0)
    train, val = (ds.stream.read(0, len(ds.stream)) for ds in (b.train, b.val))
    assert np.array_equal(np.concatenate([train, val]), expected)
    assert len(train) in set(ends.tolist()) and len(val) >= 0.1 * len(expected)
    for i in (0, 5, len(b.train) - 1):
        assert b.train[i].tolist() == expected[i * SEQ : i * SEQ + SEQ + 1].tolist()
    assert b.vocab_size == meta["tokenizer"]["vocab_size"] and b.tokenizer_id == meta["tokenizer"]["id"]


def _direct_ids(tok_file, docs):
    from tokenizers import Tokenizer

    return [e.ids for e in Tokenizer.from_file(str(tok_file)).encode_batch(docs, add_special_tokens=False)]


def test_rerun_is_a_no_op_and_other_inputs_need_overwrite(inputs, tok_file, tmp_path):
    d, _ = inputs
    out = tmp_path / "out"
    prepare([str(d)], out, str(tok_file), progress=False)
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    prepare([str(d)], out, str(tok_file), progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps
    with pytest.raises(DataError, match="--overwrite"):
        prepare([str(d / "a.jsonl")], out, str(tok_file), progress=False)
    (out / "NOTES.txt").write_text("the user's own file")
    meta = prepare([str(d / "a.jsonl")], out, str(tok_file), progress=False, overwrite=True)
    assert meta["n_docs"] == 40
    # --overwrite replaces what prepare wrote, and only that.
    assert (out / "NOTES.txt").read_text() == "the user's own file"
    assert sorted(p.name for p in out.glob("shard_*.bin")) == sorted(sh["file"] for sh in meta["shards"])
    assert open_tokens(out).meta["n_tokens"] == meta["n_tokens"]  # every shard checks against the new metadata


def test_an_unfinished_directory_is_not_trusted(inputs, tok_file, tmp_path):
    d, docs = inputs
    out = tmp_path / "out"
    prepare([str(d)], out, str(tok_file), progress=False, shard_tokens=500)
    written = json.loads((out / "meta.json").read_text())["files"]
    (out / "meta.json").unlink()  # as if killed before the metadata was written: its journal lists its files
    (out / ".prepare-files.json").write_text(json.dumps(written))
    (out / ".shard_00009.bin.tmp").write_bytes(b"\x00" * 10)
    with pytest.raises(DataError, match="has no meta.json"):
        open_tokens(out)
    prepare([str(d)], out, str(tok_file), progress=False, shard_tokens=500)
    src = open_tokens(out)
    assert np.array_equal(src.stream.read(0, len(src.stream)), _direct(tok_file, docs))
    assert not list(out.glob(".*tmp"))


def _synthetic(path, lo, hi, n_tokens, seed, tok_id="sha256:synthetic", vocab=1000):
    """A token directory whose documents use ids in [lo, hi) only (so a window tells its source)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(path, vocab, eos_id=0, shard_tokens=n_tokens // 3)
    written = 0
    while written < n_tokens:
        docs = [rng.integers(lo, hi, size=int(rng.integers(5, 50))).tolist() for _ in range(20)]
        writer.add(docs)
        written += sum(len(x) + 1 for x in docs)
    writer.finish({"tokenizer": {"id": tok_id, "name": "synthetic", "vocab_size": vocab, "eos_id": 0}})
    return path


def test_mixture_proportions_determinism_and_layout_invariance(tmp_path):
    a = _synthetic(tmp_path / "a", 1, 500, 40_000, 0)
    b = _synthetic(tmp_path / "b", 500, 1000, 8_000, 1)  # small: drawn more often than it has windows
    cfg = DataConfig(name="tokens", mix=[{"path": str(a), "weight": 0.7}, {"path": str(b), "weight": 0.3}])
    bundle = build_data(cfg, SEQ, seed=0)
    loader = BatchLoader(bundle.train, 500, 50, 0, 1, seed=4)
    samples = torch.cat([torch.cat(loader.next_step()) for _ in range(20)])  # [10000, S + 1]
    loader.close()
    from_b = (samples >= 500).any(dim=1)  # source b uses ids 500..999 only
    assert abs(from_b.float().mean().item() - 0.3) < 0.02
    assert len(bundle.train.parts[1]) < 3000 < int(from_b.sum())  # the small source repeats
    again = BatchLoader(bundle.train, 500, 50, 0, 1, seed=4)
    assert torch.equal(torch.cat(again.next_step()), samples[:500])
    again.close()
    other = BatchLoader(bundle.train, 500, 50, 0, 1, seed=5)
    assert not torch.equal(torch.cat(other.next_step()), samples[:500])
    other.close()
    halves = [BatchLoader(bundle.train, 500, 50, r, 2, seed=4) for r in range(2)]
    assert torch.equal(torch.cat([torch.cat(h.next_step()) for h in halves]), samples[:500])
    for h in halves:
        h.close()
    assert len(bundle.val) > 0 and bundle.val.parts[1][0].min() >= 0


def _bad(tmp_path, tok_file):
    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in _docs(30, 0)), encoding="utf-8")
    out = tmp_path / "tok"
    prepare([str(src)], out, str(tok_file), progress=False, shard_tokens=200)
    return out, json.loads((out / "meta.json").read_text())


def test_corrupt_shards_are_refused(tmp_path, tok_file):
    out, meta = _bad(tmp_path, tok_file)
    shard = out / meta["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[4] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=f"{shard} does not match the checksum"):
        open_tokens(out)
    shard.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match=f"shard {shard} has .* truncated"):
        open_tokens(out)
    ids = np.frombuffer(bytes(data), dtype=np.uint16).copy()
    ids[3] = 40_000  # an id the tokenizer cannot produce, with a matching checksum
    shard.write_bytes(ids.tobytes())
    meta["shards"][1]["sha256"] = hashlib.sha256(ids.tobytes()).hexdigest()
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"{shard} holds token id 40000 >= the vocabulary size"):
        open_tokens(out)
    (out / meta["shards"][0]["file"]).unlink()
    with pytest.raises(DataError, match="is missing"):
        open_tokens(out)
    for broken, problem in (('{"format": ', "is not valid JSON"), ("[1, 2]", "has format 'list'")):
        (out / "meta.json").write_text(broken)
        with pytest.raises(DataError, match=problem):
            open_tokens(out)


def test_tokens_config_errors(tmp_path, tok_file):
    out, _ = _bad(tmp_path, tok_file)
    other = tmp_path / "other.json"
    train_bpe(["completely different text " * 30], 300).save(str(other))
    with pytest.raises(DataError, match=f"the shards in {out} were made with tokenizer .* data.tokenizer=null"):
        build_data(DataConfig(name="tokens", path=str(out), tokenizer=str(other)), SEQ, seed=0)
    ok = build_data(DataConfig(name="tokens", path=str(out), tokenizer=str(tok_file)), SEQ, seed=0)
    assert len(ok.train) > 0
    with pytest.raises(DataError, match="does not exist"):
        build_data(DataConfig(name="tokens", path=str(tmp_path / "missing")), SEQ, seed=0)
    with pytest.raises(ConfigError, match="data.path is empty"):
        build_data(DataConfig(name="tokens"), SEQ, seed=0)
    with pytest.raises(ConfigError, match="both set"):
        build_data(DataConfig(name="tokens", path=str(out), mix=[{"path": str(out)}]), SEQ, seed=0)
    with pytest.raises(ConfigError, match=r"data.mix\[0\].weight"):
        build_data(DataConfig(name="tokens", mix=[{"path": str(out), "weight": 0}]), SEQ, seed=0)
    with pytest.raises(ConfigError, match=r"data.mix\[0\].weight='half' is not a number"):
        build_data(DataConfig(name="tokens", mix=[{"path": str(out), "weight": "half"}]), SEQ, seed=0)
    syn = _synthetic(tmp_path / "syn", 1, 100, 5000, 0)
    with pytest.raises(DataError, match="different tokenizers"):
        build_data(DataConfig(name="tokens", mix=[{"path": str(out)}, {"path": str(syn)}]), SEQ, seed=0)
    with pytest.raises(DataError, match="too few for a training window"):
        build_data(DataConfig(name="tokens", path=str(out)), 100_000, seed=0)


def test_prepare_input_errors(tmp_path, tok_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=f"{bad} line 2 has no field 'text'"):
        prepare([str(bad)], tmp_path / "o1", str(tok_file), progress=False)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "ok"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=f"{latin} line 2 is not valid UTF-8"):
        prepare([str(latin)], tmp_path / "o2", str(tok_file), num_proc=2, progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="has no non-empty documents"):
        prepare([str(empty)], tmp_path / "o3", str(tok_file), progress=False)
    with pytest.raises(DataError, match="does not exist"):
        prepare([str(tmp_path / "absent.jsonl")], tmp_path / "o4", str(tok_file), progress=False)
    for o in ("o1", "o2", "o3"):
        assert not (tmp_path / o / "meta.json").exists()


def test_cli_tokenizer_and_prepare(inputs, tmp_path, capsys):
    d, docs = inputs
    tok = tmp_path / "cli-tok.json"
    assert cli_main(["tokenizer", "--input", str(d), "--vocab-size", "300", "--output", str(tok)]) == 0
    assert tok.is_file() and "vocab" in capsys.readouterr().out
    out = tmp_path / "cli-out"
    args = ["prepare", "--input", str(d), "--output", str(out), "--tokenizer", str(tok), "--num-proc", "2"]
    assert cli_main([*args, "--no-progress"]) == 0
    src = open_tokens(out)
    assert np.array_equal(src.stream.read(0, len(src.stream)), _direct(tok, docs))
    assert cli_main(["prepare", "--input", str(tmp_path / "nope"), "--output", str(out), "--tokenizer", str(tok)]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli_main(["prepare", "--help"])
    assert e.value.code == 0 and "--num-proc" in capsys.readouterr().out
