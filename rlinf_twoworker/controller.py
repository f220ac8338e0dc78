"""The run controller: an async Ray actor on the Driver's node that owns one run.

It builds the placement group, runs preflight, starts the components, trains, checkpoints and
verifies; meanwhile it answers the handle's futures (`wait_step`, `wait_checkpoint`, ...). A
failure or a cancellation resolves every pending future with that error, kills the run's
actors and removes its placement group, so no future hangs and nothing is left holding GPUs.
"""

from __future__ import annotations

import asyncio
import os
import time
import traceback
from pathlib import Path
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf

from rlinf_twoworker import checkpoint as ckpt
from rlinf_twoworker.components import ComponentGroup
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.data import PromptSampler, encode_prompts, load_jsonl
from rlinf_twoworker.errors import RunCancelledError
from rlinf_twoworker.grpo_step import run_step, sync_weights
from rlinf_twoworker.liveness import liveness_error, root_cause
from rlinf_twoworker.metrics import MetricsWriter
from rlinf_twoworker.models import load_tokenizer
from rlinf_twoworker.placement import (
    bundle_node_ids,
    placement_timeout_error,
    request_placement_group,
    resolve_placement,
    wait_removed,
)
from rlinf_twoworker.results import CheckpointInfo, StepResult
from rlinf_twoworker.rundir import RunLog, write_failure


class _Future:
    """A value that resolves once, or fails with the run's error."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.value: Any = None

    def set(self, value: Any) -> None:
        self.value = value
        self.event.set()


class RunController:
    def __init__(self, cfg: DictConfig, run_dir: str, classes: dict | None = None) -> None:
        self.raw_cfg = cfg
        self.cfg = to_typed(cfg)
        self.run_dir = Path(run_dir)
        self.run_id = self.cfg.runner.experiment_name
        self.log = RunLog(self.run_dir)
        self.classes = classes
        self.steps = {n: _Future() for n in range(1, self.cfg.runner.max_steps + 1)}
        self.checkpoints = {n: _Future() for n in ckpt.scheduled_steps(self.cfg)}
        self.preflight_f, self.result_f, self.placement_f = _Future(), _Future(), _Future()
        self.error: BaseException | None = None
        self.detected: BaseException | None = None  # a death the watchdog saw
        self.bundle_nodes: list[str] = []
        self.samples: list[Any] = []
        self.group: ComponentGroup | None = None
        self.pg: Any = None
        self.task: asyncio.Task | None = None
        self.state = "pending"
        self.current_step = 0
        self.resume_step = 0
        self.resume_from: Path | None = None
        self.last: dict[str, float] = {}
        self.started_at = time.time()

    # ---- the handle's view -------------------------------------------------------------
    async def start(self) -> bool:
        self.task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def _await(self, future: _Future, timeout: float | None = None) -> Any:
        await asyncio.wait_for(future.event.wait(), timeout)
        if future.value is None and self.error is not None:
            raise self.error
        return future.value

    async def wait_step(self, n: int) -> StepResult:
        return await self._await(self.steps[n])

    async def wait_checkpoint(self, n: int) -> CheckpointInfo:
        return await self._await(self.checkpoints[n])

    async def wait_preflight(self) -> Any:
        return await self._await(self.preflight_f)

    async def wait_result(self) -> Any:
        return await self._await(self.result_f)

    async def placement_group(self) -> Any:
        return await self._await(self.placement_f)

    def topology(self) -> list[dict[str, Any]]:
        return [p.to_dict() for p in self.group.topology()] if self.group else []

    def status(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "state": self.state,
            "step": self.current_step,
            "max_steps": self.cfg.runner.max_steps,
            "metrics": dict(self.last),
            "error": None if self.error is None else str(self.error),
            "elapsed_s": time.time() - self.started_at,
            "controller_pid": os.getpid(),
        }

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
            self.state = "running"
            await self._setup()
            await self._train()
            watchdog.cancel()  # before the components are released on purpose
            report = await self._finish()
            self.state = "succeeded" if report.passed else "failed"
            self.result_f.set(report)
        except asyncio.CancelledError:
            if self.detected is not None:  # the watchdog stopped the run: a death, not a cancel
                failure = (self.detected, "failed")
            else:
                failure = (RunCancelledError(f"run {self.run_id} was cancelled"), "cancelled")
        except BaseException as exc:  # every failure must resolve the futures
            watchdog.cancel()
            failure = (exc, "failed")
            failure = (await root_cause(self.group, exc, self._poll_s), "failed")
        finally:
            watchdog.cancel()
            if self.group is not None:
                self.group.stop_watch()
            try:  # release first: when a future raises, the cluster is already free
                await asyncio.to_thread(self._release)
            finally:
                if failure is not None:
                    self._fail(*failure)

    async def _setup(self) -> None:
        from rlinf_twoworker.preflight import run_preflight

        cfg, timeouts = self.cfg, self.cfg.runner.timeouts
        placement = resolve_placement(cfg.cluster)
        name = f"{self.run_id}:pg"
        self.pg = request_placement_group(cfg.cluster, name)  # set first: release finds it
        try:
            await asyncio.wait_for(self.pg.ready(), timeouts.placement_s)
        except asyncio.TimeoutError:
            raise placement_timeout_error(cfg.cluster, name, timeouts.placement_s) from None
        places = await asyncio.to_thread(_bundle_places, self.pg)
        self.bundle_nodes = [p["node_id"] for p in places]
        self.placement_f.set(self.pg)
        report = await asyncio.to_thread(run_preflight, cfg, self.pg, self.run_dir, self.log.status)
        self.preflight_f.set(report)
        data = cfg.data  # bad data fails the run here, before any model is loaded
        self.samples = await asyncio.to_thread(
            load_jsonl,
            data.train_data_paths,
            data.prompt_key,
            data.answer_key,
            data.skip_malformed_lines,
            lambda note: self.log.info(f"DATA_WARNING {note}"),
        )
        group = ComponentGroup(
            cfg, self.run_id, placement, self.pg, self.classes, bundle_nodes=places
        )
        self.group = group  # set first: release and the watchdog find it
        group.start()
        await group.wait_started()
        await self._join_process_groups(group)
        for row in group.topology():
            self.log.info(
                f"COMPONENT {row.component}:{row.rank} bundle={row.bundle} "
                f"node={row.node_id[:8]} ip={row.node_ip} gpus={row.gpu_ids}"
            )

    async def _join_process_groups(self, group: ComponentGroup) -> None:
        timeout = self.cfg.runner.timeouts.collective_s
        actors = group.actors()
        consumers = [group.one("rollout"), group.one("inference")]
        members = actors + consumers
        master = await group.call(
            actors[0], "rendezvous_address", timeout=timeout, stage="rendezvous"
        )
        actor_ranks = list(range(len(actors)))
        consumer_ranks = [len(actors), len(actors) + 1]
        shared = group.shared_gpus()
        args = [
            (tuple(master), i, len(members), actor_ranks, consumer_ranks, shared)
            for i in range(len(members))
        ]
        await group.call_each(
            members, "join", timeout=timeout, stage="process group", per_member=args
        )
        await group.call_each(
            actors, "build", timeout=self.cfg.runner.timeouts.actor_start_s, stage="actor build"
        )
        self.resume_from = ckpt.resume_source(self.cfg, self.run_dir)
        if self.resume_from is not None:
            self.resume_step = await ckpt.restore(group, self.cfg, self.resume_from, self.log)
        await sync_weights(group, self.cfg)  # rollout and inference start from the actor

    async def _train(self) -> None:
        cfg, group, source = self.cfg, self.group, self.resume_from
        if group is None:
            raise RuntimeError("training started before the components (a library bug)")
        data, samples = cfg.data, self.samples
        tokenizer = load_tokenizer(cfg.tokenizer_path)
        sampler = PromptSampler(len(samples), data.rollout_batch_size, data.shuffle, data.seed)
        if source is not None:
            sampler.load_state_dict(ckpt.load_data_state(source)["sampler"])
            for step in range(1, self.resume_step + 1):  # steps done by the run resumed from
                self.steps[step].set(StepResult(step, {}, {}))
                if step in self.checkpoints:
                    self.checkpoints[step].set(ckpt.inherited_info(source, step))
        writer = MetricsWriter(self.run_dir)
        try:
            for step in range(self.resume_step + 1, cfg.runner.max_steps + 1):
                self.current_step = step
                indices = sampler.next_batch()
                prompts = encode_prompts(
                    tokenizer,
                    [samples[i].prompt for i in indices],
                    data.max_prompt_length,
                    log=self.log.info,
                )
                result = await run_step(
                    group, cfg, step, prompts, [samples[i].solutions for i in indices]
                )
                self.last = {**result.metrics, **result.timings}
                writer.write(step, self.last)
                self.log.info(_step_line(step, cfg.runner.max_steps, result))
                self.steps[step].set(result)
                if step in self.checkpoints:
                    info = await ckpt.save(
                        group,
                        cfg,
                        self.run_dir,
                        step,
                        {"sampler": sampler.state_dict(), "step": step},
                    )
                    self.log.info(f"CHECKPOINT step={step} dir={info.directory}")
                    self.checkpoints[step].set(info)
        finally:
            writer.close()
        self.log.info(f"Step limit given by max_steps={cfg.runner.max_steps} reached. Stopping run")
        self.log.status("RLINF_PYTHON_EXIT_CODE=0")

    async def _finish(self) -> Any:
        from rlinf_twoworker.verify import verify_run

        await asyncio.to_thread(self._release)
        placement = cast(
            dict[str, Any], OmegaConf.to_container(self.raw_cfg.cluster.component_placement)
        )
        return await asyncio.to_thread(
            verify_run,
            self.run_dir,
            self.cfg.runner.max_steps,
            self.cfg.cluster.num_nodes,
            log=self.log.status,
            expected_placement=placement,
        )

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
            error = await liveness_error(self.group, self.bundle_nodes, self.run_id)
            if error is not None and self.task is not None:
                self.detected = error
                self.task.cancel()
                return

    # ---- failure and clean-up ----------------------------------------------------------------
    def _fail(self, exc: BaseException, state: str) -> None:
        self.error, self.state = exc, state
        detail = "".join(traceback.format_exception(exc)) if state == "failed" else str(exc)
        summary = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        self.log.info(f"RUN_{state.upper()} error={type(exc).__name__}: {summary}")
        with open(self.run_dir / "log" / "main.log", "a", encoding="utf-8") as handle:
            handle.write(detail + "\n")
        write_failure(self.run_dir, exc, state, self.current_step)
        for future in [
            *self.steps.values(),
            *self.checkpoints.values(),
            self.preflight_f,
            self.result_f,
            self.placement_f,
        ]:
            if not future.event.is_set():
                future.event.set()

    def _release(self) -> None:
        if self.group is not None:
            self.group.kill()
        if self.pg is not None:
            wait_removed(self.pg)


def _bundle_places(pg: Any) -> list[dict[str, str]]:
    """Node id and IP of each bundle of the placement group, by bundle index."""
    import ray

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    return [{"node_id": n, "ip": ips.get(n, "?")} for n in bundle_node_ids(pg)]


def _step_line(step: int, max_steps: int, result: StepResult) -> str:
    m, t = result.metrics, result.timings
    return (
        f"STEP {step}/{max_steps} reward={m['rollout/reward_scores']:.4f} "
        f"loss={m['actor/training/actor/final_loss']:.6f} "
        f"grad_norm={m['actor/training/actor/grad_norm']:.4f} "
        f"lr={m['actor/training/actor/lr']:.3g} time={t['time/step']:.2f}s "
        f"(rollout {t['time/rollout']:.2f}s, actor {t['time/actor/training']:.2f}s, "
        f"sync {t['time/sync_weights']:.2f}s)"
    )
