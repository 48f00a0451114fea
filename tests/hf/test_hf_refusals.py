"""`optimus checkpoint import|export` on broken inputs and outputs that exist: one sentence, nothing written;
--overwrite replaces an earlier output whole; every file written gets the umask's mode.

The Hugging Face directories are small random transformers models saved here; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import stat

import pytest
import yaml
from safetensors.torch import load_file

from optimus.cli import main
from tests.data.test_data_refusals import dead_pid, left_behind, live_pid  # noqa: F401 (live_pid: a fixture)
from tests.hf.test_hf import CASES, random_hf_model
from tests.unchanged import unchanged

transformers = pytest.importorskip("transformers")

DCP_FILES = (".metadata", "__0_0.distcp")  # what dcp.save writes for one process: the integrity record covers them


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A HF directory in one file, the same model sharded with an index, and its Optimus import (read-only)."""
    root = tmp_path_factory.mktemp("sources")
    fmt, shape = CASES["olmoe-mha-top1"]
    model = random_hf_model(fmt, **shape)
    model.save_pretrained(root / "hf")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    assert main(["checkpoint", "import", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root


def refused(argv: list[str], capsys, *untouched) -> str:
    """The one-line error of `optimus ARGV`, which must exit 2 and leave the paths `untouched` as they were."""
    capsys.readouterr()
    with unchanged(*untouched):
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.endswith("."), err
    return err


def copy(source, tmp_path):
    return shutil.copytree(source, tmp_path / source.name)


def _edit_config(**changes):
    def edit(hf_dir):
        config = json.loads((hf_dir / "config.json").read_text())
        config.update(changes)
        (hf_dir / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "<drop>"}))

    return edit


def _truncate(hf_dir):
    file = hf_dir / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _garble_header(hf_dir):
    file = hf_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header right after its length
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "source, damage, words",
    [
        ("hf", _truncate, "model.safetensors is not a readable safetensors file"),
        ("hf", _garble_header, "model.safetensors is not a readable safetensors file"),
        ("hf", _edit_config(num_experts="8"), 'num_experts = "8", which is not an integer'),
        ("hf", _edit_config(num_experts="<drop>"), "lacks 'num_experts'"),
        ("hf", _edit_config(hidden_size=32.0), "hidden_size = 32.0, which is not an integer"),
        ("hf", _edit_config(tie_word_embeddings="false"), "which is not true or false"),
        ("hf", _edit_config(rms_norm_eps="1e-5"), "which is not a number"),
        ("sharded", lambda d: (d / "model.safetensors.index.json").write_text("{broken"), "is not a valid index"),
        ("sharded", lambda d: (d / "model.safetensors.index.json").write_text("{}"), "is not a valid index"),
    ],
    ids=[
        "truncated",
        "garbled",
        "string-count",
        "missing-count",
        "float-size",
        "string-flag",
        "string-number",
        "index-not-json",
        "index-without-map",
    ],  # fmt: skip
)
def test_import_of_a_broken_directory_is_one_sentence(sources, tmp_path, capsys, source, damage, words):
    hf_dir = copy(sources / source, tmp_path)
    damage(hf_dir)
    out = tmp_path / "ckpt"
    err = refused(["checkpoint", "import", str(hf_dir), "--out", str(out)], capsys, tmp_path)
    assert words in err


def test_import_refuses_an_existing_out_and_overwrite_replaces_an_import(sources, tmp_path, capsys):
    hf_dir = sources / "hf"
    (tmp_path / "afile").write_text("mine")
    err = refused(["checkpoint", "import", str(hf_dir), "--out", str(tmp_path / "afile")], capsys, tmp_path, hf_dir)
    assert "is a file" in err
    ckpt = copy(sources / "ckpt", tmp_path)
    (ckpt / "note.txt").write_text("left by an earlier import")
    err = refused(["checkpoint", "import", str(hf_dir), "--out", str(ckpt)], capsys, tmp_path, hf_dir)
    assert "pass --overwrite" in err
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.bin").write_bytes(b"not a checkpoint")
    argv = ["checkpoint", "import", str(hf_dir), "--out", str(other), "--overwrite"]
    assert "holds no meta.json" in refused(argv, capsys, tmp_path, hf_dir)

    # the user's note is not the import's to delete: --overwrite names it and writes nothing
    argv = ["checkpoint", "import", str(hf_dir), "--out", str(ckpt), "--overwrite"]
    assert "(note.txt), which --overwrite would delete" in refused(argv, capsys, tmp_path, hf_dir)
    (ckpt / "note.txt").unlink()
    (ckpt / "model" / "stale.yaml").write_text("an earlier import's recipe\n")

    assert main(["checkpoint", "import", str(hf_dir), "--out", str(ckpt), "--overwrite"]) == 0
    assert not (ckpt / "model" / "stale.yaml").exists()  # replaced whole, not merged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "ckpt", "other"]  # no temporary left
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["files"] == {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in DCP_FILES}


def _bad_tokenizer(tmp_path, sources):
    (tmp_path / "bad.json").write_text("{not json")
    return ["--out", str(tmp_path / "new"), "--tokenizer", str(tmp_path / "bad.json")]


@pytest.mark.parametrize(
    "arguments, words",
    [
        (lambda t, sources: ["--out", str(copy(sources / "hf", t))], "pass --overwrite"),
        (lambda t, _: ["--out", str(t / "new"), "--tokenizer", str(t / "absent.json")], "does not exist"),
        (_bad_tokenizer, "not valid JSON"),
        (lambda t, _: ["--out", str(t / "afile")], "is a file"),
        (lambda t, _: ["--out", str(t / "afile" / "hf")], "cannot be written"),
    ],
    ids=["existing-model", "missing-tokenizer", "garbled-tokenizer", "out-is-a-file", "parent-is-a-file"],
)
def test_hf_export_refusals_write_nothing(sources, tmp_path, capsys, arguments, words):
    (tmp_path / "afile").write_text("mine")
    argv = ["checkpoint", "export", str(sources / "ckpt"), "--format", "hf", *arguments(tmp_path, sources)]
    assert words in refused(argv, capsys, tmp_path, sources / "ckpt")


def test_hf_export_files_follow_the_umask(sources, tmp_path):
    old = os.umask(0o022)
    try:
        assert (
            main(["checkpoint", "export", str(sources / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
        )
    finally:
        os.umask(old)
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in (tmp_path / "hf").iterdir()} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
    }
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == 0o755


def test_hf_export_overwrite_replaces_the_model_whole_with_the_umask_modes(sources, tmp_path, capsys):
    existing = copy(sources / "hf", tmp_path)
    (existing / "stale-extra.safetensors").write_bytes(b"")
    tokenizer = tmp_path / "tok.json"
    tokenizer.write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"a": 0}}}))
    argv = ["checkpoint", "export", str(sources / "ckpt"), "--format", "hf", "--out", str(existing)]
    # transformers' save_pretrained wrote a file the export does not: named, not deleted
    assert (existing / "generation_config.json").is_file()
    err = refused([*argv, "--overwrite", "--tokenizer", str(tokenizer)], capsys, tmp_path)
    assert "(generation_config.json), which --overwrite would delete" in err
    (existing / "generation_config.json").unlink()
    old = os.umask(0o022)
    try:
        assert main([*argv, "--overwrite", "--tokenizer", str(tokenizer)]) == 0
    finally:
        os.umask(old)
    names = sorted(p.name for p in existing.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tok.json"]  # no temporary or old copy left
    for file in existing.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o644, file.name
    assert stat.S_IMODE(existing.stat().st_mode) == 0o755
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(existing)
    original = transformers.AutoModelForCausalLM.from_pretrained(sources / "hf")
    for key, value in original.state_dict().items():
        assert reloaded.state_dict()[key].equal(value), key


def test_safetensors_export_refuses_to_replace_an_earlier_export(sources, tmp_path, capsys):
    ckpt = sources / "ckpt"
    out = tmp_path / "model.safetensors"
    (tmp_path / "model.yaml").write_text("someone else's config\n")
    err = refused(["checkpoint", "export", str(ckpt), "--out", str(out)], capsys, tmp_path, ckpt)
    assert "model.yaml already exists" in err and "--overwrite" in err
    (tmp_path / "model.yaml").unlink()
    out.write_bytes(b"an earlier export")
    assert "model.safetensors already exists" in refused(
        ["checkpoint", "export", str(ckpt), "--out", str(out)], capsys, tmp_path, ckpt
    )
    assert main(["checkpoint", "export", str(ckpt), "--out", str(out), "--overwrite"]) == 0
    assert "layers.0.ffn.experts.w13" in load_file(str(out))
    assert (tmp_path / "model.yaml").read_text() == (ckpt / "config.yaml").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "model.yaml"]


# --- the model of an export is the one the checksummed record names (R6) ----------------------------------


def _garble_config(ckpt):
    (ckpt / "config.yaml").write_text("model: {dim: [64,\n")


def _edit_config(ckpt):
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"]["rope_theta"] *= 2  # not a shape: the weights still fit, only config.json would be wrong
    (ckpt / "config.yaml").write_text(yaml.safe_dump(config))


def _garble_config_and_drop_checksums(ckpt):
    _garble_config(ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]
    (ckpt / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
@pytest.mark.parametrize(
    "damage, words",
    [
        (_garble_config, "config.yaml is not readable YAML"),
        (_edit_config, "config.yaml says model.rope_theta="),
        (_garble_config_and_drop_checksums, 'has no "files" checksums'),  # the integrity check comes first
    ],
    ids=["garbled", "edited", "untrusted"],
)
def test_export_refuses_a_config_yaml_that_is_not_the_saved_model(sources, tmp_path, capsys, fmt, damage, words):
    ckpt = copy(sources / "ckpt", tmp_path)
    damage(ckpt)
    out = tmp_path / ("hf" if fmt == "hf" else "model.safetensors")
    err = refused(["checkpoint", "export", str(ckpt), "--format", fmt, "--out", str(out)], capsys, tmp_path)
    assert words in err


# --- --overwrite through a symlink (R7) and what a killed export left (R5) --------------------------------


def test_hf_export_overwrite_through_a_symlink_replaces_the_directory_it_points_to(sources, tmp_path):
    real, link = tmp_path / "exports" / "hf", tmp_path / "links" / "hf"
    export = ["checkpoint", "export", str(sources / "ckpt"), "--format", "hf"]
    assert main([*export, "--out", str(real)]) == 0
    link.parent.mkdir()
    link.symlink_to(real)
    assert main([*export, "--out", str(link), "--overwrite", "--dtype", "bf16"]) == 0
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert sorted(p.name for p in real.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((real / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in real.parent.iterdir()] == ["hf"] and [p.name for p in link.parent.iterdir()] == ["hf"]


def test_hf_export_clears_what_a_killed_export_on_this_host_left(sources, tmp_path, capsys, live_pid):  # noqa: F811
    """An export killed between its two renames left the earlier model as `.old` and no --out: it is put back
    (so an export without --overwrite is still refused); a dead writer's staging folder is removed, a live
    writer's and another host's stay."""
    out, host = tmp_path / "hf", socket.gethostname()
    export = ["checkpoint", "export", str(sources / "ckpt"), "--format", "hf", "--out", str(out)]
    assert main(export) == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    out.rename(tmp_path / f".hf.{host}.{dead_pid()}.0123abcd.old")
    dead = left_behind(out, host, dead_pid())
    kept = [left_behind(out, host, live_pid), left_behind(out, "another-host", dead_pid())]
    capsys.readouterr()
    assert main(export) == 2
    assert "already exists" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert not dead.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf", *(f.name for f in kept)])

    stale_old = left_behind(out, host, dead_pid(), "old")  # killed after its rename into place: only a leftover
    assert main([*export, "--overwrite"]) == 0
    assert not stale_old.exists() and {p.name: p.read_bytes() for p in out.iterdir()} == earlier
