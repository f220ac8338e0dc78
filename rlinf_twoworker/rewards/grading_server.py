"""The forkserver a MathReward forks its grading processes from: the grader imported (and warmed
up) once in it, each grading process a cheap fork of it, not a fresh interpreter.

Each GradingServer is a forkserver of its own, not multiprocessing's process-wide one: that one
takes one preload list for the whole process (set_forkserver_preload), so two MathRewards of
one process (tests make several, with other graders) would share the first one's imports, and
any other user of the "forkserver" start method there (Python 3.14's default) would share ours.
A server of one's own imports exactly its MathReward's grader, and ends with close().

How its processes end with the process that holds the MathReward (workers/reward.py's
_die_with_parent): multiprocessing's forkserver exits when the write end of its "alive" pipe is
closed everywhere; CPython (3.10-3.13 forkserver.py) hands a copy of that end to every process
it forks, so busy grading processes would keep it, and each other, alive after their holder's
SIGKILL. Each grading process therefore closes its copy first thing (release_alive_pipe) and
sets PR_SET_PDEATHSIG on the server; the server, importing this module in its preload, sets
PR_SET_PDEATHSIG on the holder's thread that started it (MathReward keeps one for that), so the
kernel kills it, and through it its grading processes, however the holder ends.

Its processes do not run the client's main module, as multiprocessing's do (a script, or a Ray
worker's default_worker.py, which imports ray: 0.4 CPU-s each): CPython's forkserver means to
preload it but never gets its path (3.10-3.13), so each fork would run it afresh. Only a target
or argument defined there needs it (`import_main`).

`warm` is the body of the preload modules warm_rlinf and warm_math_verify: grade one trivial
answer, so that the grader's lazy imports (sympy, the LaTeX parsers) are done before the forks.
"""

from __future__ import annotations

import ctypes
import io
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from multiprocessing import process as mp_process
from typing import Any

WARM_UP_ANSWER: tuple[str, list[str]] = ("\\boxed{\\frac{1}{2}}", ["\\sqrt{2}"])
"""An answer either grader parses as LaTeX and compares through sympy (wrong, as it happens):
grading it imports all a grader grades with."""

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_server_pid: int | None = None
"""In a forkserver that preloaded this module, and so in every process it forked: its pid."""


def forkserver_available() -> bool:
    """Grading processes are forked from a GradingServer only on Linux (their end with the
    holder rests on PR_SET_PDEATHSIG) and on the Pythons whose forkserver it was written
    against (_GradingPopen repeats 3.10-3.13's launch); elsewhere MathReward spawns them."""
    return sys.platform.startswith("linux") and sys.version_info < (3, 14)


def die_with_parent_thread(what: str) -> None:
    """PR_SET_PDEATHSIG: the kernel sends this process SIGKILL when the thread that started it
    ends (Linux; elsewhere nothing). A failure is logged: `what` names the process."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logging.getLogger(__name__).warning(
            "%s %d: prctl(PR_SET_PDEATHSIG) failed (errno %d); it may outlive a killed reward "
            "actor while it grades",
            what,
            os.getpid(),
            ctypes.get_errno(),
        )


def forkserver_pid() -> int | None:
    """In a process a GradingServer forked: the server's pid, as the server recorded it before
    the fork (so a server that died since is seen); None elsewhere."""
    return _server_pid if _server_pid != os.getpid() else None


def release_alive_pipe() -> None:
    """In a process a forkserver forked: close its copy of the server's alive pipe, so that the
    server's life depends on its client alone (see the module's docstring)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def warm(grader: Callable[[str, Sequence[str]], bool]) -> None:
    """Grade WARM_UP_ANSWER with `grader`. Anything it raises is left to the grading
    processes, which meet it again and report it as they would have without the warm-up."""
    from rlinf_twoworker.rewards.math_verify_grader import quiet_timeout_notice

    quiet_timeout_notice()
    try:
        grader(*WARM_UP_ANSWER)
    except Exception:
        pass


def _preloading_in_forkserver() -> bool:
    """Whether this is a forkserver importing its preload modules: multiprocessing.forkserver's
    main() is on the stack and its _serve_one() (a forked process's start) is not."""
    seen: set[str] = set()
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            seen.add(frame.f_code.co_name)
        frame = frame.f_back  # type: ignore[assignment]
    return "main" in seen and "_serve_one" not in seen


if _preloading_in_forkserver():
    _server_pid = os.getpid()
    die_with_parent_thread("the grading processes' forkserver")


if sys.platform != "win32":
    from multiprocessing import forkserver as _mp_forkserver
    from multiprocessing import popen_forkserver as _mp_popen_forkserver
    from multiprocessing import reduction as _reduction
    from multiprocessing import spawn as _mp_spawn
    from multiprocessing import util as _mp_util
    from multiprocessing.context import set_spawning_popen as _set_spawning_popen

    class GradingServer(_mp_forkserver.ForkServer):
        """A forkserver of one MathReward's own that imports `preload` (module names; an
        ImportError is passed over, as multiprocessing does) once, then forks each grading
        process: process() makes one. It starts with the first process started (from the
        thread that starts it, which its PR_SET_PDEATHSIG watches), and again after it died."""

        def __init__(self, preload: Sequence[str]) -> None:
            super().__init__()
            self.set_forkserver_preload(list(preload))

        @property
        def preload(self) -> list[str]:
            return list(self._preload_modules)  # type: ignore[attr-defined]

        @property
        def pid(self) -> int | None:
            """The server's pid while it runs (started, not stopped)."""
            pid: int | None = self._forkserver_pid  # type: ignore[attr-defined]
            return pid

        def process(
            self, target: Callable[..., Any], args: tuple[Any, ...], name: str, import_main: bool
        ) -> Any:
            """A daemon multiprocessing Process that this server forks when started. Unless
            `import_main`, it does not import the client's main module as multiprocessing's
            processes do (a script's, or a Ray worker's default_worker.py, with ray): only a
            target or argument defined there needs it."""
            return _GradingProcess(
                self, import_main, target=target, args=args, name=name, daemon=True
            )

        def stop(self) -> None:
            """Kill the server (idle by now: its client stopped its grading processes; any left
            die with it) and forget it; the next process started starts a new one."""
            with self._lock:  # type: ignore[attr-defined]
                pid = self.pid
                if pid is None:
                    return
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                try:
                    self._stop_unlocked()  # type: ignore[attr-defined]
                except FileNotFoundError:  # its socket's file, gone with the temporary directory
                    pass

    class _GradingPopen(_mp_popen_forkserver.Popen):
        """popen_forkserver.Popen that asks its process's GradingServer, not the process-wide
        forkserver, for the fork: its _launch as in CPython 3.10-3.13 but for that (and the
        main module's import left out where the process does not need it)."""

        def _launch(self, process_obj: Any) -> None:
            server: GradingServer = process_obj._server
            prep_data = _mp_spawn.get_preparation_data(process_obj._name)
            if not process_obj._import_main:
                # CPython's forkserver preloads no main module (main_path never reaches it),
                # so each process would run it afresh: a Ray worker's imports ray (0.4 s).
                prep_data.pop("init_main_from_path", None)
                prep_data.pop("init_main_from_name", None)
            buf = io.BytesIO()
            _set_spawning_popen(self)
            try:
                _reduction.dump(prep_data, buf)
                _reduction.dump(process_obj, buf)
            finally:
                _set_spawning_popen(None)
            self.sentinel, w = server.connect_to_new_process(self._fds)  # type: ignore[attr-defined]
            # The write end's duplicate is the forked process's sentinel of this one.
            _parent_w = os.dup(w)
            close_fds = _mp_util.close_fds  # type: ignore[attr-defined]
            self.finalizer = _mp_util.Finalize(self, close_fds, (_parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = _mp_forkserver.read_signed(self.sentinel)

    class _GradingProcess(mp_process.BaseProcess):
        """A Process forked by a given GradingServer. Pickled into the forked process without
        the server (it is the client's object, and unpicklable)."""

        _start_method = "forkserver"

        def __init__(self, server: GradingServer, import_main: bool, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._server = server
            self._import_main = import_main

        def __getstate__(self) -> dict[str, Any]:
            state = dict(self.__dict__)
            state.pop("_server", None)
            return state

        @staticmethod
        def _Popen(process_obj: Any) -> Any:
            return _GradingPopen(process_obj)
