"""Python bytecode for the component processes, kept in the compile cache where the
environment keeps none.

Before its model loads, a component process imports torch, transformers and the model
family's modules: thousands of modules. Python reads each one's compiled bytecode from the
`__pycache__` beside its source. Where those files are absent (packages installed with
`pip install --no-compile`, as slim images do) and Python may not write them
(PYTHONDONTWRITEBYTECODE=1, or a read-only site-packages), every process compiles every
module from source on every start: seconds of each component's start-up, every run.

There, `use` keeps the process's bytecode under `<compile cache>/bytecode/` instead
(`sys.pycache_prefix`, Python's own mechanism): Python writes each module's bytecode there on
its first import and reads it on the next start, checked against its source's size and
modification time as it always is. Writes are atomic (a temporary file renamed), so two
processes or two runs sharing the cache never read a partial file. An entry Python cannot
read (a damaged file) fails the import; `guarded` then imports again without the cache and
reports it. Where the environment has its bytecode, nothing changes.

`bulk_imports` is the other half of an import's cost: Python's cyclic collector. Importing
torch and transformers makes millions of objects, and the collector walks the growing heap
again and again while they load (about an eighth of the import's CPU time on a CPU host); next
to none of it is garbage. Inside `bulk_imports` the collector is off, and what the imports made
is frozen after (`gc.freeze`), so later collections do not walk it either.

No torch here: the processes call this before their first import of it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

SUBDIR = "bytecode"
SAMPLES: dict[str, tuple[str, ...]] = {
    "torch": ("__init__.py", "_tensor.py", "nn/modules/module.py", "_dynamo/__init__.py"),
    "transformers": (
        "__init__.py",
        "utils/import_utils.py",
        "modeling_utils.py",
        "generation/utils.py",
    ),
}
"""Modules a component imports, by package: whether Python has their bytecode stands for the
whole import (their packages are installed one way)."""

T = TypeVar("T")


def without_bytecode(samples: dict[str, tuple[str, ...]] = SAMPLES) -> list[str]:
    """The sample source files Python would compile on every import: no bytecode file where
    it looks, and none it may write (PYTHONDONTWRITEBYTECODE, or a directory it cannot
    write). Packages not installed are left out."""
    lacking = []
    for package, files in samples.items():
        spec = importlib.util.find_spec(package)  # finds it; imports nothing but parents
        if spec is None or not spec.submodule_search_locations:
            continue
        base = Path(next(iter(spec.submodule_search_locations)))
        for name in files:
            source = base / name
            if not source.is_file():
                continue
            cached = Path(importlib.util.cache_from_source(str(source)))
            if cached.exists():
                continue
            writable = os.access(
                cached.parent if cached.parent.is_dir() else source.parent, os.W_OK
            )
            if sys.dont_write_bytecode or not writable:
                lacking.append(str(source))
    return lacking


def cache_dir(root: Path) -> Path:
    """This interpreter's bytecode directory in the compile cache at `root`: one per
    interpreter (its version and installation), so nodes of one image share it."""
    who = hashlib.sha256(f"{sys.version}\0{sys.prefix}\0{sys.executable}".encode()).hexdigest()
    return Path(root).absolute() / SUBDIR / f"{sys.implementation.cache_tag}-{who[:12]}"


class BytecodeCache:
    """This process's use of the bytecode cache (one a process: `sys.pycache_prefix`)."""

    def __init__(self) -> None:
        self.directory: Path | None = None
        self._dont_write = sys.dont_write_bytecode
        self.lines: list[str] = []
        """What happened, for the run's log (BYTECODE_CACHE lines)."""
        self.warnings: list[str] = []
        """What went wrong with it (the run's log and console)."""

    def use(self, root: Path | None, who: str, samples: dict | None = None) -> None:
        """Keep this process's bytecode under `root` (the compile cache; None: off) where the
        environment keeps none for the modules a component imports; else change nothing."""
        if root is None or self.directory is not None or sys.pycache_prefix:
            return
        lacking = without_bytecode(SAMPLES if samples is None else samples)
        if not lacking:
            return
        from rlinf_twoworker.storage.private_dir import private_dir_problem

        problem = private_dir_problem(root)  # Python runs what it finds there
        if problem is not None:
            self.warnings.append(f"{who} not used: {problem}")
            return
        where = cache_dir(root)
        try:
            where.mkdir(parents=True, exist_ok=True)
            if not os.access(where, os.W_OK):
                raise PermissionError(f"{where} is not writable")
        except OSError as exc:
            self.warnings.append(
                f"{who} not used: {exc}; its modules compile from source on every start "
                "(make the compile cache writable, or install the packages with bytecode)"
            )
            return
        state = "warm" if any(where.iterdir()) else "cold"
        self._dont_write = sys.dont_write_bytecode
        sys.pycache_prefix = str(where)
        sys.dont_write_bytecode = False  # into the cache only: sources stay untouched
        self.directory = where
        self.lines.append(
            f"{who} {state} {where} (this environment keeps no bytecode for "
            f"{len(lacking)} of the sampled modules, e.g. {lacking[0]})"
        )

    def guarded(self, load: Callable[[], T], who: str) -> T:
        """`load()` (imports); should it fail while the cache is in use, once more without it
        (a damaged entry), reported. A failure without the cache is raised."""
        try:
            return load()
        except Exception as exc:
            where = self.directory
            if where is None:
                raise
            self.stop()
            self.warnings.append(
                f"{who} unreadable entry in {where} ({type(exc).__name__}: "
                f"{str(exc)[:300]}); imported without the cache"
            )
            return load()

    def stop(self) -> None:
        sys.pycache_prefix = None
        sys.dont_write_bytecode = self._dont_write
        self.directory = None

    def take(self) -> dict[str, list[str]]:
        """The lines and warnings so far, each once."""
        taken = {"lines": self.lines, "warnings": self.warnings}
        self.lines, self.warnings = [], []
        return taken


@functools.cache
def for_this_process() -> BytecodeCache:
    """The process's one BytecodeCache (`sys.pycache_prefix` is the process's): a component
    host and a preflight probe in one process share it, so either one's `guarded` knows the
    cache is in use."""
    return BytecodeCache()


_bulk_lock = threading.Lock()
_bulk_depth = 0
_collector_was_on = True


@contextlib.contextmanager
def bulk_imports() -> Iterator[None]:
    """The cyclic collector off while the block imports (a process's heavy modules), then
    back as it was, and what the process holds then frozen (`gc.freeze`: later collections
    skip it; reference counting still frees it). Blocks that overlap in threads of one
    process (the collector is the process's) turn it back on when the last one ends. Call it
    where what is alive will stay: a process's start-up, before its run's data exists."""
    global _bulk_depth, _collector_was_on
    with _bulk_lock:
        if _bulk_depth == 0:
            _collector_was_on = gc.isenabled()
            gc.disable()
        _bulk_depth += 1
    try:
        yield
    finally:
        with _bulk_lock:
            _bulk_depth -= 1
            if _bulk_depth == 0:
                gc.freeze()
                if _collector_was_on:
                    gc.enable()
