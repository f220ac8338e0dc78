"""Directories whose files this process runs or unpickles: only the user's own.

The compile cache (torch.compile's artifacts, which load as code) and the bytecode cache
(Python runs what it finds there) live on shared storage by default, under
`<runner.output_dir>/.compile-cache`. Whoever can write there can make every later run execute
their code, so a cache directory is used only when the current user owns it and no one else
can write it: made with mode 0700 when absent, tightened to 0700 when it is the user's and only
readable by others, refused otherwise (another owner, writable by group or others, a symbolic
link). No torch here: the bytecode cache checks before the process imports it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any


def private_dir_problem(path: str | Path) -> str | None:
    """None when `path` is a directory only this user can write (created 0700 if absent);
    otherwise why it must not be used, in one sentence naming the directory."""
    path = Path(path).absolute()
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as exc:
        return f"{path} cannot be made or read ({exc})"
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link: the directory it points to is not checked"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.geteuid():
        return (
            f"{path} belongs to user id {info.st_uid}, not to this user ({os.geteuid()}): what "
            "another user wrote there would run in this run's processes"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"{path} is writable by others (mode {stat.filemode(info.st_mode)}): what they wrote "
            f"there would run in this run's processes; `chmod 700 {path}` after checking it, "
            "or point runner.compile_cache_dir elsewhere"
        )
    if info.st_mode & 0o077:
        try:
            os.chmod(path, 0o700)  # the user's and never writable by others: keep it private
        except OSError as exc:
            return f"{path} cannot be made private ({exc})"
    return None


def keep_compile_cache_private(cfg: Any, typed: Any, warn: Callable[[str], None]) -> None:
    """Turn the run's compile cache off (runner.compile_cache_dir = null in both configs,
    before any process gets them) when its directory exists and is not private, saying so
    once; each process checks again (and makes it, 0700) before it reads or writes an entry."""
    root = typed.compile_cache_root
    if root is None or not os.path.lexists(root):
        return  # made (0700) by the first process that uses it; a run on CPUs may never
    problem = private_dir_problem(root)
    if problem is None:
        return
    cfg.runner.compile_cache_dir = None
    typed.runner.compile_cache_dir = None
    warn(
        f"COMPILE_CACHE not used: {problem}; this run compiles and imports without the "
        "compile and bytecode caches"
    )
