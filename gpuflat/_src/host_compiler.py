"""Build a C++ shared library with g++ from source text, and load it.

One place for what every build of gpuflat needs, the host libraries' and the
GPU's cubins alike: the compiler (``$GPUFLAT_CXX``, default ``g++``), the
cache directory, content hashes, a disk cache keyed by a hash of everything
that goes into the build, one build per machine (:func:`build_once`: a file
lock, so processes starting on a cold cache build once and the others wait),
a line on the ``gpuflat`` logger when a build starts and when it ends, an
atomic rename (concurrent builders never see a half-written library) and an
in-process memo of loaded libraries.

>>> src = 'extern "C" int twice(int x) { return 2 * x; }'
>>> path = build_library("doctest-twice", src, flags=("-O2",))
>>> path == build_library("doctest-twice", src, flags=("-O2",))
True
>>> lib = load(path)
>>> lib.twice(21), load(path) is lib
(42, True)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from gpuflat.errors import BuildError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds run unlocked
    fcntl = None

__all__ = ["build_library", "build_once", "cache_dir", "cache_root", "compiler", "digest", "load",
           "logger", "tree_digest"]

# gpuflat's logger. A first-use build blocks its caller for seconds to
# minutes, so its lines are shown by default (on stderr, while the
# application has set up no logging of its own; after that they propagate to
# its handlers): `logging.getLogger("gpuflat").setLevel(logging.WARNING)`
# silences them.
logger = logging.getLogger("gpuflat")


class _ShownUntilConfigured(logging.StreamHandler):
    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


if not any(isinstance(h, _ShownUntilConfigured) for h in logger.handlers):
    _handler = _ShownUntilConfigured()
    _handler.setFormatter(logging.Formatter("gpuflat: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)

# How long a process waits for another one's build of the same thing before
# it builds too (the atomic rename keeps that safe, only slower).
LOCK_WAIT_SECONDS = 900.0

# Every library is position-independent and shared; the caller adds the rest.
BASE_FLAGS = ("-shared", "-fPIC")


def compiler() -> str:
    """The C++ compiler: ``$GPUFLAT_CXX``, else ``g++``.

    >>> compiler() == os.environ.get("GPUFLAT_CXX", "g++")
    True
    """
    return os.environ.get("GPUFLAT_CXX", "g++")


def cache_root() -> Path:
    """gpuflat's cache: ``$GPUFLAT_CACHE_DIR``, else ``$XDG_CACHE_HOME/gpuflat``,
    else ``~/.cache/gpuflat``; when that folder cannot be made or written (a
    read-only home, as in a container run as another user), ``gpuflat-<uid>``
    in the system's temporary folder, so builds still run and are cached there.

    >>> cache_root().is_absolute() or "GPUFLAT_CACHE_DIR" in os.environ
    True
    """
    root = _configured_root()
    if _writable(root):
        return root
    return Path(tempfile.gettempdir(), f"gpuflat-{os.getuid()}")


def _configured_root() -> Path:
    root = os.environ.get("GPUFLAT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg, "gpuflat") if xdg else Path(os.path.expanduser("~"), ".cache", "gpuflat")


def _writable(folder: Path) -> bool:
    """Whether ``folder`` exists (made if need be) and this process may add files to it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(folder, os.W_OK | os.X_OK)


def cache_dir() -> Path:
    """Where built libraries are kept: the ``host`` folder of :func:`cache_root`.

    >>> cache_dir() == cache_root() / "host"
    True
    """
    return cache_root() / "host"


def digest(parts) -> str:
    """SHA-256 (hex) of a sequence of strings or bytes, each part delimited,
    so ``["ab", "c"]`` and ``["a", "bc"]`` differ.

    >>> digest(["ab", "c"]) != digest(["a", "bc"])
    True
    """
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def tree_digest(directory) -> str:
    """SHA-256 of every file under ``directory`` (relative names and bytes),
    so an edit to any header gives a new hash.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     _ = Path(d, "a.h").write_text("int a;")
    ...     before = tree_digest(d)
    ...     _ = Path(d, "a.h").write_text("int b;")
    ...     before != tree_digest(d)
    True
    """
    d = Path(directory)
    files = sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    parts = []
    for f in files:
        parts += [f.relative_to(d).as_posix(), f.read_bytes()]
    return digest(parts)


@functools.lru_cache(maxsize=None)
def _compiler_identity(cxx: str) -> str:
    """``cxx --version``: a compiler upgrade gives new libraries."""
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        return ""


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80] or "library"


def _check_relative(name: str) -> str:
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or ".." in parts:
        raise ValueError(f"file name {name!r} must be a relative path without '..'")
    return name


_build_lock = threading.Lock()


def build_library(name: str, main_source: str, include_dirs=(), flags=(), key_parts=(), files=None) -> Path:
    """The shared library compiled from ``main_source``, built once per content.

    ``include_dirs`` go to ``-I`` (their files are not hashed: put what
    matters, e.g. :func:`tree_digest` of them, in ``key_parts``); ``flags``
    are added to ``-shared -fPIC``; ``files`` maps relative names to the
    text of extra files written beside the main source (so ``#include
    "name"`` finds them; they are hashed). The library is kept under
    :func:`cache_dir` as ``<name>-<hash>.so``, the hash covering the
    compiler and its version, the flags, the sources and ``key_parts``.
    Raises :class:`~gpuflat.errors.BuildError` with the compiler's message on failure.

    >>> build_library("doctest-bad", "int f() { return }")
    Traceback (most recent call last):
    ...
    gpuflat.errors.BuildError: g++ failed to build doctest-bad (exit 1):
    ...
    """
    files = dict(files or {})
    for file_name in files:
        _check_relative(file_name)
    cxx = compiler()
    all_flags = BASE_FLAGS + tuple(flags)
    key = digest([cxx, _compiler_identity(cxx), *all_flags, "\0", *map(str, include_dirs), "\0",
                  main_source, *[x for n in sorted(files) for x in (n, files[n])], "\0", *key_parts])
    path = cache_dir() / f"{_safe_name(name)}-{key[:20]}.so"
    build_once(name, path, lambda: _compile(name, cxx, main_source, files, include_dirs, all_flags, path))
    return path


def build_once(what: str, path: Path, build) -> None:
    """``build()``, which must leave ``path`` in place (by an atomic rename),
    unless ``path`` is there already: once per machine and content.

    A lock file beside ``path`` makes other processes (ranks starting on a
    cold cache) wait and then find the result instead of building it again;
    where the file system cannot lock, or after :data:`LOCK_WAIT_SECONDS`,
    they build as well. The build's start (what, where) and end (with its
    time) go to :data:`logger`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     target = Path(d, "out.txt")
    ...     build_once("a doctest file", target, lambda: target.write_text("built"))
    ...     build_once("a doctest file", target, lambda: target.write_text("again"))
    ...     target.read_text()
    'built'
    """
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock, _file_lock(path, what):
        if path.is_file():
            return
        logger.info("building %s into %s (not in the cache yet: first use on this machine, "
                    "or new sources or tools)", what, path.parent)
        start = time.perf_counter()
        build()
        logger.info("built %s in %.1f s", what, time.perf_counter() - start)


@contextlib.contextmanager
def _file_lock(path: Path, what: str):
    """An exclusive lock on ``path``'s lock file, or none where locking is
    unsupported or another holder outlasts :data:`LOCK_WAIT_SECONDS`."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        deadline, told = time.monotonic() + LOCK_WAIT_SECONDS, False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("waited %.0f s for another process building %s; building it here too",
                                   LOCK_WAIT_SECONDS, what)
                    yield
                    return
                if not told:
                    logger.info("waiting for another process building %s", what)
                    told = True
                time.sleep(0.1)
                continue
            except OSError:  # no locks on this file system (some network ones)
                yield
                return
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
            return


def _compile(name, cxx, main_source, files, include_dirs, flags, path: Path) -> None:
    """Compile into a temporary file beside ``path``, then rename it into place:
    another process building the same library at once is harmless."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(path.parent)
    with tempfile.TemporaryDirectory(prefix="gpuflat-build-") as work:
        for file_name, text in files.items():
            dest = Path(work, file_name)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text)
        main = Path(work, "main.cpp")
        main.write_text(main_source)
        fd, tmp = tempfile.mkstemp(prefix=f"{path.stem}.{_BUILDER}", suffix=".tmp", dir=path.parent)
        os.close(fd)
        includes = [arg for d in include_dirs for arg in ("-I", str(d))]
        cmd = [cxx, *flags, "-I", work, *includes, "-o", tmp, str(main)]
        try:
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True)
            except OSError as exc:
                raise BuildError(f"cannot run the C++ compiler {cxx!r}: {exc}") from exc
            if proc.returncode != 0:
                raise BuildError(f"{cxx} failed to build {name} (exit {proc.returncode}):\n{proc.stderr}",
                                 proc.stderr)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


# A build's temporary file names its process and machine, so that a later
# build can tell one whose process was killed (a timeout's SIGKILL leaves no
# chance to remove it) from one still being written, here or on another
# machine sharing the cache.
_BUILDER = f"pid{os.getpid()}@{socket.gethostname()}."
_ABANDONED = re.compile(r"\.pid(\d+)@(.*)\.\w+\.tmp$")


def remove_abandoned(folder: Path) -> list[Path]:
    """Delete the temporary files of builds on this machine whose process has
    ended; return them.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     mine = Path(d, f"lib-1.{_BUILDER}x1.tmp"); _ = mine.write_bytes(b"")
    ...     remove_abandoned(Path(d)), mine.exists()
    ([], True)
    """
    removed = []
    host = socket.gethostname()
    for tmp in folder.glob("*.tmp"):
        found = _ABANDONED.search(tmp.name)
        if found and found.group(2) == host and not _running(int(found.group(1))):
            with contextlib.suppress(FileNotFoundError):  # another build removed it first
                tmp.unlink()
                removed.append(tmp)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: no signal, only the check that the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


_loaded: dict = {}
_load_lock = threading.Lock()


def load(path, factory=ctypes.CDLL):
    """``factory(path)`` (default ``ctypes.CDLL``), made once per path and
    factory in this process; see the module example."""
    key = (str(path), factory)
    with _load_lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = _loaded[key] = factory(str(path))
        return lib
