"""A component process's head start: what makes it ready sooner, and nothing it needs to be
correct. The run's set-up attaches it to its components with one call (`RunHeadStart(group)`,
run/controller.py), which asks each process for it; the process's host
(run/group.ComponentHost) runs it (`HeadStart`) at three points; the workers know nothing of
it.

    import_ahead   beside the preflight, before the model load: the worker's module (torch)
                   and what loading the model will import (transformers' classes, the
                   model's family), with the cyclic collector off (bytecode.bulk_imports) and
                   the bytecode cache where the environment keeps no bytecode (bytecode.py);
                   on GPUs it then starts a thread that imports torch.compile's stack
    prepare        right after the model load, on GPUs: that thread joined and the
                   component's entry of the shared compile cache loaded
                   (engines/compile_cache.py), before anything compiles
    save           after a compiled step: what was compiled since the last save, back to the
                   shared compile cache

The run also asks the reward, once it is built, to start its grading processes (its row's
`prepare`: warm_up_grader), which it would otherwise start on the first step's answers.
Without these calls a component imports on first use, compiles from scratch and keeps
nothing: the same run, started more slowly. The run's other start-up measures sit beside
this, each in one place: Ray's preloaded workers (rlinf_twoworker.preload), the compile
warm-up (run/warmup.py), and the start-up record (run/startup.py).

No torch at import: the process imports this before its first import of it.
"""

from __future__ import annotations

import asyncio
import importlib
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlinf_twoworker import bytecode
from rlinf_twoworker.run.tasks import background, gather_fail_fast
from rlinf_twoworker.workers.contract import PREPARATIONS, Process

if TYPE_CHECKING:  # annotations only
    from rlinf_twoworker.config import ModelConfig

Member = Any
"""A member of the run's ComponentGroup (run/group.Member); named in words here, since the
group's module imports this one for its processes' side."""

COMPILER_MODULES = ("torch._dynamo", "torch._inductor.compile_fx")
"""torch.compile's stack (seconds of Python), imported before the process compiles."""


def import_compiler() -> None:
    for name in COMPILER_MODULES:
        importlib.import_module(name)


def _import_compiler_quietly() -> None:
    try:
        import_compiler()
    except Exception:  # `prepare` imports them again and raises with the context
        pass


class RunHeadStart:
    """The run's side: attached to its ComponentGroup, it asks each process to import ahead
    as soon as the process has answered where it runs (beside the preflight), and to prepare
    (its row's `prepare`) as soon as its model is loaded, while the others still load; each
    call is made then and awaited later. `imported` and `prepared` give their answers to the
    start-up record (run/lifecycle.py)."""

    def __init__(self, group: Any) -> None:
        """`group`: the run's run/group.ComponentGroup (its on_placed and on_loaded hooks, its
        component table, timeouts and `call`)."""
        self.group = group
        self.importing: list[tuple[Member, asyncio.Future]] = []
        self.preparing: list[tuple[Member, asyncio.Future]] = []
        group.on_placed.append(self._import_ahead)
        group.on_loaded.append(self._prepare)

    def _import_ahead(self, member: Member) -> None:
        call = self.group.call(
            member, Process.import_ahead, timeout=self.group.timeouts.actor_start_s, stage="start"
        )
        self.importing.append((member, background(call)))

    def _prepare(self, member: Member) -> None:
        row = self.group.table[member.slot.component]
        call = self.group.call(
            member,
            PREPARATIONS[row.prepare],
            timeout=self.group.timeouts.actor_start_s,
            stage="preparation",
        )
        self.preparing.append((member, background(call)))

    async def imported(self) -> list[tuple[Member, dict[str, Any]]]:
        """Every process's import_ahead answer (done before its load)."""
        return await _answers(self.importing)

    async def prepared(self) -> list[tuple[Member, Any]]:
        """The answers of every preparation started since the last call (a failure raises)."""
        started, self.preparing = self.preparing, []
        return await _answers(started)


async def _answers(calls: list[tuple[Member, asyncio.Future]]) -> list[tuple[Member, Any]]:
    answers = await gather_fail_fast([future for _, future in calls])
    return [(member, answer) for (member, _), answer in zip(calls, answers)]


class HeadStart:
    """The head start of one component process (`who`: 'component:rank'), given its host's
    facts: the compile cache's `root` (None: off), the `model` its worker loads (a
    config.ModelConfig; None: none), and whether it runs on a GPU (`cuda`)."""

    def __init__(self, root: Path | None, who: str, model: ModelConfig | None, cuda: bool) -> None:
        self.root, self.who, self.model, self.cuda = root, who, model, cuda
        self.component = who.split(":")[0]
        self.compiler_imports: threading.Thread | None = None
        """The thread importing COMPILER_MODULES (GPUs; started by `import_ahead`)."""
        self.cache: Any = None
        """This component's compile-cache entry (engines/compile_cache.CompileCache), found by
        `prepare` on GPUs."""

    def import_ahead(self, worker_class: Any) -> dict[str, Any]:
        """Import the worker's module (`worker_class()`, which imports it) and what its model
        load will, without reading a weight. Returns its seconds, the modules it could not
        import (the load raises for them, with their context) and the bytecode cache's
        lines."""
        start = time.perf_counter()
        cache = bytecode.for_this_process()
        # Where the environment keeps no bytecode, the compile cache keeps it (bytecode.py).
        cache.use(self.root, self.who)
        missing: list[str] = []
        with bytecode.bulk_imports():  # no cyclic collection while torch and the model import
            cache.guarded(worker_class, self.who)  # the worker's module: torch, the engines
            path = None if self.model is None else self.model.model_path
            if path:
                from rlinf_twoworker.engines.models import preimport_model

                missing = cache.guarded(lambda: preimport_model(path), self.who)
        if self.cuda and self.compiler_imports is None:  # needed only after the load
            self.compiler_imports = threading.Thread(
                target=_import_compiler_quietly, name="compiler-imports", daemon=True
            )
            self.compiler_imports.start()
        return {
            "seconds": time.perf_counter() - start,
            "missing": missing,
            "bytecode": cache.take(),
        }

    def prepare(self) -> dict[str, Any]:
        """On GPUs, once the model is loaded: torch.compile's imports done and this
        component's compile-cache entry loaded, before it compiles. Returns its seconds by
        part and its cache lines (none on a CPU, or a second time)."""
        model = self.model
        if not self.cuda or self.cache is not None or model is None:
            return {"seconds": {}, "cache": []}
        start = time.perf_counter()
        if self.compiler_imports is not None:  # usually done by now
            self.compiler_imports.join()
        import_compiler()
        imported = time.perf_counter()
        self.cache = _cache_entry(self.root, self.component, model.precision, model.model_path)
        event = self.cache.load()
        return {
            "seconds": {
                "compiler_imports": imported - start,
                "cache_load": time.perf_counter() - imported,
            },
            "cache": [event.line(self.who)],
        }

    def save(self) -> dict[str, Any]:
        """After compiled work: save what was compiled since the last save (shared storage).
        Returns the cache lines to log and this process's seconds in torch.compile so far."""
        if self.cache is None:  # a CPU, no model, or not prepared
            return {"cache": [], "compile_s": 0.0}
        from rlinf_twoworker.engines import compile_cache

        event = self.cache.save_if_new()
        return {
            "cache": [] if event is None else [event.line(self.who)],
            "compile_s": compile_cache.compile_seconds(),
        }


def _cache_entry(root: Any, component: str, precision: str, path: str) -> Any:
    """The compile-cache entry under `root` of `component` for the model at `path`, in the
    dtype (`precision`) and on the GPU its worker loads it with
    (compile_cache.cache_key); `prepare` asks for it on GPUs only."""
    from transformers import AutoConfig

    from rlinf_twoworker.engines.compile_cache import CompileCache, cache_key
    from rlinf_twoworker.engines.models import device_for, dtype_for

    device = device_for("cuda")
    config = AutoConfig.from_pretrained(path).to_dict()
    key = cache_key(config, dtype_for(precision, device), device)
    return CompileCache(root, component, key)
