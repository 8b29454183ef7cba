"""linattn._io: atomic writes of files, folders and pointers (a failure leaves the old content and no
temporary), SHA-256, and JSON / TOML readers whose errors name the file."""

from __future__ import annotations

import hashlib
import os

import pytest

from linattn._io import atomic_write, read_config_file, read_json, read_toml, sha256_file, write_text_synced


def _only(folder):
    return sorted(p.name for p in folder.iterdir())


def test_atomic_file_write_replaces_or_keeps(tmp_path):
    path = tmp_path / "a.json"
    atomic_write(path, lambda p: p.write_text("old"))
    atomic_write(path, lambda p: p.write_text("new"))
    assert path.read_text() == "new"

    def fail(p):
        p.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "new" and _only(tmp_path) == ["a.json"]  # no temporary left


def test_atomic_folder_write_replaces_a_folder_only_when_the_new_one_is_complete(tmp_path):
    def folder(text, fail=False):
        def write(p):
            p.mkdir()
            write_text_synced(p / "x.txt", text)
            if fail:
                raise RuntimeError("interrupted")
        return write

    target = tmp_path / "step-1"
    atomic_write(target, folder("first"))
    with pytest.raises(RuntimeError):
        atomic_write(target, folder("second", fail=True))
    assert (target / "x.txt").read_text() == "first" and _only(tmp_path) == ["step-1"]
    atomic_write(target, folder("second"))
    assert (target / "x.txt").read_text() == "second" and _only(tmp_path) == ["step-1"]


def test_atomic_pointer_switch(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    link = tmp_path / "last"
    for name in ("a", "b"):
        atomic_write(link, lambda p, name=name: os.symlink(name, p, target_is_directory=True))
        assert os.readlink(link) == name
    assert _only(tmp_path) == ["a", "b", "last"]


def test_sha256(tmp_path):
    p = tmp_path / "blob"
    data = os.urandom(3 << 20)
    p.write_bytes(data)
    assert sha256_file(p) == hashlib.sha256(data).hexdigest()


def test_readers_name_the_file(tmp_path):
    bad_json, bad_toml, array = tmp_path / "c.json", tmp_path / "c.toml", tmp_path / "list.json"
    bad_json.write_text("{oops")
    bad_toml.write_text("steps = = 3\n")
    array.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"c\.json is not valid JSON"):
        read_json(bad_json)
    with pytest.raises(ValueError, match=r"c\.toml is not valid TOML"):
        read_toml(bad_toml)
    with pytest.raises(ValueError, match=r"list\.json must hold a JSON object, got list"):
        read_config_file(array)
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        read_config_file(tmp_path / "missing.toml")
    good = tmp_path / "g.toml"
    good.write_text('task = "mqar"\n[model]\nd_model = 16\n')
    assert read_config_file(good) == {"task": "mqar", "model": {"d_model": 16}}
    assert read_json(array) == [1, 2]
