"""The host build's cache folder: where it is, and the temporary folder it
falls back to when its home cannot be written."""
import os
import tempfile
from pathlib import Path

from gpuflat import host_compiler


def test_the_cache_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUFLAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert host_compiler.cache_root() == tmp_path / "xdg" / "gpuflat"
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path / "own"))
    assert host_compiler.cache_root() == tmp_path / "own"
    assert (tmp_path / "own").is_dir()


def test_an_unwritable_home_falls_back_to_a_temporary_folder(tmp_path, monkeypatch):
    # A folder below a plain file can never be made, whoever runs the test.
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.delenv("GPUFLAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root = host_compiler.cache_root()
    assert root == tmp_path / "tmp" / f"gpuflat-{os.getuid()}"
    assert host_compiler.cache_dir() == root / "host"


def test_a_build_lands_in_the_fallback(tmp_path, monkeypatch):
    blocker = tmp_path / "home-is-a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(blocker / "gpuflat"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = host_compiler.build_library("fallback-test", 'extern "C" int three() { return 3; }')
    assert Path(path).parent == tmp_path / "tmp" / f"gpuflat-{os.getuid()}" / "host"
    assert host_compiler.load(path).three() == 3
