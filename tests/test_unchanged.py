"""The `unchanged` harness itself: it must notice each kind of change a refused command could make."""

import os

import pytest

from tests.unchanged import unchanged


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "corpus.jsonl").write_text('{"text": "a"}\n')
    return tmp_path


@pytest.mark.parametrize(
    "change",
    [
        lambda t: (t / "out" / "model.safetensors").write_bytes(b"other"),
        lambda t: (t / "out" / "model.safetensors").unlink(),
        lambda t: (t / "out" / "partial.tmp").write_bytes(b""),
        lambda t: (t / "out" / "sub").mkdir(),
        lambda t: os.chmod(t / "corpus.jsonl", 0o600),
        lambda t: (t / "new_output").mkdir(),
    ],
    ids=["rewritten", "removed", "added-file", "added-dir", "mode", "new-sibling"],
)
def test_each_change_is_caught(tree, change):
    with pytest.raises(AssertionError, match="changed files it must leave alone"):
        with unchanged(tree):
            change(tree)


def test_a_refusal_that_writes_nothing_passes_and_its_error_propagates(tree):
    with pytest.raises(SystemExit):
        with unchanged(tree):
            (tree / "out" / "model.safetensors").read_bytes()
            raise SystemExit(2)
