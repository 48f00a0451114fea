"""Data commands refuse bad requests before writing and leave nothing half-written when they fail (issue 34):
a checkpoint names its data by content, so tokens re-made in place are refused and another spelling of the same
path is not; prepare and tokenizer validate first, write into temporaries and rename last, and a bad input or a
full disk ends in one sentence with the output as it was."""

from __future__ import annotations

import errno
import gzip
import json
import secrets
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from optimus.cli import main
from optimus.commands.data import main as data_main
from optimus.config import DataConfig
from optimus.data import DataError, build_data, open_tokens
from optimus.data.prepare import prepare  # the package attribute `prepare` may be the submodule
from optimus.data.tokenizer import load_tokenizer
from tests.conftest import SMALL_MODEL_RUN, write_corpus
from tests.unchanged import unchanged


def _prepare(inputs, out, tok_file, *extra) -> int:
    args = ["prepare", "--input", *map(str, inputs), "--output", str(out), "--tokenizer", str(tok_file)]
    return data_main([*args, "--no-progress", *extra])


def _tokenizer(inputs, out, *extra) -> int:
    return data_main(["tokenizer", "--input", *map(str, inputs), "--vocab-size", "300", "--output", str(out), *extra])


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err  # one line
    return err


# --- item 2: what identifies the data of a checkpoint ------------------------------------------------------


def test_resume_follows_the_tokens_not_their_path(corpus_file, tok_file, tmp_path, monkeypatch, capsys):
    """A resume reads the same tokens under an absolute spelling of the relative data.path it started with;
    after `data prepare --overwrite` re-made them in place from other text, the same command is refused."""
    monkeypatch.chdir(tmp_path)
    assert _prepare([corpus_file], "tokens", tok_file) == 0
    run_dir = tmp_path / "run"
    base = [*SMALL_MODEL_RUN, "train.micro_batch=4", "train.eval_sequences=8", "checkpoint.interval=2",
            "data=tokens", f"run.dir={run_dir}"]  # fmt: skip
    assert main(["train", *base, "data.path=tokens", "train.steps=2"]) == 0
    assert main(["train", *base, f"data.path={tmp_path / 'tokens'}", "train.steps=3"]) == 0
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").open()] == [0, 1, 2, 3]

    other = write_corpus(tmp_path / "other.jsonl", seed=1)
    assert _prepare([other], "tokens", tok_file, "--overwrite") == 0
    with unchanged(run_dir):
        assert main(["train", *base, "data.path=tokens", "train.steps=4"]) == 2
    error = error_of(capsys)
    assert "data.tokens changed from sha256:" in error and "train on the data it was saved with" in error


def test_the_identity_is_the_content(corpus_file, tok_file, tmp_path, monkeypatch):
    """data=text and data=tokens: the same content under another path (relative, absolute, a copy) has the
    same identity, and other content another; a mixture records its weights."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(corpus_file, tmp_path / "corpus.jsonl")
    tok = str(tok_file)

    def identity(**data):
        return build_data(DataConfig(tokenizer=tok, **data), 16, 0).identity

    text = identity(name="text", path="corpus.jsonl")
    assert identity(name="text", path=str(tmp_path / "corpus.jsonl")) == text
    assert identity(name="text", path=str(corpus_file)) == text
    assert (
        identity(name="text", path=str(write_corpus(tmp_path / "b.jsonl", seed=1)))["data.tokens"]
        != text["data.tokens"]
    )
    assert text["tokenizer"] == load_tokenizer(tok).id

    prepare([str(corpus_file)], tmp_path / "a", tok, progress=False)
    tokens = identity(name="tokens", path="a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    assert identity(name="tokens", path=str(tmp_path / "copy")) == tokens
    n_tokens = open_tokens(tmp_path / "a").meta["n_tokens"]
    assert tokens["data.tokens"].endswith(f" ({n_tokens} tokens)") and tokens["data.mix.weights"] is None
    other = write_corpus(tmp_path / "c.jsonl", seed=2)
    prepare([str(other)], tmp_path / "a", tok, progress=False, overwrite=True)  # re-made in place
    assert identity(name="tokens", path="a")["data.tokens"] != tokens["data.tokens"]
    mixed = identity(name="tokens", path=None, mix=[{"path": "a", "weight": 0.3}, {"path": "copy", "weight": 0.7}])
    assert mixed["data.mix.weights"] == [0.3, 0.7]


# --- items 3, 5, 10: validate first, write into temporaries, never half-written ---------------------------


@pytest.mark.parametrize("value", ["0", "-5"])
def test_prepare_refuses_a_non_positive_shard_size(corpus_file, tok_file, tmp_path, capsys, value):
    with unchanged(tmp_path):
        assert _prepare([corpus_file], tmp_path / "out", tok_file, "--shard-tokens", value) == 2
    assert f"--shard-tokens={value} must be a positive number of tokens per shard (at least 1)" in error_of(capsys)


def test_tokenizer_never_replaces_its_input_a_directory_or_an_existing_file(corpus_file, tmp_path, capsys):
    corpus = Path(shutil.copy(corpus_file, tmp_path / "corpus.jsonl"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "tok.json").write_text("mine\n")
    for out, extra, message in [
        (corpus, [], "is one of the --input files: choose another --output"),
        (corpus, ["--overwrite"], "is one of the --input files: choose another --output"),
        (tmp_path / "dir", [], "is a directory: give a file path for the tokenizer"),
        (tmp_path / "tok.json", [], "already exists: pass --overwrite to replace it"),
    ]:
        with unchanged(tmp_path):
            assert _tokenizer([tmp_path], out, *extra) == 2
        assert message in error_of(capsys)
    assert _tokenizer([corpus], tmp_path / "tok.json", "--overwrite") == 0
    assert load_tokenizer(str(tmp_path / "tok.json")).vocab_size == 300


def _gzipped(path: Path, corpus_file: Path, cut: int | None = None) -> Path:
    data = gzip.compress(corpus_file.read_bytes())
    path.write_bytes(data[:cut] if cut else data)
    return path


@pytest.mark.parametrize("kind", ["not gzip", "truncated"])
def test_an_unreadable_gzip_input_leaves_no_output(corpus_file, tok_file, tmp_path, capsys, kind):
    bad = tmp_path / "in" / "corpus.jsonl.gz"
    bad.parent.mkdir()
    if kind == "not gzip":
        shutil.copy(corpus_file, bad)
    else:
        _gzipped(bad, corpus_file, cut=len(gzip.compress(corpus_file.read_bytes())) * 2 // 3)
    with unchanged(tmp_path):  # a new output is not created ...
        assert _prepare([bad], tmp_path / "out", tok_file) == 2
    err = error_of(capsys)
    assert f"{bad} cannot be read" in err and "re-create it" in err
    assert _prepare([corpus_file], tmp_path / "old", tok_file) == 0
    with unchanged(tmp_path):  # ... and an output that --overwrite would replace keeps its earlier shards
        assert _prepare([bad], tmp_path / "old", tok_file, "--overwrite") == 2
    open_tokens(tmp_path / "old")


def test_a_gzip_input_that_reads_is_prepared(corpus_file, tok_file, tmp_path):
    good = _gzipped(tmp_path / "corpus.jsonl.gz", corpus_file)
    assert _prepare([good], tmp_path / "gz", tok_file) == 0
    assert _prepare([corpus_file], tmp_path / "plain", tok_file) == 0
    assert open_tokens(tmp_path / "gz").meta["shards"] == open_tokens(tmp_path / "plain").meta["shards"]


@pytest.mark.parametrize("key", ["dtype", "shards", "tokenizer"])
def test_a_token_directory_with_incomplete_metadata_is_one_sentence(corpus_file, tok_file, tmp_path, capsys, key):
    prepare([str(corpus_file)], tmp_path / "tokens", str(tok_file), progress=False)
    meta_path = tmp_path / "tokens" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta[key]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=f"has no valid '{key}.*re-run `optimus data prepare`"):
        open_tokens(tmp_path / "tokens")
    run = [*SMALL_MODEL_RUN, "data=tokens", f"data.path={tmp_path / 'tokens'}", f"run.dir={tmp_path / 'run'}"]
    assert main(["train", *run, "train.steps=1"]) == 2
    assert f"{meta_path} has no valid '{key}" in error_of(capsys)


class _FullDisk:
    """A binary file whose writes fail with ENOSPC once `room` bytes are written, as on a full file system."""

    def __init__(self, file, room: list[int]):
        self.file, self.room = file, room

    def write(self, data) -> int:
        self.room[0] -= len(data)
        if self.room[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def test_a_full_disk_during_prepare_leaves_the_output_as_it_was(corpus_file, tok_file, tmp_path, monkeypatch, capsys):
    """The shard being written (and its .tmp), the shards before it and the tokenizer all go; an output that
    --overwrite was replacing keeps its earlier shards."""
    import optimus.data.shards as shards

    assert _prepare([corpus_file], tmp_path / "old", tok_file) == 0
    other = write_corpus(tmp_path / "other.jsonl", seed=1)
    room = [0]
    monkeypatch.setattr(shards, "open", lambda *a, **k: _FullDisk(open(*a, **k), room), raising=False)
    for out, extra in [(tmp_path / "new", []), (tmp_path / "old", ["--overwrite"])]:
        room[0] = 20_000  # bytes: a few shards of 2,000 tokens, then the disk is full
        with unchanged(tmp_path):
            assert _prepare([other], out, tok_file, "--shard-tokens", "2000", *extra) == 2
        err = error_of(capsys)
        assert f"writing the token shards for {out} failed (No space left on device): free space" in err
    monkeypatch.undo()
    open_tokens(tmp_path / "old")


def test_a_full_disk_during_tokenizer_leaves_nothing(corpus_file, tmp_path, monkeypatch, capsys):
    """A new --output is not created, and an existing one that --overwrite was replacing stays as it was."""
    old = tmp_path / "old.json"
    old.write_text("the old tokenizer\n")

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    for out, extra in [(tmp_path / "new.json", []), (old, ["--overwrite"])]:
        with unchanged(tmp_path):
            assert _tokenizer([corpus_file], out, *extra) == 2
        assert f"writing {out} failed (No space left on device): free space on its file system" in error_of(capsys)


# --- no orphans: what a killed job left beside its output ---------------------------------------------------


def dead_pid() -> int:
    """The pid of a process that has ended (and been waited for)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    """The pid of a process that runs while the test does."""
    child = subprocess.Popen(["sleep", "300"])
    yield child.pid
    child.kill()
    child.wait()


def left_behind(out: Path, host: str, pid: int, kind: str = "tmp") -> Path:
    """A staging folder of `out` as a writer on `host` with `pid` names it, holding a file, as a kill leaves it."""
    folder = out.parent / f".{out.name}.{host}.{pid}.{secrets.token_hex(4)}.{kind}"
    folder.mkdir()
    (folder / "shard_00000.bin").write_bytes(b"\0" * 64)
    return folder


def test_prepare_removes_what_a_killed_prepare_on_this_host_left(corpus_file, tok_file, tmp_path, live_pid):
    """Only the staging folders of this output whose writer ran here and is gone: a live writer's and another
    host's (whose writer may still run) stay, as do other outputs' and the user's files."""
    out, host = tmp_path / "tokens", socket.gethostname()
    dead = left_behind(out, host, dead_pid())
    kept = [left_behind(out, host, live_pid), left_behind(out, "another-host", dead_pid()),
            left_behind(tmp_path / "other", host, dead_pid())]  # fmt: skip
    (tmp_path / f".tokens.{host}.notes").write_text("mine")
    assert _prepare([corpus_file], out, tok_file) == 0
    assert not dead.exists() and all(folder.is_dir() for folder in kept)
    expected = [f".tokens.{host}.notes", "tokens", *(folder.name for folder in kept)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
