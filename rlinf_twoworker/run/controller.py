"""The run controller: an async Ray actor on the Driver's node that owns one run.

It builds the placement group, runs preflight, starts the components, trains, checkpoints and
verifies; meanwhile it answers the handle's futures (`wait_step`, `wait_checkpoint`, ...). A
failure or a cancellation resolves every pending future with that error, kills the run's
actors and removes its placement group, so no future hangs and nothing is left holding GPUs.

This module imports no torch: the controller's process starts in under a second and places
the run at once. What trains (TRAINING_MODULES, torch and transformers among their imports)
is imported in a thread from the components' start on, beside the preflight.
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from rlinf_twoworker import bytecode, components
from rlinf_twoworker.cluster.connect import ray_name
from rlinf_twoworker.cluster.memory_parts import model_shapes
from rlinf_twoworker.cluster.memory_plan import (
    MemoryPlan,
    explain_oom,
    free_by_resource_rank,
    refusal,
    settle_plan,
    write_plan,
)
from rlinf_twoworker.cluster.placement import (
    bundle_node_ids,
    placement_timeout_error,
    request_placement_group,
    wait_removed,
)
from rlinf_twoworker.config import GRPOConfig, config_notes, precision_warning
from rlinf_twoworker.config.placement import placement_record
from rlinf_twoworker.errors import RunCancelledError, TwoWorkerError
from rlinf_twoworker.results import CheckpointInfo, StepResult
from rlinf_twoworker.run import kept, lifecycle
from rlinf_twoworker.run.group import ComponentGroup
from rlinf_twoworker.run.head_start import RunHeadStart
from rlinf_twoworker.run.liveness import Watch, liveness_error, root_cause
from rlinf_twoworker.run.observers import (
    MemoryMetrics,
    PaddingHint,
    RayMetrics,
    RunObserver,
    StartupRecord,
    StepLine,
    TensorBoard,
)
from rlinf_twoworker.run.startup import StartupClock
from rlinf_twoworker.run.storage_io import StorageIO
from rlinf_twoworker.run.tasks import background, in_daemon_thread
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.data import (
    PromptSampler,
    encode_prompts,
    load_jsonl,
    validation_samples,
)
from rlinf_twoworker.storage.rollouts import write_rollouts
from rlinf_twoworker.storage.rundir import write_placement

RELEASE_S = 60.0
"""How long a run waits for its components and placement group to be released (killing the
actors, then removing the group: wait_removed's 10 s)."""

TRAINING_MODULES = (
    "rlinf_twoworker.engines.models",
    "rlinf_twoworker.run.step",
    "rlinf_twoworker.run.warmup",
    "rlinf_twoworker.run.checkpointing",
)
"""What the controller trains with, imported by `_import_training` (each imports torch)."""


def _import_training() -> float:
    """Import TRAINING_MODULES (in a thread: `_setup`); returns the seconds it took."""
    start = time.perf_counter()
    with bytecode.bulk_imports():
        for name in TRAINING_MODULES:
            importlib.import_module(name)
    return time.perf_counter() - start


def _load_tokenizer(path: str) -> Any:
    from rlinf_twoworker.engines.models import load_tokenizer

    return load_tokenizer(path)


class _Future:
    """A value that resolves once, or fails with an error."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def set(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()


def fresh_error(root: BaseException) -> BaseException:
    """A new exception with the root cause's type and message, chained to it: every waiter
    raises its own, so none carries another waiter's frames."""
    try:
        fresh = copy.copy(root)
    except Exception:  # an exception type that cannot be copied: wrap it
        fresh = TwoWorkerError(f"{type(root).__name__}: {root}")
    fresh.__traceback__ = None
    fresh.__cause__ = root
    return fresh


@dataclass
class _Inputs:
    """What every step of the run loop reads: the tokenizer, the prompt sampler, the encoded
    validation prompts."""

    tokenizer: Any
    sampler: PromptSampler
    val_prompts: Any


class RunController:
    def __init__(
        self,
        cfg: DictConfig,
        typed: GRPOConfig,
        run_dir: str,
        classes: dict | None = None,
        called_at: float | None = None,
        callers_group: Any = None,
    ) -> None:
        """`called_at`: time.time() when run_grpo_two_worker was called (start-up is timed
        from there). `callers_group`: a placement group the caller owns, checked already; the
        run uses it and never removes it."""
        self.raw_cfg = cfg  # as given: what the config notes and the placement record read
        self.cfg = typed
        self.run_dir = Path(run_dir)
        self.run_id = self.cfg.runner.experiment_name
        self.io = StorageIO(self.run_dir, self.run_id)  # file calls: never on the event loop
        self.log = self.io.log
        self.classes = classes
        self.steps: dict[int, _Future] = {}
        self.checkpoints: dict[int, _Future] = {}
        self.preflight_f, self.result_f, self.placement_f = _Future(), _Future(), _Future()
        self.error: BaseException | None = None
        self.detected: BaseException | None = None  # a death the watchdog saw
        self.bundle_nodes: list[str] = []
        self.samples: list[Any] = []
        self.val_samples: list[Any] = []
        self.total_steps = self.cfg.runner.max_steps  # lowered by max_epochs once data is read
        self.group: ComponentGroup | None = None
        self.head_start: RunHeadStart | None = None
        """The components' head start (run/head_start.py), attached to the group by _setup."""
        self.watch: Watch | None = None
        self.pg: Any = None
        self.callers_group = callers_group
        self.keeps = typed.cluster.keep_processes and callers_group is None
        """cluster.keep_processes: its model components' processes outlive it (run/kept.py)."""
        self.taken: kept.KeptGroup | None = None
        """The kept processes (and group) of an earlier run that this run took."""
        self.released = False
        self.kept_processes = 0
        """How many processes this run left for the next one (0: none kept)."""
        self.task: asyncio.Task | None = None
        self.state = "pending"
        self.ray_metrics = RayMetrics(self.run_id)  # an observer from the start: states too
        self.phase = "starting"
        self.current_step = 0
        self.steps_done = 0
        self.resume_step = 0
        self.resume_from: Path | None = None
        self.last: dict[str, float] = {}
        self.last_step = 0  # the step `last` belongs to
        self.started_at = time.time()
        self.components_ready = False  # every component answered (topology is known)
        self.loading = False
        """Whether the components began to load their models (a run that fails before holds
        processes that never held anything of it: kept ones are given back, run/kept.py)."""
        self.components_began = 0.0  # time.time() when the components were asked to start
        self.clock = StartupClock(self.log.detail, called_at)
        self.memory_plan: MemoryPlan | None = None
        self.warm_up: Any = None  # run.warmup.WarmUp, made once TRAINING_MODULES are imported
        self.imports: asyncio.Future | None = None
        """_import_training in a thread, from the components' start on (`_setup`)."""
        self.tokenizer: asyncio.Future | None = None
        """The tokenizer, loaded in a thread from the preflight on (`_setup`; awaited by
        `_train`): its imports are done before step 1 needs it."""

    # ---- the handle's view -------------------------------------------------------------
    async def start(self) -> bool:
        self.clock.since_call("connect")
        self.task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _await(self, future: _Future, timeout: float | None = None) -> Any:
        await asyncio.wait_for(future.event.wait(), timeout)
        if future.error is not None:
            raise fresh_error(future.error)
        if future.value is None and self.error is not None:
            raise fresh_error(self.error)
        return future.value

    def _step_future(self, n: int) -> _Future:
        future = self.steps.setdefault(n, _Future())
        if n > self.total_steps:
            future.fail(self._past_the_end(n, "step"))
        elif self.error is not None:  # asked for after the run ended without it
            future.fail(self.error)
        return future

    def _checkpoint_future(self, n: int) -> _Future:
        future = self.checkpoints.setdefault(n, _Future())
        if n not in ckpt.scheduled_steps(self.cfg, self.total_steps):
            future.fail(self._past_the_end(n, "checkpoint"))
        elif self.error is not None:
            future.fail(self.error)
        return future

    def _past_the_end(self, n: int, what: str) -> TwoWorkerError:
        runner = self.cfg.runner
        scheduled = ckpt.scheduled_steps(self.cfg, self.total_steps)
        if what == "checkpoint" and n <= self.total_steps:
            return TwoWorkerError(
                f"no checkpoint is scheduled at step {n}; run {self.run_id} checkpoints at "
                f"steps {scheduled} (runner.save_interval={runner.save_interval}, and the last)"
            )
        return TwoWorkerError(
            f"run {self.run_id} ends at step {self.total_steps}: runner.max_epochs="
            f"{runner.max_epochs} epoch(s) of the training data end it before "
            f"runner.max_steps={runner.max_steps}, so there is no {what} {n}"
        )

    def checkpoint_steps(self) -> list[int]:
        """The steps this run checkpoints at (the last one known once the data is read)."""
        return ckpt.scheduled_steps(self.cfg, self.total_steps)

    async def wait_step(self, n: int) -> StepResult:
        return await self._await(self._step_future(n))

    async def wait_checkpoint(self, n: int) -> CheckpointInfo:
        return await self._await(self._checkpoint_future(n))

    async def wait_preflight(self) -> Any:
        return await self._await(self.preflight_f)

    async def wait_result(self) -> Any:
        return await self._await(self.result_f)

    async def placement_group(self) -> Any:
        return await self._await(self.placement_f)

    def topology(self) -> list[dict[str, Any]]:
        if self.group is None or not self.components_ready:
            raise TwoWorkerError(
                f"run {self.run_id} has no components yet (phase: {self.phase}); their "
                "processes start beside the preflight and load their models after it and the "
                "memory plan: ask again once handle.status()['phase'] is past 'loading components'"
            )
        return [p.to_dict() for p in self.group.topology()]

    def status(self) -> dict[str, Any]:
        """What the run does now (state, phase), how far it is (steps_done of total_steps,
        the step in progress), and the metrics of step `metrics_step`, the last one done."""
        return {
            "run_id": self.run_id,
            "state": self.state,
            "phase": self.phase,
            "steps_done": self.steps_done,
            "step": self.current_step,
            "total_steps": self.total_steps,
            "max_steps": self.cfg.runner.max_steps,
            "metrics_step": self.last_step,
            "metrics": dict(self.last),
            "error": None if self.error is None else str(self.error),
            "elapsed_s": time.time() - self.started_at,
            "controller_pid": os.getpid(),
        }

    def startup(self) -> dict[str, float]:
        """The start-up phases' seconds so far (run/startup.py), one entry a phase and process."""
        return dict(self.clock.seconds)

    async def cancel(self) -> bool:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await asyncio.wait_for(asyncio.shield(self.task), 60)
            except (asyncio.CancelledError, asyncio.TimeoutError):
                pass
        return True

    # ---- the run ---------------------------------------------------------------------------
    async def _run(self) -> None:
        watchdog = asyncio.get_running_loop().create_task(self._watchdog())
        failure: tuple[BaseException, str] | None = None
        try:
            self._set_state("running")
            for note in config_notes(self.raw_cfg, self.cfg):
                self.log.info(f"CONFIG_NOTE {note}")
            if (mismatch := precision_warning(self.cfg)) is not None:
                self.log.info(f"PRECISION_WARNING {mismatch}")
            await self._setup()
            await self._train()
            watchdog.cancel()  # before the components are released on purpose
            report = await self._finish()
            self._set_state("succeeded" if report.passed else "failed")
            self.phase = "done"
            self.result_f.set(report)
        except asyncio.CancelledError:
            if self.detected is not None:  # the watchdog stopped the run: a death, not a cancel
                failure = (self.detected, "failed")
            else:
                failure = (RunCancelledError(f"run {self.run_id} was cancelled"), "cancelled")
        except BaseException as exc:  # every failure must resolve the futures
            watchdog.cancel()
            failure = (exc, "failed")
            cause = await root_cause(self.watch, exc, self._poll_s)
            failure = (explain_oom(cause, self.memory_plan, self.current_step), "failed")
        finally:
            watchdog.cancel()
            if self.watch is not None:
                self.watch.stop()
            try:  # release first: when a future raises, the cluster is already free
                # (a keeping run that failed before its models began to load gives its
                # processes back unused; after, they hold what the failure left: killed)
                await self._release_bounded(keep=self.keeps and not self.loading)
            finally:
                if failure is not None:
                    await self._fail(*failure)

    async def _setup(self) -> None:
        """Everything before the first step, in order: the placement group; the components'
        processes started beside the preflight; the data; the memory plan; the models loaded;
        process groups, restore and the first weight sync. Each phase is timed (run/startup.py)
        and shown in status()'s phase."""
        clock = self.clock
        self.phase = "placement"
        with clock.phase("placement"):
            self.pg = await self._place()
        places = await asyncio.to_thread(_bundle_places, self.pg)
        self.bundle_nodes = [p["node_id"] for p in places]
        here = _node_id()
        if places[0]["node_id"] != here:  # a caller's group, or a Driver without GPUs
            self.log.info(
                f"PLACEMENT bundle 0 (the Head's components) on node {places[0]['node_id'][:8]} "
                f"({places[0]['ip']}), not on the controller's node {here[:8]}"
            )
        self.placement_f.set(self.pg)
        self.phase = "preflight"
        # The components' processes start now, beside the preflight's probes (a process
        # takes seconds to import torch and transformers); their models load only after the
        # preflight and the memory plan have passed.
        group = ComponentGroup(
            self.cfg, self.run_id, self.cfg.placement, self.pg, self.classes, bundle_nodes=places
        )
        self.group, self.watch = group, Watch(group)  # set first: release, watchdog find it
        # Imports ahead of each load, the compile cache, the grading processes (head_start.py).
        self.head_start = RunHeadStart(group)
        self.components_began = time.time()
        group.start(keep=self.keeps, taken=self.taken)
        # Then the threads: their imports (torch, transformers) hold the interpreter for seconds.
        self.imports = background(asyncio.to_thread(_import_training))  # awaited later
        shapes = background(asyncio.to_thread(model_shapes, self.cfg))  # read by the plan
        self.tokenizer = background(asyncio.to_thread(_load_tokenizer, self.cfg.tokenizer_path))
        report = await self._preflight(group)
        self.phase = "loading data"
        with clock.phase("data"):
            await self._load_data()  # bad data fails the run here, before any model is loaded
        self.phase = "memory plan"
        with clock.phase("memory_plan"):  # refused here, before any model loads
            self.memory_plan = await self._plan_memory(shapes, report.nodes, group.gpu_of())
        self.phase = "loading components"
        self.loading = True  # from here on a failure leaves processes nobody may reuse
        with clock.phase("components"):
            await group.load()  # every component loads its model in parallel
        self.components_ready = True
        await asyncio.to_thread(
            write_placement,
            self.run_dir,
            placement_record(self.cfg.cluster, self.cfg.placement, components.in_run(self.cfg)),
            [p.to_dict() for p in group.topology()],
        )
        # Records only: beside the process groups and the sync, not before them (a
        # component answers after its preparation, which the sync does not wait for).
        recorded = background(
            lifecycle.log_startup(
                group, self.cfg, clock, self.log, self.components_began, self.head_start
            )
        )
        if self.cfg.runner.per_worker_log:
            await lifecycle.attach_worker_logs(group, self.cfg, self.run_dir)
        await self._prepare_training(group)
        await recorded
        for row in group.topology():
            self.log.info(
                f"COMPONENT {row.component}:{row.rank} bundle={row.bundle} "
                f"node={row.node_id[:8]} ip={row.node_ip} gpus={row.gpu_ids}"
            )

    async def _place(self) -> Any:
        """The run's placement group once ready: the caller's (never ours to remove) or a new
        one (cluster/placement.py); refused after runner.timeouts.placement_s."""
        cfg, timeout = self.cfg, self.cfg.runner.timeouts.placement_s
        name = ray_name(self.run_dir, "pg")
        if self.callers_group is not None:
            pg = self.callers_group
            self.log.info(f"PLACEMENT_GROUP the caller's {pg.id.hex()[:8]} (not removed)")
        else:
            # Idle kept processes (an earlier run's, run/kept.py): this run takes them when
            # it keeps its own and they match it; any others are freed for its group.
            slots, sig = cfg.placement.slots, None
            if self.keeps:
                workers = {c.name: c.worker for c in components.in_run(cfg)}
                sig = kept.signature(cfg, slots, workers | (self.classes or {}))
            self.taken = await asyncio.to_thread(kept.take, sig, self.run_id, slots)
            if self.taken is not None:
                self.pg = pg = self.taken.pg
                self.log.info(
                    f"PLACEMENT_GROUP {self.taken.name} with {len(self.taken.hosts)} kept "
                    "processes (cluster.keep_processes: no process starts for them)"
                )
            else:
                if sig is not None:
                    name = kept.group_name(sig, self.run_id)
                self.pg = pg = request_placement_group(cfg.cluster, name)  # release finds it
        try:
            await asyncio.wait_for(pg.ready(), timeout)
        except asyncio.TimeoutError:
            raise placement_timeout_error(cfg.cluster, name, timeout) from None
        return pg

    async def _preflight(self, group: ComponentGroup) -> Any:
        """Each node's probe pinned to its bundle (cluster/preflight.py), beside the components'
        start; its report resolves wait_preflight, its seconds go to the start-up clock."""
        from rlinf_twoworker.cluster.preflight import Beside, preflight
        from rlinf_twoworker.cluster.probe import NodeProbe

        probe = (self.classes or {}).get("probe", NodeProbe)  # tests inject a slow one
        placed = background(self._placed(group))
        beside = Beside(group.bundles_with_gpus(), placed)
        try:
            report = await preflight(
                self.cfg, self.pg, self.run_dir, self.log.status, probe_cls=probe, beside=beside
            )
        finally:
            placed.cancel()  # a no-op once done
        # Timed from the components' request, as component_start is: the probes wait for the
        # components' answers, so component_start lies inside it.
        self.clock.record("preflight", time.time() - self.components_began)
        self.preflight_f.set(report)
        for node in report.nodes:  # where the preflight's time went, node by node
            for check, seconds in (node.get("seconds") or {}).items():
                self.clock.record(f"preflight/node{node['node_rank']}/{check}", seconds)
            lifecycle.log_bytecode_cache(self.log, node.get("bytecode_cache"))
        if report.collective is not None and "seconds" in report.collective:
            self.clock.record("preflight/collective", report.collective["seconds"])
        return report

    async def _placed(self, group: ComponentGroup) -> dict[int, list[str]]:
        """The components' first answers (group.wait_placed), timed from the request: the
        GPU ids each bundle's probe checks."""
        gpu_ids = await group.wait_placed()
        self.clock.record("component_start", time.time() - self.components_began)
        return gpu_ids

    def _rollout_writer(
        self, step: int, prompts: list[tuple[int, Any]]
    ) -> Callable[[list[dict[str, Any]]], Awaitable[Any]] | None:
        """runner.rollout_dump: the step's answers to rollouts/step_<N>.jsonl, each with its
        prompt's data index, query id and text, written on the run's storage thread."""
        if not self.cfg.runner.rollout_dump:
            return None

        async def write(records: list[dict[str, Any]]) -> Any:
            lines = []
            for record in records:
                index, sample = prompts[record.pop("prompt")]
                lines.append(
                    {
                        "step": step,
                        "data_index": index,
                        "query_id": sample.query_id,
                        "prompt": sample.prompt,
                        **record,
                    }
                )
            return await self.io.call(write_rollouts, self.run_dir, step, lines)

        return write

    async def _plan_memory(
        self, shapes: asyncio.Future, nodes: list[dict], gpu_of: dict[int, tuple[int, str]]
    ) -> MemoryPlan:
        """Each GPU's estimated need against what the preflight saw free (cluster/memory_plan.py),
        logged and written to memory_plan.json; a plan that does not fit is refused."""
        cfg = self.cfg
        try:
            found = await shapes
        except Exception as exc:
            raise TwoWorkerError(
                f"memory plan: cannot read the models' configs ({type(exc).__name__}: {exc}); "
                "check config.json in each *.model.model_path directory"
            ) from exc
        cuda = cfg.cluster.accelerator == "cuda"
        free = free_by_resource_rank(nodes, gpu_of) if cuda else None
        plan, notes = settle_plan(cfg, cfg.placement, found, free)
        for line in [*notes, *plan.lines()]:
            self.log.info(line)
        await asyncio.to_thread(write_plan, plan, self.run_dir / "memory_plan.json")
        if plan.too_big():
            raise refusal(plan, cfg)
        return plan

    async def _load_data(self) -> None:
        """The training samples, the run's step count (the earlier of runner.max_steps and
        runner.max_epochs epochs) and, when the run validates, its validation samples."""
        data, runner = self.cfg.data, self.cfg.runner

        def read(paths: list[str]) -> list[Any]:
            return load_jsonl(
                paths,
                data.prompt_key,
                data.answer_key,
                data.skip_malformed_lines,
                lambda note: self.log.info(f"DATA_WARNING {note}"),
                keep_rows=self.cfg.reward.reward_fn is not None,  # what the function gets
            )

        self.samples = await asyncio.to_thread(read, data.train_data_paths)
        per_epoch = len(self.samples) // data.rollout_batch_size
        self.total_steps = min(runner.max_steps, runner.max_epochs * per_epoch)
        if self.total_steps < runner.max_steps:
            self.log.info(
                f"EPOCH_LIMIT runner.max_epochs={runner.max_epochs} x {per_epoch} steps an epoch "
                f"({len(self.samples)} samples, {data.rollout_batch_size} a step) end the run at "
                f"step {self.total_steps}, before runner.max_steps={runner.max_steps}"
            )
            for n in [n for n in self.steps if n > self.total_steps]:
                self._step_future(n)
        for n in list(self.checkpoints):
            self._checkpoint_future(n)
        if self.cfg.validates:
            pool = await asyncio.to_thread(read, data.val_data_paths)
            self.val_samples = validation_samples(pool, self.cfg)

    async def _prepare_training(self, group: ComponentGroup) -> None:
        """Process groups and the actor's build, its restore when resuming, the first sync."""
        joined = background(lifecycle.join_process_groups(group, self.cfg, self.clock))
        if self.imports is not None:  # done long before, unless the preflight was very quick
            self.clock.record("controller_imports", await self.imports)
        await joined
        from rlinf_twoworker.run import checkpointing
        from rlinf_twoworker.run.step import sync_weights
        from rlinf_twoworker.run.warmup import WarmUp

        self.resume_from = await self.io.call(ckpt.resume_source, self.cfg, self.run_dir)
        if self.resume_from is not None:
            with self.clock.phase("restore"):
                self.resume_step = await checkpointing.restore(
                    group, self.cfg, self.resume_from, self.log
                )
        with self.clock.phase("weight_sync"):
            await sync_weights(group, self.cfg)  # rollout and inference start from the actor
        self.warm_up = WarmUp()  # runner.compile_warm_up
        if self.resume_step < self.total_steps:  # a step follows: warm up beside its rollout
            self.warm_up.start(group, self.cfg, self.log)

    async def _train(self) -> None:
        """The run loop: this run's steps, its observers (run/observers.py) called at their
        points, each step's future set once its metrics are complete, its checkpoint saved."""
        from rlinf_twoworker.run import checkpointing  # imported already (_prepare_training)

        group, cfg = self.group, self.cfg
        if group is None:
            raise RuntimeError("training started before the components (a library bug)")
        inputs = await self._training_inputs()
        observers = self._observers(group)
        try:  # training_ends for every observer, also when one fails to begin
            for observer in observers:
                await observer.training_begins()
            for step in range(self.resume_step + 1, self.total_steps + 1):
                self.current_step, self.phase = step, f"step {step}"
                for observer in observers:
                    await observer.step_begins(step)
                result = await self._step(group, step, inputs)
                for observer in observers:
                    await observer.step_trained(step, result)
                if self._validates_at(step):
                    self.phase = f"validation after step {step}"
                    await self._validate(group, step, result, inputs)
                for observer in observers:
                    await observer.step_done(step, result)
                self.last, self.last_step, self.steps_done = result.scalars(), step, step
                self._step_future(step).set(result)
                if step in ckpt.scheduled_steps(cfg, self.total_steps):
                    self.phase = f"checkpoint {step}"
                    state = {"sampler": inputs.sampler.state_dict(), "step": step}
                    info = await checkpointing.save(group, cfg, self.run_dir, step, state, self.log)
                    await self.io.call(
                        self.log.info, f"CHECKPOINT step={step} dir={info.directory}"
                    )
                    self._checkpoint_future(step).set(info)
            await group.settle()  # calls nothing waited for (the last sync's release)
        finally:
            for observer in observers:
                await observer.training_ends()
        self.log.info(f"Step limit given by max_steps={self.total_steps} reached. Stopping run")
        self.log.status("RLINF_PYTHON_EXIT_CODE=0")

    async def _training_inputs(self) -> _Inputs:
        """The tokenizer, the prompt sampler (where the resumed run left it) and the encoded
        validation prompts; when resuming, the steps and checkpoints the resumed run did are
        resolved (a step's future with no metrics, a checkpoint's with its inherited info)."""
        cfg, data, source = self.cfg, self.cfg.data, self.resume_from
        if self.tokenizer is None:
            raise RuntimeError("training started before the tokenizer's load (a library bug)")
        tokenizer = await self.tokenizer
        sampler = PromptSampler(len(self.samples), data.rollout_batch_size, data.shuffle, data.seed)
        val_prompts = encode_prompts(
            tokenizer,
            [s.prompt for s in self.val_samples],
            data.max_prompt_length,
            log=self.log.info,
        )
        if source is not None:
            sampler.load_state_dict((await self.io.call(ckpt.load_data_state, source))["sampler"])
            for step in range(1, self.resume_step + 1):  # steps done by the run resumed from
                self._step_future(step).set(StepResult(step, {}, {}))
                if step in ckpt.scheduled_steps(cfg, self.total_steps):
                    info = await self.io.call(ckpt.inherited_info, source, step)
                    self._checkpoint_future(step).set(info)
            self.steps_done = self.resume_step
        return _Inputs(tokenizer, sampler, val_prompts)

    async def _step(self, group: ComponentGroup, step: int, inputs: _Inputs) -> StepResult:
        """One GRPO step on the sampler's next prompts (run/step.py)."""
        from rlinf_twoworker.run.step import prompt_rows, run_step

        indices = inputs.sampler.next_batch()
        batch = [self.samples[i] for i in indices]
        prompts = encode_prompts(
            inputs.tokenizer,
            [s.prompt for s in batch],
            self.cfg.data.max_prompt_length,
            log=self.log.info,
        )
        return await run_step(
            group,
            self.cfg,
            step,
            prompts,
            [s.solutions for s in batch],
            prompt_rows(self.cfg, batch),
            self._rollout_writer(step, [(i, self.samples[i]) for i in indices]),
        )

    async def _validate(
        self, group: ComponentGroup, step: int, result: StepResult, inputs: _Inputs
    ) -> None:
        """The validation prompts answered and graded after `step`; into the step's metrics."""
        from rlinf_twoworker.run.step import prompt_rows, validate

        val = await validate(
            group,
            self.cfg,
            step,
            inputs.val_prompts,
            [s.solutions for s in self.val_samples],
            prompt_rows(self.cfg, self.val_samples),
        )
        result.timings["time/validation"] = val.pop("time/validation")
        result.metrics.update(val)

    def _observers(self, group: ComponentGroup) -> list[RunObserver]:
        """The run loop's observers, in the order it calls them (run/observers.py), with the
        metric loggers runner.logger.logger_backends adds (run/metric_loggers.py)."""
        observers = [
            StartupRecord(group, self.cfg, self.clock, self.log, self.warm_up, self.head_start),
            MemoryMetrics(group, self.cfg),
            StepLine(self.log, self.total_steps),  # before the step's scalars are written
            PaddingHint(self.log, self.cfg),
            TensorBoard(self.io, self.cfg, self.total_steps),
            self.ray_metrics,
        ]
        logger = self.cfg.runner.logger
        if logger.uses("wandb") or logger.uses("mlflow"):
            from rlinf_twoworker.run.metric_loggers import MlflowLogger, WandbLogger

            config = cast(dict[str, Any], OmegaConf.to_container(self.raw_cfg, resolve=True))
            if logger.uses("wandb"):
                observers.append(WandbLogger(self.io, self.cfg, config))
            if logger.uses("mlflow"):
                observers.append(MlflowLogger(self.io, self.cfg, config))
        return observers

    def _validates_at(self, step: int) -> bool:
        """The library's validation (runner.validate) on RLinf's schedule (check_progress's
        run_val, which RLinf's reasoning runner computes and drops): every
        runner.val_check_interval steps and at the last step."""
        interval = self.cfg.runner.val_check_interval
        return self.cfg.validates and (step % interval == 0 or step == self.total_steps)

    async def _finish(self) -> Any:
        from rlinf_twoworker.storage.verify import expected_from_config, verify_run

        self.phase = "postflight"
        await self._release_bounded(keep=self.keeps)  # trained to its end: kept if asked
        placement = cast(
            dict[str, Any], OmegaConf.to_container(self.raw_cfg.cluster.component_placement)
        )
        expected = expected_from_config(self.cfg, placement, self.total_steps)
        # In the storage thread: every line logged before is on disk, and so are its own.
        return await self.io.call(verify_run, self.run_dir, expected=expected, log=self.log.status)

    # ---- failure detection -------------------------------------------------------------------
    @property
    def _poll_s(self) -> float:
        """How often the watchdog looks, and how long a failure's root cause is looked for:
        four looks within runner.timeouts.failure_detection_s, at most every 5 s."""
        return min(5.0, self.cfg.runner.timeouts.failure_detection_s / 4)

    async def _watchdog(self) -> None:
        """Fail the run within runner.timeouts.failure_detection_s when a component's process
        or a node of the placement group dies, even while no call to it is in flight (the
        reward actor dying during the actor update). Calls in flight fail on their own."""
        while True:
            await asyncio.sleep(self._poll_s)
            error = await liveness_error(self.watch, self.bundle_nodes, self.run_id)
            if error is not None and self.task is not None:
                self.detected = error
                self.task.cancel()
                return

    def _set_state(self, state: str) -> None:
        self.state = state
        self.ray_metrics.state_changed(state)

    # ---- failure and clean-up ----------------------------------------------------------------
    async def _fail(self, exc: BaseException, state: str) -> None:
        """Record the failure (a stalled storage holds it at most _poll_s), then fail the futures."""
        self.error, self.phase = exc, state
        self._set_state(state)
        try:
            await self.io.record_failure(exc, state, self.current_step, self._poll_s)
        finally:
            futures = [*self.steps.values(), *self.checkpoints.values()]
            for future in [*futures, self.preflight_f, self.result_f, self.placement_f]:
                future.fail(exc)

    async def _release_bounded(self, keep: bool = False) -> None:
        """Release the components and the placement group, once (`keep`: the processes and
        the group are kept for the next run where they all answer; run/kept.py); a release
        that hangs (the cluster is gone) is left behind with a warning instead of holding the
        run, or its process."""
        if self.released:
            return
        self.released = True
        if not await in_daemon_thread(lambda: self._release(keep), "release", RELEASE_S):
            self.log.info(
                f"WARNING the release of run {self.run_id}'s components and placement group "
                f"did not finish within {RELEASE_S:.0f} s (is the cluster or its GCS gone?); "
                "the run goes on without waiting for it"
            )
        elif self.kept_processes:
            self.log.info(
                f"KEPT_PROCESSES {self.kept_processes} processes and placement group "
                f"{self.pg.id.hex()[:8]} stay for the next run (cluster.keep_processes)"
            )

    def _release(self, keep: bool) -> None:
        if self.group is not None and keep and self.group.give_back(RELEASE_S / 2):
            self.kept_processes = sum(1 for m in self.group.all() if m.kept)
            return
        if self.group is not None:
            self.group.kill()
        if self.pg is not None and self.pg is not self.callers_group:
            wait_removed(self.pg)


def _node_id() -> str:
    """This process's node (a local lookup)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _bundle_places(pg: Any) -> list[dict[str, str]]:
    """Node id and IP of each bundle of the placement group, by bundle index."""
    import ray

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [{"node_id": n, "ip": ips.get(n, "?")} for n in bundle_node_ids(pg)]
