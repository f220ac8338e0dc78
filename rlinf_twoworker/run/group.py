"""Start every component as a Ray actor pinned to its bundle and GPU, and call them safely.

A run starts the processes first (beside its preflight) and loads the models after the memory
plan: `start`, `wait_placed`, then `load` (see `ComponentHost`). The run's controller makes
each process from its worker's name, without importing the worker's module (torch: seconds).

Actor names are `<run_id>-<8 hex>:<component>:<rank>` (cluster.connect.ray_name) in namespace
`rlinf_twoworker`, so operators find them with `ray list actors`. Every call goes through `call`, which applies a timeout and
turns any failure into a ComponentError naming the component, its rank and its node. A call
names its method by the function of the component contract (workers/contract.py:
`group.call(member, Trainer.train_step, shards, ...)`), so mypy checks the name and types the
answer.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

import ray

from rlinf_twoworker import components
from rlinf_twoworker.cluster.connect import NAMESPACE, ray_name
from rlinf_twoworker.cluster.placement import scheduling_options
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.config.placement import Placement, Slot
from rlinf_twoworker.config.settings import ProcessSettings
from rlinf_twoworker.errors import ComponentError
from rlinf_twoworker.results import Placed
from rlinf_twoworker.run.head_start import HeadStart
from rlinf_twoworker.run.kept import LOCK as KEPT_LOCK
from rlinf_twoworker.run.kept import KeptGroup
from rlinf_twoworker.run.kept import host_name as kept_host_name
from rlinf_twoworker.run.liveness import short_reason
from rlinf_twoworker.run.tasks import background, gather_fail_fast
from rlinf_twoworker.workers.contract import Process

R = TypeVar("R")


@dataclass
class Member:
    slot: Slot
    handle: Any
    where: dict[str, Any]
    ready_at: float | None = None
    """time.time() when its model load (its class's constructor) had finished."""
    kept: bool = False
    """Its process outlives the run, for the next one (cluster.keep_processes)."""


class ComponentHost:
    """One component's process. Its constructor only records its arguments, so the process
    answers `where` (its node, the GPUs Ray gave it) as soon as Ray has started it;
    `import_ahead` imports the worker's module and what its model load will; `load` builds
    the worker (its constructor loads the model); `prepare_compiler` and
    `save_compile_cache` serve the compile cache (those three: run/head_start.py); `call`
    runs a worker method. The run starts the processes beside the preflight and loads the
    models once the memory plan has passed (`ComponentGroup.start`, `load`). Made for one
    worker by `host_class`."""

    WORKER: str | type = ""
    """The worker: 'module:Class' (imported in this process only), or the class itself."""
    COMPONENT = ""

    def __init__(
        self, settings: ProcessSettings, rank: int = 0, kept_by: str | None = None
    ) -> None:
        self._cls: type | None = None
        self._claim = kept_by
        """The run using this process, where it is kept between runs (run/kept.py)."""
        self.rebind(settings, rank)

    def rebind(self, settings: ProcessSettings, rank: int) -> None:
        """Take a run's settings for this component (config/settings.py): a new process's
        first call, and a kept process's first call of each later run (its worker unloaded by
        the last run)."""
        self._args = (settings, rank)
        self._placed_at = time.time()  # the process started (or was taken) for this run
        self._load_began: float | None = None
        self._worker: Any = None
        self._model = settings.model
        """The model its worker loads (None: none)."""
        self._cuda = settings.accelerator == "cuda"
        """Whether the run is on GPUs."""
        root = settings.compile_cache_root
        self._head = HeadStart(root, f"{self.COMPONENT}:{rank}", self._model, self._cuda)
        """Its head start (run/head_start.py): imports ahead, the compiler's cache."""

    def _class(self) -> type:
        if self._cls is None:
            worker = self.WORKER
            if not isinstance(worker, str):
                self._cls = worker
                return worker
            try:
                self._cls = components.named(worker)
            except Exception as exc:  # the first import of torch and the engines, here
                raise ImportError(
                    f"{self.COMPONENT}:{self._args[1]}: its worker {worker} does not import in "
                    f"this process ({type(exc).__name__}: {exc}); install the library and its "
                    "dependencies in this node's Python environment (`rlinf-twoworker "
                    "preflight` checks the modules a run needs)"
                ) from exc
        return self._cls

    def where(self) -> dict[str, Any]:
        from rlinf_twoworker.workers.process import place

        return place(self.COMPONENT, self._args[1])

    def memory_report(self) -> dict[str, float]:
        """This process's memory since the last report (workers/process.process_memory): host
        memory, and on a GPU the peaks PyTorch saw where its worker runs a model."""
        from rlinf_twoworker.workers.process import process_memory

        return process_memory(gpu=self._cuda and self._model is not None)

    def attach_log(self, path: str) -> None:
        """runner.per_worker_log: this process also logs to `path`."""
        from rlinf_twoworker.workers.process import attach_log

        attach_log(path, self.COMPONENT, self._args[1])

    def import_ahead(self) -> dict[str, Any]:
        return self._head.import_ahead(self._class)

    def prepare_compiler(self) -> dict[str, Any]:
        return self._head.prepare()

    def save_compile_cache(self) -> dict[str, Any]:
        return self._head.save()

    def load(self, settings: ProcessSettings | None = None) -> dict[str, Any]:
        """Build the worker, with `settings` when given: as the run's memory plan settled them
        (activation recompute, offload, micro-batch tokens), which the process, started
        beside the preflight, was not made with."""
        self._load_began = time.time()
        if settings is not None:
            self._args = (settings, self._args[1])
        self._worker = self._class()(*self._args)
        return self.where()

    def ping(self) -> bool:
        return True

    def unload(self) -> dict[str, Any]:
        """Drop the worker, its process groups and its log, and give its memory back: the
        process is kept for the next run (cluster.keep_processes, run/kept.py)."""
        from rlinf_twoworker.workers.process import detach_log, drop_worker

        worker, self._worker = self._worker, None
        leave = getattr(worker, "leave", None)
        if leave is not None:
            leave()
        del worker
        detach_log()
        drop_worker(self._cuda)
        return self.where()

    def claim(self, run_id: str) -> bool:
        """Whether `run_id` now holds this kept process's group (False: another run does)."""
        if self._claim is not None and self._claim != run_id:
            return False
        self._claim = run_id
        return True

    def claimed_by(self) -> str | None:
        return self._claim

    def unclaim(self) -> None:
        self._claim = None

    def startup_report(self) -> dict[str, Any]:
        report = self._method("startup_report")()
        return {**report, "began": self._placed_at, "load_began": self._load_began}

    def _method(self, name: str) -> Any:
        if self._worker is None:
            raise RuntimeError(
                f"{self.COMPONENT}:{self._args[1]}: {name} was called before the worker was "
                "built (its load); a library bug"
            )
        return getattr(self._worker, name)


HOST_METHODS = frozenset(
    name for name, f in vars(ComponentHost).items() if callable(f) and not name.startswith("_")
)
"""The process's own methods (where, memory_report, attach_log, import_ahead, load, ping,
startup_report, prepare_compiler, save_compile_cache); `call` runs every other one on its
worker."""

if TYPE_CHECKING:  # the host is what the contract's Process promises (mypy checks it)
    _host: type[Process] = ComponentHost


def method_name(method: Callable[..., Any] | str) -> str:
    """The name Ray is sent for `method`, a function of the contract (its __name__). A plain
    name still works at run time, untyped (tests' stand-in workers)."""
    return method if isinstance(method, str) else method.__name__


class _SyncHost(ComponentHost):
    def call(self, method: str, *args: Any) -> Any:
        return self._method(method)(*args)


class _AsyncHost(ComponentHost):
    async def call(self, method: str, *args: Any) -> Any:
        result = self._method(method)(*args)
        return await result if inspect.isawaitable(result) else result


def host_class(worker: str | type, component: str, asynchronous: bool | None = None) -> type:
    """The Ray actor class of `component`'s process, running `worker` ('module:Class', or a
    class). `asynchronous`: whether the worker has async methods (then its calls run on an
    event loop); None reads it from the class."""
    if asynchronous is None:
        if isinstance(worker, str):
            raise ValueError(f"{component}: say whether {worker} has async methods")
        asynchronous = any(inspect.iscoroutinefunction(f) for _, f in inspect.getmembers(worker))
    name = worker.rpartition(":")[2] if isinstance(worker, str) else worker.__name__
    base = _AsyncHost if asynchronous else _SyncHost
    doc = f"The process of component {component} ({name}): see ComponentHost."
    # Named after the worker: `ray list actors` shows RolloutWorker, not a host.
    return type(name, (base,), {"WORKER": worker, "COMPONENT": component, "__doc__": doc})


class ComponentGroup:
    """Every component process of one run, with where each one lives."""

    def __init__(
        self,
        cfg: GRPOConfig,
        run_id: str,
        placement: Placement,
        pg: Any,
        classes: dict[str, type] | None = None,
        bundle_nodes: list[dict[str, str]] | None = None,
    ) -> None:
        """`bundle_nodes[i]` is {'node_id', 'ip'} of bundle i: where a member is known to be
        before it answers (an error in its constructor still names its node)."""
        self.cfg, self.run_id, self.placement, self.pg = cfg, run_id, placement, pg
        self.bundle_nodes = bundle_nodes or []
        table = {c.name: c for c in components.in_run(cfg)}
        self.table = table
        self.workers: dict[str, str | type] = {
            **{n: c.worker for n, c in table.items()},
            **(classes or {}),
        }
        """Each component's worker: the table's 'module:Class', or a class the caller gave."""
        self.members: dict[str, list[Member]] = {}
        self.timeouts = cfg.runner.timeouts
        self.stopping = False
        self.on_placed: list[Callable[[Member], None]] = []
        """Called with each member once it has answered where it runs (`wait_placed`)."""
        self.on_loaded: list[Callable[[Member], None]] = []
        """Called with each member once its model is loaded (`load`). The run's head start
        (run/head_start.RunHeadStart) makes its calls from these."""
        self.behind: list[asyncio.Future] = []
        """Calls nothing waits for yet (call_behind), awaited by `settle`."""

    def start(self, keep: bool = False, taken: KeptGroup | None = None) -> None:
        """Create every actor: each process starts, and no model is loaded
        (`ComponentHost`); `wait_placed` awaits their first answers, `load` their models.
        `keep`: the model components' processes are made to outlive the run (run/kept.py);
        `taken`: a kept group this run claimed, whose live processes serve it instead of new
        ones."""
        for slot in self.placement.slots:
            worker, entry = self.workers[slot.component], self.table[slot.component]
            kept = keep and entry.keep and isinstance(worker, str)
            host = taken.hosts.get((slot.component, slot.rank)) if taken and kept else None
            if host is not None:
                # Before any other call of this run (Ray keeps one caller's calls in order).
                rebind = getattr(host, method_name(Process.rebind))
                rebind.remote(entry.settings_for(self.cfg), slot.rank)
                handle = host
            else:
                handle = self._new_process(slot, worker, entry, kept)
            where = dict(self.bundle_nodes[slot.bundle]) if self.bundle_nodes else {}
            member = Member(slot, handle, where, kept=kept)
            self.members.setdefault(slot.component, []).append(member)

    def _new_process(
        self, slot: Slot, worker: str | type, entry: components.Component, kept: bool
    ) -> Any:
        asynchronous = entry.asynchronous if isinstance(worker, str) else None
        cls = host_class(worker, slot.component, asynchronous)
        options = scheduling_options(self.pg, self.placement, slot)
        if kept:  # detached: it outlives this run's controller (the group still bounds it)
            name = kept_host_name(self.pg, slot.component, slot.rank)
            options["lifetime"] = "detached"
        else:
            name = ray_name(self.cfg.run_dir, slot.component, slot.rank)
        remote: Any = ray.remote(cls).options(
            name=name,
            namespace=NAMESPACE,
            max_concurrency=entry.concurrency,
            max_restarts=0,
            **options,
        )
        settings = entry.settings_for(self.cfg)
        return remote.remote(settings, slot.rank, self.run_id if kept else None)

    def bundles_with_gpus(self) -> frozenset[int]:
        """The bundles where a member holds a GPU share (where its process sees the GPU)."""
        return frozenset(
            slot.bundle for slot in self.placement.slots if self.placement.gpu_fraction(slot) > 0
        )

    async def wait_placed(self) -> dict[int, list[str]]:
        """Every member's first answer: where it runs, with the GPUs Ray gave it (each then
        goes to `on_placed`). Returns each bundle's GPU ids held by its members (Ray's ids)."""

        async def answered(member: Member) -> dict[str, Any]:
            where = await self.call(
                member, Process.where, timeout=self.timeouts.actor_start_s, stage="start"
            )
            for hook in self.on_placed:
                hook(member)
            return where

        members = self.all()
        wheres = await gather_fail_fast([answered(m) for m in members])
        gpus: dict[int, list[str]] = {b: [] for b in self.bundles_with_gpus()}
        for member, where in zip(members, wheres):
            member.where = {**member.where, **where}
            if member.slot.bundle in gpus:
                gpus[member.slot.bundle] += where.get("gpu_ids", [])
        return {b: sorted(set(ids), key=_gpu_order) for b, ids in gpus.items()}

    def gpu_of(self) -> dict[int, tuple[int, str]]:
        """Resource rank -> (bundle, Ray's GPU id) of the members that hold a GPU share
        (known once `wait_placed` is done)."""
        return {
            m.slot.resource_rank: (m.slot.bundle, str(m.where["gpu_ids"][0]))
            for m in self.all()
            if m.where.get("gpu_ids")
        }

    async def load(self) -> None:
        """Every member's model load (its class's constructor), all at once, with its
        component's settings under the run's config as it is now (the memory plan's choices
        in it); each member goes to `on_loaded` as soon as its load is done, while the others
        still load."""
        settings = {name: entry.settings_for(self.cfg) for name, entry in self.table.items()}

        async def loaded(member: Member) -> dict[str, Any]:
            where = await self.call(
                member,
                Process.load,
                settings[member.slot.component],
                timeout=self.timeouts.actor_start_s,
                stage="start",
            )
            member.ready_at = time.time()
            for hook in self.on_loaded:
                hook(member)
            return where

        members = self.all()
        wheres = await gather_fail_fast([loaded(m) for m in members])
        for member, where in zip(members, wheres):
            member.where = where

    def all(self) -> list[Member]:
        return [m for ms in self.members.values() for m in ms]

    def one(self, component: str) -> Member:
        return self.members[component][0]

    def actors(self) -> list[Member]:
        """The training ranks (the table's `trains` component)."""
        trainer = next(c.name for c in self.table.values() if c.trains)
        return self.members[trainer]

    def policy_copies(self) -> list[Member]:
        """The members the actor's weights are synced to, in table order (the first is the
        sync's relay across the node boundary)."""
        return [m for c in self.table.values() if c.receives_weights for m in self.members[c.name]]

    def copies_beside_actors(self) -> list[Member]:
        """The policy copies on a GPU that an actor rank uses (they give their memory back
        during the update under actor.enable_offload)."""
        gpus = {m.slot.resource_rank for m in self.actors()}
        return [m for m in self.policy_copies() if m.slot.resource_rank in gpus]

    def describe(self, member: Member) -> str:
        w = member.where
        host = f"{w['host']}/" if w.get("host") else ""
        return f"{host}{w.get('ip', '?')} node {str(w.get('node_id', '?'))[:8]}"

    @overload
    def call(
        self,
        member: Member,
        method: Callable[..., Coroutine[Any, Any, R]],
        *args: Any,
        timeout: float,
        stage: str,
    ) -> Awaitable[R]: ...

    @overload
    def call(
        self, member: Member, method: Callable[..., R], *args: Any, timeout: float, stage: str
    ) -> Awaitable[R]: ...

    def call(
        self, member: Member, method: Callable[..., Any], *args: Any, timeout: float, stage: str
    ) -> Awaitable[Any]:
        """One remote call of `method` (a function of workers/contract.py; the answer has its
        return type, an async method's result for a coroutine) with a timeout; any failure
        names component, rank and node. The call is submitted here, when it is made (not when
        awaited): calls to one component run in the order they were made."""
        name = method_name(method)
        if name in HOST_METHODS:
            ref = getattr(member.handle, name).remote(*args)
        else:  # the worker's, named in Ray's task list as <Worker>.<method>
            who = f"{member.slot.component}:{member.slot.rank}.{name}"
            ref = member.handle.call.options(name=who).remote(name, *args)
        return self._answer(ref, member, name, timeout, stage)

    async def _answer(
        self, ref: Any, member: Member, method: str, timeout: float, stage: str
    ) -> Any:
        try:
            return await asyncio.wait_for(ref, timeout)
        except asyncio.TimeoutError:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                self.describe(member),
                f"{stage} ({method}) did not finish within {timeout:g} s; "
                "raise runner.timeouts or look at the component's log",
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise ComponentError(
                member.slot.component,
                member.slot.rank,
                self.describe(member),
                f"{stage} ({method}) failed: {short_reason(exc)}",
            ) from exc

    def call_behind(
        self, member: Member, method: Callable[..., Any], *args: Any, timeout: float, stage: str
    ) -> None:
        """Make a call whose answer nothing waits for now: it runs in the component before
        any later call to it, and `settle` raises its failure (the next weight sync settles,
        and so does the end of the run)."""
        task = background(self.call(member, method, *args, timeout=timeout, stage=stage))
        self.behind.append(task)

    async def settle(self) -> None:
        """Wait for every call made with `call_behind`; raise the first failure."""
        tasks, self.behind = self.behind, []
        if tasks:
            await gather_fail_fast(tasks)

    @overload
    async def call_each(
        self,
        members: list[Member],
        method: Callable[..., Coroutine[Any, Any, R]],
        *args: Any,
        timeout: float,
        stage: str,
        per_member: list[tuple] | None = None,
    ) -> list[R]: ...

    @overload
    async def call_each(
        self,
        members: list[Member],
        method: Callable[..., R],
        *args: Any,
        timeout: float,
        stage: str,
        per_member: list[tuple] | None = None,
    ) -> list[R]: ...

    async def call_each(
        self,
        members: list[Member],
        method: Callable[..., Any],
        *args: Any,
        timeout: float,
        stage: str,
        per_member: list[tuple] | None = None,
    ) -> list[Any]:
        """The same method on several members concurrently (a collective must be entered by
        all); the first failure cancels the wait on the others and is raised at once, so a
        collective stalled by a dead member never holds the run (a death is preferred as the
        error when several members failed together). Each answer as in `call`."""
        argss = per_member or [args] * len(members)
        return await gather_fail_fast(
            [self.call(m, method, *a, timeout=timeout, stage=stage) for m, a in zip(members, argss)]
        )

    def shared_gpus(self) -> tuple[bool, bool]:
        """Whether the weight sync's cross group (actor 0, the relay) and fan-out group (the
        policy copies) join processes on one GPU, where NCCL cannot run between them."""
        if self.cfg.cluster.accelerator != "cuda":
            return (False, False)
        source = self.actors()[0].slot.resource_rank
        ranks = [m.slot.resource_rank for m in self.policy_copies()]
        return (source == ranks[0], len(set(ranks)) < len(ranks))

    def topology(self) -> list[Placed]:
        rows = []
        for m in self.all():
            rows.append(
                Placed(
                    m.slot.component,
                    m.slot.rank,
                    m.slot.bundle,
                    m.slot.resource_rank,
                    str(m.where.get("node_id", "")),
                    str(m.where.get("ip", "")),
                    list(m.where.get("gpu_ids", [])),
                    int(m.where.get("pid", 0)),
                )
            )
        return rows

    def give_back(self, timeout_s: float) -> bool:
        """The end of a run that keeps its processes: the kept ones drop their workers and
        their group's claim, the others are killed. False when a kept one did not answer
        (then nothing may be kept: `kill`, and remove the group)."""
        kept = [m for m in self.all() if m.kept]
        lock = next((m for m in kept if (m.slot.component, m.slot.rank) == KEPT_LOCK), None)
        if lock is None:
            return False
        self.kill([m for m in self.all() if not m.kept])
        try:
            # Futures, not ray.get: this runs in a thread of the controller's event loop.
            deadline = time.monotonic() + timeout_s
            unloads = [getattr(m.handle, method_name(Process.unload)).remote() for m in kept]
            for ref in unloads:
                ref.future().result(max(0.0, deadline - time.monotonic()))
            unclaim = getattr(lock.handle, method_name(Process.unclaim)).remote()
            unclaim.future().result(max(0.0, deadline - time.monotonic()))
        except Exception:
            return False
        return True

    def kill(self, members: list[Member] | None = None) -> None:
        """Kill `members` (default: all of them)."""
        self.stopping = True  # our own kills are not deaths to report
        for member in self.all() if members is None else members:
            try:
                ray.kill(member.handle, no_restart=True)
            except Exception:  # already dead: nothing left to release
                pass


def _gpu_order(gpu_id: str) -> tuple[int, str]:
    """Numeric ids in numeric order (10 after 9); UUIDs after them, by name."""
    return (int(gpu_id), "") if gpu_id.isdigit() else (1 << 30, gpu_id)
