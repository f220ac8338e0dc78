"""What a run reports as it goes, each concern one observer the run loop calls at named points
(as Ray Train's callbacks): the start-up record, the memory metrics, the STEP line, the padding
hint, TensorBoard, Ray's metrics. None of them trains; each reads only what it is given.

The run loop (run/controller.py) calls, in the order of its observer list:

    training_begins()            once, before the first step of this run
    step_begins(step)            before a step's rollout
    step_trained(step, result)   right after the step's update and sync (before validation)
    step_done(step, result)      once the step's metrics are complete (validation included);
                                 an observer may add to result.metrics, later ones see it
    training_ends()              once, after the last step or when training fails
    state_changed(state)         the run's state (ray_metrics.STATES) changed
"""

from __future__ import annotations

from typing import Any

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.run import lifecycle, ray_metrics
from rlinf_twoworker.run.group import ComponentGroup
from rlinf_twoworker.run.head_start import RunHeadStart
from rlinf_twoworker.run.startup import StartupClock
from rlinf_twoworker.run.storage_io import StorageIO
from rlinf_twoworker.storage.metrics import MetricsWriter
from rlinf_twoworker.storage.rlinf_scalars import RlinfLayout
from rlinf_twoworker.storage.rundir import RunLog


class RunObserver:
    """The points of the run loop; each does nothing unless an observer says otherwise."""

    async def training_begins(self) -> None:
        pass

    async def step_begins(self, step: int) -> None:
        pass

    async def step_trained(self, step: int, result: StepResult) -> None:
        pass

    async def step_done(self, step: int, result: StepResult) -> None:
        pass

    async def training_ends(self) -> None:
        pass

    def state_changed(self, state: str) -> None:
        pass


LATE_COMPILE_S = 1.0
"""Seconds in torch.compile during a step after the first from which main.log says so."""


class StepCompileTime:
    """compile/<component>/<rank>/seconds: what each process spent in torch.compile during
    the step (the first step's: since the process started, the compile warm-up included). A
    later step that compiles (a shape or a guard its graphs do not cover) says so in main.log
    (COMPILED), since that explains a slow step."""

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.totals: dict[str, float] = {}  # each process's seconds in torch.compile so far

    def record(self, step: int, first: bool, totals: dict[str, float], result: StepResult) -> None:
        """`totals`: each process's seconds in torch.compile so far, by '<component>/<rank>'."""
        for who, total in sorted(totals.items()):
            if total <= 0 and who not in self.totals:  # compiles nothing (the reward)
                continue
            seconds = max(0.0, total - self.totals.get(who, 0.0))
            self.totals[who] = total
            result.metrics[f"compile/{who}/seconds"] = seconds
            if not first and seconds >= LATE_COMPILE_S:
                self.log.info(
                    f"COMPILED step {step} {who.replace('/', ':')}: {seconds:.1f} s in "
                    "torch.compile for shapes or guards that earlier steps' graphs do not "
                    "cover; the step's time includes it"
                )


class StartupRecord(RunObserver):
    """The start-up clock up to the first step: ready (before the first step), each
    component's preparation and the compile warm-up (awaited after it: they ran beside it),
    the first step's seconds, and the whole start-up as the first step's `startup`. Saves the
    kernels a step compiled to the shared compile cache (runner.compile_cache_root, on GPUs)."""

    def __init__(
        self,
        group: ComponentGroup,
        cfg: GRPOConfig,
        clock: StartupClock,
        log: RunLog,
        warm_up: Any,
        head: RunHeadStart | None,
    ) -> None:
        self.group, self.cfg, self.clock, self.log, self.warm_up = group, cfg, clock, log, warm_up
        self.head = head
        self.first: int | None = None
        self.compile_time = StepCompileTime(log)

    async def step_begins(self, step: int) -> None:
        if self.first is None:
            self.first = step
            self.clock.since_call("ready")

    async def step_trained(self, step: int, result: StepResult) -> None:
        first = step == self.first
        if first:  # done before the step's compiled calls; recorded now
            await lifecycle.prepared(self.head, self.clock, self.log)
            await self.warm_up.finish(self.clock, self.log)
        cfg = self.cfg
        if cfg.compile_cache_root is not None and cfg.cluster.accelerator == "cuda":
            totals = await lifecycle.after_compiled_step(
                self.group, cfg, self.clock, self.log, first
            )
            self.compile_time.record(step, first, totals, result)
        if first:
            self.clock.record("first_step", result.timings["time/step"])
            self.clock.since_call("to_first_step")
            result.startup = dict(self.clock.seconds)


class MemoryMetrics(RunObserver):
    """Every component process's memory during the step (memory/<component>/<rank>/...)."""

    def __init__(self, group: ComponentGroup, cfg: GRPOConfig) -> None:
        self.group, self.cfg = group, cfg

    async def step_done(self, step: int, result: StepResult) -> None:
        result.metrics.update(await lifecycle.memory_metrics(self.group, self.cfg))


class StepLine(RunObserver):
    """The run log's STEP line of each step."""

    def __init__(self, log: RunLog, total_steps: int) -> None:
        self.log, self.total_steps = log, total_steps

    async def step_done(self, step: int, result: StepResult) -> None:
        self.log.info(step_line(step, self.total_steps, result))


PADDING_HINT_BELOW = 0.6
"""PaddingHint speaks when less than this share of the step's batches is real tokens."""


class PaddingHint(RunObserver):
    """One PERF_HINT line in the run log when the forwards compute mostly padding: answers
    of varied length at full width (runner.trim_padding_multiple=0, the default), which the
    length-aware cut would skip. Said once a run, from the second step (the first may be
    unlike the rest)."""

    def __init__(self, log: RunLog, cfg: GRPOConfig) -> None:
        self.log = log
        self.on = cfg.runner.trim_padding_multiple == 0
        self.said = False

    async def step_done(self, step: int, result: StepResult) -> None:
        share = result.metrics.get("throughput/real_token_share")
        if not self.on or self.said or step < 2 or share is None or share >= PADDING_HINT_BELOW:
            return
        self.said = True
        self.log.info(
            f"PERF_HINT step {step}: real tokens are {share:.0%} of the rows the log-prob and "
            "update forwards compute at full width (prompts and answers padded to the longest); "
            "runner.trim_padding_multiple=128 cuts them by length and computes about the real "
            "tokens (the same gradient; the first updates compile a few more shapes), see "
            "docs/performance.md, Settings"
        )


class TensorBoard(RunObserver):
    """The step's scalars under the library's tags, and RLinf's layout beside them
    (storage/rlinf_scalars.py), written on the run's storage thread."""

    def __init__(self, io: StorageIO, cfg: GRPOConfig, total_steps: int) -> None:
        self.io, self.cfg, self.total_steps = io, cfg, total_steps
        self.writer: MetricsWriter | None = None

    async def training_begins(self) -> None:
        layout = RlinfLayout.of(self.cfg, self.total_steps)
        self.writer = await self.io.call(MetricsWriter, self.cfg.log_dir, layout)

    async def step_done(self, step: int, result: StepResult) -> None:
        assert self.writer is not None, "training_begins opens the writer"
        scalars = result.scalars()
        await self.io.call(self.writer.write, step, scalars, result.minibatches)

    async def training_ends(self) -> None:
        if self.writer is not None:  # queued, not awaited: a cancel never waits on storage
            self.io.log.later(self.writer.close)


class RayMetrics(RunObserver):
    """The run's state and each step's scalars in Ray's metrics system (run/ray_metrics.py)."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    async def step_done(self, step: int, result: StepResult) -> None:
        ray_metrics.export_step(self.run_id, step, result.scalars())

    def state_changed(self, state: str) -> None:
        ray_metrics.export_state(self.run_id, state)


def step_line(step: int, total_steps: int, result: StepResult) -> str:
    """`STEP <n>/<total> reward=... loss=... time=...s (rollout ..., actor ..., sync ...)`."""
    m, t = result.metrics, result.timings
    return (
        f"STEP {step}/{total_steps} reward={m['rollout/reward_scores']:.4f} "
        f"loss={m['actor/training/actor/final_loss']:.6f} "
        f"grad_norm={m['actor/training/actor/grad_norm']:.4f} "
        f"lr={m['actor/training/actor/lr']:.3g} "
        + (f"val_reward={m['val/reward_scores']:.4f} " if "val/reward_scores" in m else "")
        + f"time={t['time/step']:.2f}s "
        f"(rollout {t['time/rollout']:.2f}s, actor {t['time/actor/training']:.2f}s, "
        f"sync {t['time/sync_weights']:.2f}s)"
    )
