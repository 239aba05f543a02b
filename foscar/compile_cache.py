"""The persistent on-disk compile cache: compiled kernels and their SASS, shared across processes.

A kernel's first compile in a process costs seconds (the Hopper decode kernel ~16 s); every later
process loads it from here in milliseconds. Where it lives and whether it is used:

* ``FOSCAR_CACHE_DIR``: the directory (default ``$XDG_CACHE_HOME/foscar``, i.e. ``~/.cache/foscar``);
* ``FOSCAR_CACHE=0``: neither read nor write it (compile every kernel in every process).

An entry is keyed by everything that changes the binary: the caller's key (kernel, scheme, page
size, dtypes, arch: see :func:`foscar.jit.cached_compile`), the CuTe DSL version and its build
settings (``CUTE_DSL_*``: line info, assertions, optimization level, runtime library), a hash of
every source file of the ``foscar`` package (taken when this module is imported, so a process never
stores code it did not import under a newer hash), the source of the scheme's code formats written outside
the package (``foscar.formats.Format.compile_key``), the host machine type (the entry holds a host
object file) and :data:`FORMAT`. Changing any of them makes a new entry; stale ones stay until
``clear``. An entry that cannot be loaded is removed and written anew.

Each entry is a directory ``kernels/<digest>/`` holding what ``JitCompiledFunction.export_to_c``
writes (``kernel.o``, the host launcher with the cubin inside, reloaded with
``cutlass.cute.runtime.load_module``), the PTX and cubin (``foscar.inspect`` reads them) and
``key.txt``. It is written into a temporary directory and renamed into place, so a reader never
sees a half-written entry and two processes compiling the same kernel at once both succeed (the
second rename loses and its copy is dropped). SASS disassemblies (``sass/<cubin sha256>.sass``)
are written to a temporary file and renamed the same way.

List or clear it with ``python -m foscar.compile_cache list|clear|path``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import platform
import shutil
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

from .scheme import Scheme

__all__ = ["FORMAT", "enabled", "cache_dir", "source_hash", "entry_key", "load", "store", "load_sass", "store_sass",
           "entries", "clear", "dump_dir", "read_artifact"]

FORMAT = 1  # bump when the layout of an entry changes
_PREFIX = "foscar_kernel"  # symbol prefix of the exported launcher


def enabled() -> bool:
    """Whether the disk cache is used (``FOSCAR_CACHE=0`` turns it off)."""
    return os.environ.get("FOSCAR_CACHE", "1") != "0"


def cache_dir() -> Path:
    """``FOSCAR_CACHE_DIR``, else ``$XDG_CACHE_HOME/foscar``, else ``~/.cache/foscar``."""
    forced = os.environ.get("FOSCAR_CACHE_DIR")
    if forced:
        return Path(forced).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "foscar"


def _hash_sources() -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


_SOURCE_HASH = _hash_sources()  # at import: the code this process runs, whatever changes on disk later


def source_hash() -> str:
    """SHA-256 of every ``.py`` file of the ``foscar`` package (paths and contents) as imported."""
    return _SOURCE_HASH


@functools.cache
def _dsl_version() -> str:
    try:
        return metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:  # the DSL on PYTHONPATH without its dist-info (a staged copy)
        import cutlass

        return getattr(cutlass, "__version__", "unknown")


@functools.cache
def _dsl_settings() -> str:
    """The DSL's build settings that change the binary (``CUTE_DSL_*``), less the arch (in the key)."""
    from cutlass.cutlass_dsl import CuTeDSL

    items = str(CuTeDSL._get_dsl().envar.cache_key_str()).split(";")  # "arch='sm_90a';debug=False;..."
    return ";".join(item for item in items if item and not item.startswith("arch="))


def entry_key(key: tuple) -> str:
    """The digest naming the entry of ``key`` (see the module docstring for what goes in)."""
    formats = tuple(q.format.compile_key() for item in key if isinstance(item, Scheme) for q in (item.k, item.v))
    text = repr((FORMAT, key, formats, _dsl_version(), _dsl_settings(), source_hash(), platform.machine()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _entry_dir(key: tuple) -> Path:
    return cache_dir() / "kernels" / entry_key(key)


class LoadedKernel:
    """A compiled kernel reloaded from the cache: callable like the ``cute.compile`` result it was,
    with the PTX and cubin ``foscar.inspect.artifacts`` reads."""

    def __init__(self, function, ptx: str, cubin: bytes):
        self.function = function  # the DSL's compiled function (foscar.jit.launch replays its converted arguments)
        self.__ptx__ = ptx
        self.__cubin__ = cubin

    def __call__(self, *args, **kwargs):
        return self.function(*args, **kwargs)


def load(key: tuple):
    """The cached kernel of ``key`` as a :class:`LoadedKernel`, or None (no entry, or cache off)."""
    if not enabled():
        return None
    entry = _entry_dir(key)
    try:
        ptx = (entry / "kernel.ptx").read_text()
        cubin = (entry / "kernel.cubin").read_bytes()
    except OSError:
        return None
    from cutlass.cute.runtime import load_module

    try:
        function = load_module(str(entry / "kernel.o"))[_PREFIX]
    except Exception as exc:  # a damaged entry must not stop the kernel: drop it, compile and store anew
        warnings.warn(f"foscar compile cache: cannot load {entry} ({type(exc).__name__}: {exc}); removed, compiling "
                      "instead", RuntimeWarning, stacklevel=2)
        _remove(entry)
        return None
    return LoadedKernel(function, ptx, cubin)


def _remove(entry: Path) -> None:
    """Take ``entry`` out of the way atomically (rename), then delete it."""
    try:
        doomed = Path(tempfile.mkdtemp(prefix=".bad-", dir=entry.parent))
        os.rename(entry, doomed / "entry")
        shutil.rmtree(doomed, ignore_errors=True)
    except OSError:
        pass


def read_artifact(value, mode):
    """A compiled object's PTX or cubin: the value itself, or the file it names (``mode`` "r" / "rb")."""
    if isinstance(value, str) and "\n" not in value and os.path.isfile(value):
        with open(value, mode) as f:
            return f.read()
    return value


def store(key: tuple, compiled) -> None:
    """Write ``compiled`` (a ``cute.compile`` result kept with ``--keep-ptx --keep-cubin``) under ``key``.

    Never raises for a cache that cannot be written (read-only home, full disk): the kernel still
    runs, it is just compiled again next time.
    """
    if not enabled():
        return
    entry = _entry_dir(key)
    if entry.exists() or _hash_sources() != _SOURCE_HASH:  # sources changed since import: not this code
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=entry.parent))
    except OSError:
        return
    try:
        compiled.export_to_c(str(staging), "kernel", _PREFIX)
        (staging / "kernel.ptx").write_text(read_artifact(compiled.__ptx__, "r"))
        (staging / "kernel.cubin").write_bytes(bytes(read_artifact(compiled.__cubin__, "rb")))
        (staging / "key.txt").write_text(f"{key!r}\nnvidia-cutlass-dsl {_dsl_version()}\n")
        os.rename(staging, entry)  # atomic; fails if another process got there first
    except Exception as exc:  # a cache that cannot be written must not fail a kernel that compiled
        if not isinstance(exc, OSError):
            warnings.warn(f"foscar compile cache: not stored ({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=2)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _sass_path(cubin: bytes, tool: str) -> Path:
    stat = os.stat(tool)  # a different nvdisasm may print different SASS text
    digest = hashlib.sha256(cubin + f"\0{tool}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_dir() / "sass" / f"{digest[:32]}.sass"


def load_sass(cubin: bytes, tool: str) -> str | None:
    """The cached ``nvdisasm`` output of ``cubin`` (by ``tool``), or None."""
    if not enabled():
        return None
    try:
        return _sass_path(cubin, tool).read_text()
    except OSError:
        return None


def store_sass(cubin: bytes, tool: str, sass: str) -> None:
    """Cache ``sass`` as the disassembly of ``cubin`` by ``tool`` (temp file + atomic rename)."""
    if not enabled():
        return
    path = _sass_path(cubin, tool)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".staging-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(sass)
        os.replace(staging, path)
    except OSError:
        pass


def dump_dir() -> tempfile.TemporaryDirectory:
    """A fresh directory for the DSL's ``--keep-ptx``/``--keep-cubin`` files, removed after the
    compile (the compiled object keeps their contents; without ``--dump-dir`` they pile up in the
    current directory or the system temp dir)."""
    if enabled():
        try:
            base = cache_dir()
            base.mkdir(parents=True, exist_ok=True)
            return tempfile.TemporaryDirectory(prefix="dump-", dir=base)
        except OSError:
            pass
    return tempfile.TemporaryDirectory(prefix="foscar-dump-")


def entries() -> list[tuple[str, int, str]]:
    """(digest, bytes, first line of key.txt) of every kernel entry."""
    out = []
    root = cache_dir() / "kernels"
    for entry in sorted(root.iterdir()) if root.is_dir() else ():
        if entry.name.startswith("."):
            continue
        size = sum(f.stat().st_size for f in entry.iterdir())
        try:
            key = (entry / "key.txt").read_text().splitlines()[0]
        except (OSError, IndexError):
            key = "?"
        out.append((entry.name, size, key))
    return out


def clear() -> int:
    """Delete what this cache wrote (``kernels/``, ``sass/``, leftover ``dump-*`` directories) and the
    cache directory if that leaves it empty -- never other files in ``FOSCAR_CACHE_DIR``; returns the
    bytes freed."""
    root = cache_dir()
    if not root.is_dir():
        return 0
    freed = 0
    for part in [root / "kernels", root / "sass", *root.glob("dump-*")]:
        if not part.is_dir():
            continue
        for f in part.rglob("*"):
            try:
                freed += f.stat().st_size if f.is_file() else 0
            except FileNotFoundError:  # another process is writing or removing
                pass
        shutil.rmtree(part, ignore_errors=True)
    try:
        root.rmdir()
    except OSError:  # not empty: other files the user keeps there
        pass
    return freed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m foscar.compile_cache", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("list", "clear", "path"),
                        help="list: one line per cached kernel; clear: delete the cache; path: print its directory")
    args = parser.parse_args(argv)
    if args.command == "path":
        print(cache_dir())
    elif args.command == "clear":
        print(f"removed {cache_dir()} ({clear() / 1e6:.1f} MB)")
    else:
        rows = entries()
        for digest, size, key in rows:
            print(f"{digest}  {size / 1e6:6.2f} MB  {key}")
        sass = cache_dir() / "sass"
        n_sass = len(list(sass.glob("*.sass"))) if sass.is_dir() else 0
        state = "" if enabled() else " (FOSCAR_CACHE=0: not used)"
        print(f"{len(rows)} kernels, {n_sass} SASS disassemblies in {cache_dir()}{state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
