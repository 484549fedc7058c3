"""The host build's cache folder: where it is, and the temporary folder it
falls back to when its home cannot be written, one build per machine (a file
lock) that says what it does, and a rejected build remembered."""
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpuflat._src import host_compiler
from gpuflat.errors import BuildError


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


# Two processes on a cold cache, started together: each builds the same small
# library after a barrier file appears, and prints the gpuflat log lines it
# made (the default handler writes them to stderr).
_RACE = r"""
import sys, time
from pathlib import Path
from gpuflat._src import host_compiler
from gpuflat.errors import BuildError
go = Path(sys.argv[1])
while not go.exists():
    time.sleep(0.01)
host_compiler.build_library("race-test", 'extern "C" int seven() { return 7; }')
print(host_compiler.load(host_compiler.build_library("race-test", 'extern "C" int seven() { return 7; }')).seven())
"""


def test_two_processes_on_a_cold_cache_build_once(tmp_path):
    env = {**os.environ, "GPUFLAT_CACHE_DIR": str(tmp_path / "cache")}
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(go)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(1.0)  # both are waiting at the barrier
    go.write_text("")
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [out.strip() for out, _ in outs] == ["7", "7"]
    logs = "".join(err for _, err in outs)
    assert logs.count("gpuflat: building race-test into ") == 1, logs
    assert logs.count("gpuflat: built race-test in ") == 1, logs
    assert len(list((tmp_path / "cache" / "host").glob("race-test-*.so"))) == 1


def test_a_build_says_what_it_does_and_a_raised_level_silences_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gpuflat"):
        host_compiler.build_library("said-test", 'extern "C" int one() { return 1; }')
    said = [r.getMessage() for r in caplog.records if r.name == "gpuflat"]
    assert len(said) == 2 and said[0].startswith("building said-test into ") and str(tmp_path) in said[0], said
    assert re.fullmatch(r"built said-test in \d+\.\d s", said[1]), said
    caplog.clear()
    logger = logging.getLogger("gpuflat")
    monkeypatch.setattr(logger, "level", logging.WARNING)
    host_compiler.build_library("quiet-test", 'extern "C" int two() { return 2; }')
    assert not [r for r in caplog.records if r.name == "gpuflat"]


def test_the_default_handler_shows_build_lines_on_stderr():
    code = "import logging; from gpuflat._src import host_compiler as h; h.logger.info('a line')"
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown.stderr == "gpuflat: a line\n"
    # Once the application configures logging, the line goes to its handlers only.
    configured = subprocess.run([sys.executable, "-c", "import logging; logging.basicConfig(format='app %(message)s',"
                                 " level=logging.INFO); " + code], capture_output=True, text=True, check=True)
    assert configured.stderr == "app a line\n"


def test_a_file_system_without_locks_builds_unlocked(tmp_path, monkeypatch):
    def refuse(*_):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(host_compiler.fcntl, "flock", refuse)
    target = tmp_path / "out.txt"
    host_compiler.build_once("an unlocked file", target, lambda: target.write_text("built"))
    assert target.read_text() == "built"


def test_a_killed_builds_temporary_file_is_removed_by_the_next_build(tmp_path):
    # A build killed by SIGKILL (a timeout) cannot remove its temporary file;
    # the next build on this machine does, and leaves alone those of running
    # builds and of other machines sharing the cache.
    import socket

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    host = socket.gethostname()
    killed = tmp_path / f"lib-abc.pid{ended.pid}@{host}.q1w2.tmp"
    running = tmp_path / f"lib-abc.pid{os.getpid()}@{host}.e3r4.tmp"
    elsewhere = tmp_path / f"lib-abc.pid{ended.pid}@not-{host}.t5y6.tmp"
    for path in (killed, running, elsewhere):
        path.write_bytes(b"half a library")
    assert host_compiler.remove_abandoned(tmp_path) == [killed]
    assert not killed.exists() and running.exists() and elsewhere.exists()


def _counting_compiler(tmp_path, body):
    """A C++ compiler script that appends a line to ``runs`` per compile and then runs ``body``."""
    cxx, runs = tmp_path / "c++", tmp_path / "runs"
    cxx.write_text(f'#!/bin/sh\nif [ "$1" = "--version" ]; then echo counting; exit 0; fi\n'
                   f'echo run >> {runs}\n{body}\n')
    cxx.chmod(0o755)
    return str(cxx), runs


def test_a_rejected_build_is_remembered_and_raised_again_without_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path / "cache"))
    cxx, runs = _counting_compiler(tmp_path, 'echo "x.cpp:1:1: error: rejected" >&2; exit 1')
    monkeypatch.setenv("GPUFLAT_CXX", cxx)
    with pytest.raises(BuildError, match=r"failed to build remember-test \(exit 1\):\nx.cpp:1:1: error: rejected") \
            as first:
        host_compiler.build_library("remember-test", "int f();")
    with pytest.raises(BuildError, match="remembered from an earlier build with the same sources and tools") \
            as again:
        host_compiler.build_library("remember-test", "int f();")
    assert runs.read_text().count("run") == 1
    assert str(again.value).startswith(str(first.value)) and again.value.stderr == first.value.stderr
    # Other sources are built; so is the same one once its record is deleted.
    with pytest.raises(BuildError):
        host_compiler.build_library("remember-test", "int g();")
    for record in (tmp_path / "cache" / "host").glob("remember-test-*.failed"):
        record.unlink()
    with pytest.raises(BuildError):
        host_compiler.build_library("remember-test", "int f();")
    assert runs.read_text().count("run") == 3


def test_a_compiler_killed_by_a_signal_is_not_remembered(tmp_path, monkeypatch):
    # Out of memory or a timeout says nothing of the sources: the next call builds again.
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path / "cache"))
    cxx, runs = _counting_compiler(tmp_path, "kill -9 $$")
    monkeypatch.setenv("GPUFLAT_CXX", cxx)
    for _ in range(2):
        with pytest.raises(BuildError, match=r"exit -9"):
            host_compiler.build_library("killed-test", "int f();")
    assert runs.read_text().count("run") == 2
    assert list((tmp_path / "cache" / "host").glob("*.failed")) == []


def test_how_a_build_was_come_by_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    path = host_compiler.build_library("obtained-test", 'extern "C" int four() { return 4; }')
    assert re.fullmatch(rf"built in \d+\.\d s \({re.escape(str(path))}\)", host_compiler.obtained("obtained-test"))
    host_compiler.build_library("obtained-test", 'extern "C" int four() { return 4; }')
    assert host_compiler.obtained("obtained-test") == f"loaded from the cache ({path})"
