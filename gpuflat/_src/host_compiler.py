"""Build a C++ shared library with g++ from source text, and load it.

One place for what every build of gpuflat needs, the host libraries' and the
GPU's cubins alike: the compiler (``$GPUFLAT_CXX``, default ``g++``), the
cache directory, content hashes, a disk cache keyed by a hash of everything
that goes into the build, one build per machine (:func:`build_once`: a file
lock, so processes starting on a cold cache build once and the others wait),
a line on the ``gpuflat`` logger when a build starts and when it ends, an
atomic rename (concurrent builders never see a half-written library), a
remembered failure (a compiler that rejects the sources leaves a record under
the same hash, so other processes and ranks raise its message instead of
building again, until a source or tool changes), an in-process memo of loaded
libraries and of how each build was come by (:func:`obtained`), and the switch
that turns gpuflat's optional native parts off (:func:`native_disabled`).

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
import json
import logging
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar, overload

from gpuflat.errors import BuildError

if TYPE_CHECKING:
    from types import ModuleType

_Library = TypeVar("_Library")

# A module where the platform has it, else None (declared so, as the import alone
# would make it a module that is never None).
fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: builds run unlocked
    fcntl = None

__all__ = ["NATIVE_SWITCH", "build_library", "build_once", "cache_dir", "cache_root", "compiler", "digest",
           "failure_record", "first_error", "load", "logger", "native_disabled", "obtained", "tree_digest",
           "warn_unbuilt"]

# gpuflat's logger. A first-use build blocks its caller for seconds to
# minutes, so its lines are shown by default (on stderr, while the
# application has set up no logging of its own; after that they propagate to
# its handlers): `logging.getLogger("gpuflat").setLevel(logging.WARNING)`
# silences them.
logger = logging.getLogger("gpuflat")


class _ShownUntilConfigured(logging.StreamHandler):
    def emit(self, record: logging.LogRecord) -> None:
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


# The environment variable that turns gpuflat's optional native parts off
# ("0"); they then take their Python and NumPy paths.
NATIVE_SWITCH = "GPUFLAT_NATIVE"


def native_disabled() -> str | None:
    """Why the optional native parts are off (``GPUFLAT_NATIVE=0``), or None where they are on.

    >>> native_disabled() is None or os.environ["GPUFLAT_NATIVE"] == "0"
    True
    """
    return f"disabled by {NATIVE_SWITCH}=0" if os.environ.get(NATIVE_SWITCH) == "0" else None


def first_error(message: str) -> str:
    """The line of a build's message that says what went wrong: the compiler's
    first error line, else the message's first line.

    >>> first_error("g++ failed (exit 1):\\nIn file included from a.h:1:\\nb.cpp:2:3: error: 'x' was not declared")
    "b.cpp:2:3: error: 'x' was not declared"
    >>> first_error("cannot run the C++ compiler 'cc': not found")
    "cannot run the C++ compiler 'cc': not found"
    """
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return next((line for line in lines if re.search(r"\berror\b", line)), lines[0] if lines else message)


def warn_unbuilt(part: str, reason: str, instead: str) -> str:
    """Warn that native ``part`` is not used, naming the cause
    (:func:`first_error` of ``reason``) and the slower path taken
    ``instead``; return ``reason``. Its callers are loaders run once per
    process, so the warning is too.

    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     _ = warn_unbuilt("demo part", "g++ failed:\\nx.cpp:1:1: error: boom", "Python reads it")
    >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
    gpuflat's native demo part is not used: x.cpp:1:1: error: boom. Instead Python reads it;
    gpuflat.native_info() has the whole message
    """
    warnings.warn(f"gpuflat's native {part} is not used: {first_error(reason)}. Instead {instead}; "
                  f"gpuflat.native_info() has the whole message", stacklevel=3)
    return reason


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


def digest(parts: Iterable[str | bytes]) -> str:
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


def tree_digest(directory: str | os.PathLike[str]) -> str:
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
    parts: list[str | bytes] = []
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


def build_library(name: str, main_source: str, include_dirs: Sequence[str | os.PathLike[str]] = (),
                  flags: Iterable[str] = (), key_parts: Iterable[str | bytes] = (),
                  files: Mapping[str, str] | None = None) -> Path:
    """The shared library compiled from ``main_source``, built once per content.

    ``include_dirs`` go to ``-I`` (their files are not hashed: put what
    matters, e.g. :func:`tree_digest` of them, in ``key_parts``); ``flags``
    are added to ``-shared -fPIC``; ``files`` maps relative names to the
    text of extra files written beside the main source (so ``#include
    "name"`` finds them; they are hashed). The library is kept under
    :func:`cache_dir` as ``<name>-<hash>.so``, the hash covering the
    compiler and its version, the flags, the sources and ``key_parts``.
    Raises :class:`~gpuflat.errors.BuildError` with the compiler's message on
    failure; where the compiler rejected the sources, again from the record
    it left (:func:`failure_record`) without building, until the hash changes.

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
    build_once(name, path, lambda: _compile(name, cxx, main_source, files, include_dirs, all_flags, path),
               failed=failure_record(path))
    return path


def failure_record(path: Path) -> Path:
    """Where a rejected build of library ``path`` leaves the compiler's message
    (under the same hash: a changed source or tool builds again; deleting it does too).

    >>> failure_record(Path("/cache/host/lib-0123.so"))
    PosixPath('/cache/host/lib-0123.failed')
    """
    return path.with_suffix(".failed")


def _remember_failure(record: Path, error: BuildError) -> None:
    """Write ``error`` to ``record`` by an atomic rename (a reader never sees half a record)."""
    tmp = record.with_name(f"{record.stem}.{_BUILDER}{os.urandom(4).hex()}.tmp")
    with contextlib.suppress(OSError):  # unrecorded, the next process builds again: slower, never wrong
        tmp.write_text(json.dumps({"message": str(error), "stderr": error.stderr}))
        os.replace(tmp, record)


def _raise_remembered(record: Path | None) -> None:
    """Raise the BuildError ``record`` holds, if there is one."""
    if record is None:
        return
    try:
        held = json.loads(record.read_text())
    except (OSError, ValueError):  # no record, or an unreadable one: build
        return
    raise BuildError(f"{held['message']}\n(remembered from an earlier build with the same sources and tools, "
                     f"in {record}; delete it to build again)", held["stderr"])


def build_once(what: str, path: Path, build: Callable[[], object], failed: Path | None = None) -> None:
    """``build()``, which must leave ``path`` in place (by an atomic rename),
    unless ``path`` is there already: once per machine and content. With
    ``failed`` (a :func:`failure_record`), the failure recorded there, if
    any, is raised instead of building.

    A lock file beside ``path`` makes other processes (ranks starting on a
    cold cache) wait and then find the result (or the failure) instead of
    building it again; where the file system cannot lock, or after
    :data:`LOCK_WAIT_SECONDS`, they build as well. The build's start (what,
    where) and end (its time, or its first error line) go to
    :data:`logger`; how this process came by ``what`` to :func:`obtained`.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     target = Path(d, "out.txt")
    ...     build_once("a doctest file", target, lambda: target.write_text("built"))
    ...     build_once("a doctest file", target, lambda: target.write_text("again"))
    ...     target.read_text()
    'built'
    """
    if path.is_file():
        _obtained[what] = f"loaded from the cache ({path})"
        return
    _raise_remembered(failed)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with _build_lock, _file_lock(path, what):
        if path.is_file():
            _obtained[what] = f"built by another process, waited for {time.perf_counter() - start:.1f} s ({path})"
            return
        _raise_remembered(failed)
        logger.info("building %s into %s (not in the cache yet: first use on this machine, "
                    "or new sources or tools)", what, path.parent)
        start = time.perf_counter()
        try:
            build()
        except BuildError as exc:
            logger.info("could not build %s (%.1f s): %s", what, time.perf_counter() - start, first_error(str(exc)))
            raise
        took = time.perf_counter() - start
        logger.info("built %s in %.1f s", what, took)
        _obtained[what] = f"built in {took:.1f} s ({path})"


# How this process came by each build, by the name build_once was given.
_obtained: dict[str, str] = {}


def obtained(what: str) -> str:
    """How this process came by ``what`` (a :func:`build_once` name): built
    here, by another process, or loaded from the cache.

    >>> _ = build_library("doctest-twice", 'extern "C" int twice(int x) { return 2 * x; }', flags=("-O2",))
    >>> obtained("doctest-twice").startswith(("built", "loaded from the cache"))
    True
    """
    return _obtained.get(what, "not built or loaded by this process")


@contextlib.contextmanager
def _file_lock(path: Path, what: str) -> Iterator[None]:
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


def _compile(name: str, cxx: str, main_source: str, files: Mapping[str, str],
             include_dirs: Sequence[str | os.PathLike[str]], flags: Sequence[str], path: Path) -> None:
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
                # The build folder is temporary: its name would only hide the file's.
                stderr = proc.stderr.replace(work + os.sep, "")
                error = BuildError(f"{cxx} failed to build {name} (exit {proc.returncode}):\n{stderr}", stderr)
                # A compiler killed by a signal (out of memory, a timeout) says nothing of the sources.
                if proc.returncode > 0:
                    _remember_failure(failure_record(path), error)
                raise error
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


_loaded: dict[tuple[str, Callable[[str], Any]], Any] = {}
_load_lock = threading.Lock()


@overload
def load(path: str | os.PathLike[str]) -> ctypes.CDLL: ...


@overload
def load(path: str | os.PathLike[str], factory: Callable[[str], _Library]) -> _Library: ...


def load(path: str | os.PathLike[str], factory: Callable[[str], Any] = ctypes.CDLL) -> Any:
    """``factory(path)`` (default ``ctypes.CDLL``), made once per path and
    factory in this process; see the module example."""
    key = (str(path), factory)
    with _load_lock:
        lib = _loaded.get(key)
        if lib is None:
            lib = _loaded[key] = factory(str(path))
        return lib
