"""The data pipeline never deletes or trusts what it did not write (issue 17): prepare touches only its own
files, the shard check notices a same-size rewrite, mistyped paths fail at once, and user errors are one
sentence (exit code 2)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from optimus.cli import main
from optimus.commands.data import main as data_main
from optimus.config import DataConfig
from optimus.data import DataError, build_data, open_tokens
from optimus.data.prepare import prepare  # the package attribute `prepare` may be the submodule
from optimus.data.sources import load_hf
from optimus.data.tokenizer import load_tokenizer
from tests.conftest import TINY_MODEL


def _prepare(inputs, out, tok_file, *extra) -> int:
    args = ["prepare", "--input", *map(str, inputs), "--output", str(out), "--tokenizer", str(tok_file)]
    return data_main([*args, "--no-progress", *extra])


def _listing(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_prepare_refuses_to_replace_files_it_did_not_write(corpus_file, tok_file, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_00000.bin").write_bytes(b"the user's own data")
    (out / "tokenizer.json").write_text('{"mine": true}')
    before = _listing(out)
    assert _prepare([corpus_file], out, tok_file) == 2
    assert "shard_00000.bin, which no earlier `optimus data prepare`" in capsys.readouterr().err
    assert _listing(out) == before
    assert _prepare([corpus_file], out, tok_file, "--overwrite") == 2  # --overwrite replaces only its own
    assert _listing(out) == before


def test_overwrite_removes_only_what_prepare_listed(corpus_file, tok_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "shard_extra").mkdir()  # a folder with a shard-like name is not prepare's either
    (out / "shard_extra" / "x.bin").write_bytes(b"keep")
    assert _prepare([corpus_file], out, tok_file, "--shard-tokens", "2000") == 0
    first = json.loads((out / "meta.json").read_text())
    assert len(first["shards"]) > 2 and "tokenizer.json" in first["files"]
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i} the cat"}) + "\n" for i in range(5)))
    assert _prepare([small], out, tok_file, "--overwrite") == 0
    second = json.loads((out / "meta.json").read_text())
    assert len(second["shards"]) == 1
    shards = sorted(p.name for p in out.glob("shard_*.bin"))
    assert shards == ["shard_00000.bin"]  # the first job's other shards are gone ...
    assert (out / "notes.txt").read_text() == "keep me" and (out / "shard_extra" / "x.bin").read_bytes() == b"keep"
    assert open_tokens(out).meta["n_docs"] == 5


def test_an_identical_tokenizer_already_in_the_output_stays_the_users(corpus_file, tok_file, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_bytes(tok_file.read_bytes())
    assert _prepare([corpus_file], out, tok_file) == 0
    assert "tokenizer.json" not in json.loads((out / "meta.json").read_text())["files"]


def test_an_interrupted_prepare_is_cleaned_up_by_the_next(corpus_file, tok_file, tmp_path):
    out = tmp_path / "out"
    assert _prepare([corpus_file], out, tok_file) == 0
    (out / "meta.json").unlink()  # as if killed before the metadata: the journal is what it left
    (out / ".prepare-files.json").write_text(json.dumps(["tokenizer.json", "shard_00000.bin", "shard_00000.ends.npy"]))
    assert _prepare([corpus_file], out, tok_file) == 0
    assert not (out / ".prepare-files.json").exists()
    open_tokens(out)


def test_a_same_size_rewrite_with_the_old_mtime_is_caught(corpus_file, tok_file, tmp_path):
    out = tmp_path / "out"
    prepare([str(corpus_file)], out, str(tok_file), progress=False)
    open_tokens(out)  # verified once, and remembered
    shard = out / "shard_00000.bin"
    st = shard.stat()
    data = np.fromfile(shard, dtype=np.uint16)
    data[len(data) // 2] = (data[len(data) // 2] + 1) % 300  # another valid token id
    time.sleep(0.01)  # a distinct ctime, on file systems with coarse clocks
    data.tofile(shard)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    with pytest.raises(DataError, match="does not match the checksum"):
        open_tokens(out)


def test_a_single_document_token_directory_trains(tok_file, tmp_path):
    text = tmp_path / "book.txt"
    text.write_text("the cat sorts tokens and the dog reads shards. " * 200)
    out = tmp_path / "out"
    prepare([str(text)], out, str(tok_file), progress=False)
    assert open_tokens(out).meta["n_docs"] == 1
    bundle = build_data(DataConfig(name="tokens", path=str(out), val_fraction=0.1), 16, 0)
    assert len(bundle.train) > 0 and len(bundle.val) > 0
    total = open_tokens(out).meta["n_tokens"]
    with pytest.raises(DataError, match=f"holds {total} tokens, too few"):
        build_data(DataConfig(name="tokens", path=str(out), val_fraction=0.1), total, 0)


@pytest.mark.parametrize("spec", ["./missing/tok.json", "~/missing-optimus/tok.json", "a/b/c", "tok.json"])
def test_a_mistyped_tokenizer_path_fails_at_once(spec, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="does not exist: check the path"):
        load_tokenizer(spec)


def test_a_missing_path_under_an_existing_folder_is_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError, match="does not exist"):
        load_hf("data/corpus", "train", None)  # "org/name" in shape, but ./data exists: a mistyped path
    with pytest.raises(DataError, match="does not exist"):
        load_hf("./corpus", "train", None)


def test_a_cache_that_cannot_be_written_is_one_sentence(corpus_file, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("OPTIMUS_CACHE", str(blocker / "cache"))
    run_dir = tmp_path / "run"
    args = [*TINY_MODEL, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "train.steps=1"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "set OPTIMUS_CACHE to a directory you may write to" in err and "Traceback" not in err
    assert not run_dir.exists()  # the failed start left no empty run directory
