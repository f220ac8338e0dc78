"""`run_grpo_two_worker(cfg)` and the `RunHandle` it returns.

The call validates the config, checks the cluster and creates the run directory before it
returns (bad input raises at once and creates nothing); the run itself goes on in a controller
actor on the Driver's node. The handle's futures are Ray ObjectRefs: `ray.get`, `ray.wait`,
`await`, or pass them to other Ray tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf

from rlinf_twoworker.cluster.connect import NAMESPACE, connect, ray_name
from rlinf_twoworker.config import GRPOConfig, config_notes, to_typed
from rlinf_twoworker.errors import ComponentError, TwoWorkerError
from rlinf_twoworker.run.kept import free_claimed
from rlinf_twoworker.run.liveness import death_cause
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.lineage import write_lineage
from rlinf_twoworker.storage.private_dir import keep_compile_cache_private
from rlinf_twoworker.storage.rundir import (
    DRIVER_LOG,
    FAILURE_JSON,
    RunLog,
    create_run_dir,
    escaping_paths,
    refuse_existing,
    run_dir_of,
    write_failure,
)


class RunHandle:
    """One run: its identity, its futures and its controls."""

    def __init__(
        self,
        controller: Any,
        cfg: DictConfig,
        typed: GRPOConfig,
        run_dir: Path,
        controller_node: str = "?",
    ) -> None:
        self._controller = controller
        self._controller_node = controller_node
        self.config = cfg
        """The run's config as given (what hydra/.hydra/config.yaml records)."""
        self._typed = typed
        self.run_id: str = self._typed.runner.experiment_name
        self.output_dir: Path = run_dir
        self._result_ref: Any = None
        # One controller call per future, whatever the number of polls: each call is a
        # coroutine of the controller until its future resolves, and enough of them would take
        # every slot of its max_concurrency, status() and cancel() included.
        self._refs: dict[tuple[Any, ...], ray.ObjectRef] = {}

    @property
    def placement_group(self) -> Any:
        timeout = self._typed.runner.timeouts.placement_s + 30
        return ray.get(self._controller.placement_group.remote(), timeout=timeout)

    @property
    def preflight(self) -> ray.ObjectRef:
        """Resolves to the PreflightReport once every node's probe has passed."""
        return self._ref("wait_preflight")

    def step(self, n: int) -> ray.ObjectRef:
        """Resolves to the StepResult of step n once it is complete."""
        if not 1 <= n <= self._typed.runner.max_steps:
            raise ValueError(
                f"step {n} is outside this run's steps 1..{self._typed.runner.max_steps}"
            )
        return self._ref("wait_step", n)

    def checkpoint(self, n: int) -> ray.ObjectRef:
        """Resolves to the CheckpointInfo of step n once it is complete on storage."""
        scheduled = ckpt.scheduled_steps(self._typed)
        if n not in scheduled:  # runner.max_epochs may end the run, and checkpoint it, earlier
            scheduled = ray.get(self._controller.checkpoint_steps.remote(), timeout=30)
        if n not in scheduled:
            raise ValueError(
                f"no checkpoint is scheduled at step {n}; this run checkpoints at "
                f"steps {scheduled} (runner.save_interval, and the last step; none with "
                "runner.save_interval=-1)"
            )
        return self._ref("wait_checkpoint", n)

    def _ref(self, method: str, *args: int) -> ray.ObjectRef:
        """The ObjectRef of the controller's `method(*args)`, made on the first ask only."""
        key = (method, *args)
        if key not in self._refs:
            self._refs[key] = getattr(self._controller, method).remote(*args)
        return self._refs[key]

    def result_ref(self) -> ray.ObjectRef:
        if self._result_ref is None:
            self._result_ref = self._controller.wait_result.remote()
        return self._result_ref

    def result(self, timeout: float | None = None) -> Any:
        """Block until the run ends; return the VerificationReport or raise the run's error."""
        try:
            return ray.get(self.result_ref(), timeout=timeout)
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None
        except ray.exceptions.RayActorError as exc:
            raise self._controller_lost(exc) from None

    def _controller_lost(self, exc: ray.exceptions.RayActorError) -> ComponentError:
        """The controller's process died: its components died with it (Ray fate-shares them
        with their owner), but its placement group lives as long as the Driver's job, so the
        handle removes it, and records the failure the controller could not."""
        error = ComponentError("controller", 0, self._controller_node, death_cause(exc))
        _remove_placement_group(ray_name(self.output_dir, "pg"))
        free_claimed(self.run_id)  # kept processes it held (cluster.keep_processes)
        failure = self.output_dir / FAILURE_JSON
        if not failure.exists():
            RunLog(self.output_dir).info(f"RUN_FAILED error=ComponentError: {error}")
            write_failure(self.output_dir, error, "failed", None)
        return error

    def done(self) -> bool:
        ready, _ = ray.wait([self.result_ref()], timeout=0)
        return bool(ready)

    def status(self) -> dict[str, Any]:
        """state (pending, running, succeeded, failed, cancelled); phase (placement,
        preflight, loading data, memory plan, loading components, step n, validation after step n,
        checkpoint n, postflight, done); steps_done of total_steps; step (the one in
        progress); metrics and stage times of step metrics_step (the last one done); error;
        elapsed_s."""
        return ray.get(self._controller.status.remote(), timeout=30)

    def startup(self) -> dict[str, float]:
        """The run's start-up phases so far, in seconds (run/startup.py: placement, preflight,
        each process's start, load and warm-up, ...): kept out of status(), which stays small."""
        return ray.get(self._controller.startup.remote(), timeout=30)

    def __repr__(self) -> str:
        try:
            status = self.status()
        except Exception as exc:  # the controller is gone: say so, never raise from repr
            return (
                f"RunHandle(run_id={self.run_id!r}, controller unreachable: {type(exc).__name__})"
            )
        return (
            f"RunHandle(run_id={self.run_id!r}, state={status['state']!r}, "
            f"phase={status['phase']!r}, steps_done={status['steps_done']}/"
            f"{status['total_steps']}, output_dir='{self.output_dir}')"
        )

    def _repr_html_(self) -> str:
        """The handle in a notebook: run id, state, phase, steps, the last step's main
        metrics, the complete checkpoints and the directory."""
        import html

        try:
            status = self.status()
        except Exception as exc:  # never raise from a repr
            return f"<pre>{html.escape(repr(self))} ({html.escape(type(exc).__name__)})</pre>"
        metrics = status["metrics"]
        shown = {
            "reward": metrics.get("rollout/reward_scores"),
            "loss": metrics.get("actor/training/actor/final_loss"),
            "grad norm": metrics.get("actor/training/actor/grad_norm"),
            "step seconds": metrics.get("time/step"),
        }
        last = ", ".join(f"{k} {v:.4g}" for k, v in shown.items() if v is not None)
        rows = [
            ("run", self.run_id),
            ("state", f"{status['state']} ({status['phase']})"),
            ("steps done", f"{status['steps_done']} of {status['total_steps']}"),
            (f"step {status['metrics_step']}", last or "-"),
            ("checkpoints", ", ".join(map(str, ckpt.complete_steps(self.output_dir))) or "-"),
            ("directory", str(self.output_dir)),
        ]
        if status["error"]:
            rows.append(("error", status["error"]))
        cells = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
            f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
            for k, v in rows
        )
        return f"<table><caption>RunHandle</caption>{cells}</table>"

    def wait(self, progress: bool = True, timeout: float | None = None, poll_s: float = 1.0) -> Any:
        """Block until the run ends and return its VerificationReport (as `result`), showing a
        progress bar of the steps (tqdm.auto: a widget in a notebook, text elsewhere)."""
        if not progress:
            return self.result(timeout=timeout)
        from tqdm.auto import tqdm

        deadline = None if timeout is None else time.monotonic() + timeout
        status = self.status()
        with tqdm(total=status["total_steps"], desc=self.run_id, unit="step") as bar:
            while not self.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"run {self.run_id} still running after {timeout:g} s")
                status = self.status()
                bar.total = status["total_steps"]
                bar.update(status["steps_done"] - bar.n)
                reward = status["metrics"].get("rollout/reward_scores")
                bar.set_postfix_str(
                    status["phase"] + ("" if reward is None else f", reward {reward:+.3f}")
                )
                time.sleep(poll_s)
            status = self.status()
            bar.update(status["steps_done"] - bar.n)
            bar.set_postfix_str(status["state"])
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.result(timeout=remaining)

    def topology(self) -> list[dict[str, Any]]:
        """Component, rank, bundle, node id, node IP and GPU ids of every process; raises
        TwoWorkerError (saying the phase) before the components have started."""
        try:
            return ray.get(self._controller.topology.remote(), timeout=30)
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    def cancel(self, timeout: float = 60.0) -> None:
        """Stop the run: pending futures raise RunCancelledError; actors and the placement
        group are released."""
        ray.get(self._controller.cancel.remote(), timeout=timeout)
        self._read_outcomes(timeout)

    def _read_outcomes(self, timeout: float) -> None:
        """Read the futures this handle made (they now hold RunCancelledError), so that Ray
        does not print each as an "Unhandled error" traceback when it is dropped: the caller
        cancelled, the error is expected. A caller's own ray.get still raises it."""
        refs = [ref for ref in (self._result_ref, *self._refs.values()) if ref is not None]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 (RunCancelledError, or the run's own failure)
                pass

    def follow(
        self, emit: Callable[[str], None] = print, poll_s: float = 0.5, timeout: float | None = None
    ) -> None:
        """Emit driver.log's lines as they are written, until the run ends."""
        deadline = None if timeout is None else time.monotonic() + timeout
        path, offset = self.output_dir / DRIVER_LOG, 0
        while True:
            finished = self.done()
            with open(path, encoding="utf-8") as handle:
                handle.seek(offset)
                chunk = handle.read()
                offset = handle.tell()
            for line in chunk.splitlines():
                emit(line)
            if finished:
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run_id} still running after {timeout:g} s")
            time.sleep(poll_s)


def _remove_placement_group(name: str) -> None:
    """Remove the live placement group called `name`, whichever namespace made it."""
    from rlinf_twoworker.cluster.placement import live_groups, wait_removed

    for pg, _ in live_groups(lambda group: group == name):
        wait_removed(pg)


def _cause(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The run's own error (ComponentError, PreflightError, ...) without Ray's wrapping."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def run_grpo_two_worker(
    cfg: DictConfig | GRPOConfig,
    *,
    ray_address: str | None = None,
    overrides: Sequence[str] = (),
    component_classes: dict[str, type] | None = None,
    placement_group: Any = None,
) -> RunHandle:
    """Start a GRPO run on the connected (or given) Ray cluster; returns at once with a handle.

    `placement_group`: None (the run creates its own STRICT_SPREAD group and removes it at the
    end), a placement group the caller created, or "current": the group the calling task or
    actor runs in (a Ray Tune trial's, say). A caller's group must be STRICT_SPREAD with
    cluster.num_nodes bundles of cluster.num_gpus_per_node GPUs, bundle 0 on the caller's node,
    and its GPUs free (the caller itself holding none); it is checked here, and the run never
    removes it. `overrides` are recorded in hydra/.hydra/overrides.yaml. `component_classes`
    replaces a component's class (tests inject failing ones). The config becomes the typed
    GRPOConfig here, once; the handle and the controller take it as it is."""
    called_at = time.time()
    cfg = OmegaConf.structured(cfg) if isinstance(cfg, GRPOConfig) else cfg.copy()
    typed = to_typed(cfg)
    config_notes(cfg, typed)  # a refused RLinf value fails here, before anything is created
    output_root = Path(typed.runner.output_dir).resolve()
    cfg.runner.output_dir = str(output_root)
    typed.runner.output_dir = str(output_root)
    run_dir = run_dir_of(output_root, typed.runner.experiment_name)
    for error in escaping_paths(typed):  # hydra.run.dir=../x: refused before anything is made
        raise error
    from rlinf_twoworker.api.request import reward_fn_error  # imports the user's module

    unimportable = reward_fn_error(typed)
    if unimportable is not None:
        raise unimportable
    refuse_existing(run_dir)
    connect(ray_address, typed)
    callers_group = _callers_group(placement_group, typed)  # before anything is written
    run_dir = create_run_dir(cfg, typed, overrides)
    try:  # from here on the run directory exists: it must say why a run never started
        write_lineage(run_dir, typed)  # what resume_dir=auto of a later run compares
        keep_compile_cache_private(cfg, typed, RunLog(run_dir).info)
        ckpt.reclaim_staging(typed, run_dir, RunLog(run_dir).detail)
        controller = _start_controller(
            cfg, typed, run_dir, component_classes, called_at, callers_group
        )
    except BaseException as exc:
        RunLog(run_dir).info(f"RUN_FAILED error={type(exc).__name__}: {exc}")
        write_failure(run_dir, exc, "failed", None)
        raise
    here = ray.get_runtime_context().get_node_id()
    where = f"{ray.util.get_node_ip_address()} node {here[:8]}"
    return RunHandle(controller, cfg, typed, run_dir, controller_node=where)


def _start_controller(
    cfg: DictConfig,
    typed: GRPOConfig,
    run_dir: Path,
    component_classes: dict[str, type] | None,
    called_at: float,
    callers_group: Any,
) -> Any:
    """The run's controller actor on this node, started; killed again when it does not start
    (a late start would run a training nobody holds a handle to)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlinf_twoworker.run.controller import RunController

    here = ray.get_runtime_context().get_node_id()
    controller: Any = (
        ray.remote(RunController)
        .options(
            name=ray_name(run_dir, "controller", 0),
            namespace=NAMESPACE,
            num_cpus=0,
            max_concurrency=1000,
            max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            **_controller_env(typed),
        )
        .remote(cfg, typed, str(run_dir), component_classes, called_at, callers_group)
    )
    try:
        ray.get(controller.start.remote(), timeout=typed.runner.timeouts.actor_start_s)
    except Exception as exc:
        ray.kill(controller, no_restart=True)
        raise TwoWorkerError(
            f"the run controller did not start on this node: {exc}; {run_dir}/failure.json "
            "records it: start a new run with a new RUN_ID"
        ) from exc
    return controller


def _controller_env(typed: GRPOConfig) -> dict[str, Any]:
    """The Driver's WANDB_*/MLFLOW_* variables for the controller's process, when the run logs
    to wandb or MLflow (run/metric_loggers.py): Ray starts it with the node's environment."""
    from rlinf_twoworker.run.metric_loggers import forwarded_env

    env = forwarded_env(typed.runner.logger.logger_backends)
    return {"runtime_env": {"env_vars": env}} if env else {}


def _callers_group(placement_group: Any, typed: GRPOConfig) -> Any:
    """The caller's placement group, checked against the config (None: the run makes its own)."""
    if placement_group is None:
        return None
    if typed.cluster.keep_processes:
        raise TwoWorkerError(
            "cluster.keep_processes=true keeps the run's own placement group and processes for "
            f"the next run, but placement_group={placement_group!r} gives the caller's group, "
            "which the run never keeps: drop one of the two"
        )
    from rlinf_twoworker.cluster.placement import callers_group_problems

    if isinstance(placement_group, str):
        if placement_group != "current":
            raise TwoWorkerError(
                f"placement_group={placement_group!r}: give a placement group, 'current' or None"
            )
        placement_group = ray.util.get_current_placement_group()
        if placement_group is None:
            raise TwoWorkerError(
                "placement_group='current', but the caller does not run in a placement group; "
                "schedule the calling task or actor in one (PlacementGroupSchedulingStrategy), "
                "pass the group itself, or leave placement_group unset"
            )
    timeout = typed.runner.timeouts.placement_s
    ready, _ = ray.wait([placement_group.ready()], timeout=timeout)
    if not ready:
        raise TwoWorkerError(
            f"the caller's placement group {placement_group.id.hex()[:8]} was not ready within "
            f"{timeout:g} s (runner.timeouts.placement_s); check that the cluster can place it"
        )
    problems = callers_group_problems(placement_group, typed.cluster)
    if problems:
        raise TwoWorkerError(
            f"the caller's placement group {placement_group.id.hex()[:8]} does not fit the "
            f"config: {'; '.join(problems)}. Create it as the config asks (or change "
            "cluster.num_nodes / cluster.num_gpus_per_node), or leave placement_group unset"
        )
    return placement_group
