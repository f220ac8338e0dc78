"""The run loop's observers, each on its own: driven through their points with real step
results, writing real files (no cluster: each reads only what it is given)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path

import pytest
from support import varied_batch

from rlinf_twoworker.config import GRPOConfig, load_config, to_typed
from rlinf_twoworker.results import StepResult
from rlinf_twoworker.run.observers import (
    LATE_COMPILE_S,
    PaddingHint,
    StepCompileTime,
    StepLine,
    TensorBoard,
    step_line,
)
from rlinf_twoworker.run.step import real_token_share
from rlinf_twoworker.run.storage_io import StorageIO
from rlinf_twoworker.run.tasks import background, in_daemon_thread
from rlinf_twoworker.storage.metrics import event_files, read_scalars


def _result(step: int, reward: float) -> StepResult:
    metrics = {
        "rollout/reward_scores": reward,
        "actor/training/actor/final_loss": -0.5 * step,
        "actor/training/actor/grad_norm": 1.0,
        "actor/training/actor/lr": 1e-6,
    }
    timings = {"time/step": 2.0, "time/rollout": 1.0, "time/actor/training": 0.8}
    timings["time/sync_weights"] = 0.1
    minibatches = [{"actor/training/actor/final_loss": -0.5 * step}]
    return StepResult(step, metrics, timings, minibatches=minibatches)


@pytest.fixture
def run(tmp_path: Path):
    cfg = to_typed(
        load_config(overrides=[f"runner.output_dir={tmp_path}", "runner.experiment_name=observed"])
    )
    (cfg.run_dir / "log").mkdir(parents=True)
    return cfg, StorageIO(cfg.run_dir, "observed")


def test_tensorboard_writes_each_steps_scalars_at_its_step(run):
    cfg, io = run
    observer = TensorBoard(io, cfg, total_steps=2)

    async def drive() -> None:
        await observer.training_begins()
        for step, reward in ((1, 0.25), (2, 0.75)):
            await observer.step_done(step, _result(step, reward))
        await observer.training_ends()
        await io.call(lambda: None)  # after the queued close

    asyncio.run(drive())
    scalars = read_scalars(event_files(cfg.run_dir))
    assert scalars["rollout/reward_scores"] == {1: 0.25, 2: 0.75}
    assert scalars["time/step"] == {1: 2.0, 2: 2.0}


def test_the_step_line_goes_to_the_runs_log(run):
    cfg, io = run
    result = _result(1, 0.5)

    async def drive() -> None:
        await StepLine(io.log, total_steps=2).step_done(1, result)
        await io.call(lambda: None)

    asyncio.run(drive())
    line = step_line(1, 2, result)
    assert line.startswith("STEP 1/2 reward=0.5000 loss=-0.500000 ")
    assert "(rollout 1.00s, actor 0.80s, sync 0.10s)" in line
    assert line in (cfg.run_dir / "log" / "main.log").read_text()


def test_the_padding_hint_speaks_once_when_the_forwards_compute_mostly_padding(run):
    """From step 2, once, where the real tokens are under PADDING_HINT_BELOW of the batches
    and the length-aware cut is off; never where it is on. The share is the metric the step
    computes from its batches (step.real_token_share)."""
    cfg, io = run
    short = varied_batch((4, 6), (3, 20), 8, 24)  # 33 real tokens of 64 columns
    full = varied_batch((8, 8), (24, 24), 8, 24)
    assert real_token_share([short]) == pytest.approx(33 / 64)
    assert real_token_share([short, full]) == pytest.approx((33 + 64) / 128)

    def with_share(step: int, share: float) -> StepResult:
        result = _result(step, 0.5)
        result.metrics["throughput/real_token_share"] = share
        return result

    async def drive(observer: PaddingHint) -> None:
        for step, share in ((1, 0.3), (2, 0.9), (3, 0.5), (4, 0.4)):
            await observer.step_done(step, with_share(step, share))
        await io.call(lambda: None)

    def config(trim: int) -> GRPOConfig:
        return to_typed(
            load_config(
                overrides=[
                    f"runner.output_dir={cfg.runner.output_dir}",
                    "runner.experiment_name=observed",
                    f"runner.trim_padding_multiple={trim}",
                ]
            )
        )

    asyncio.run(drive(PaddingHint(io.log, config(0))))
    log = (cfg.run_dir / "log" / "main.log").read_text()
    assert log.count("PERF_HINT") == 1
    assert "PERF_HINT step 3: real tokens are 50% of the rows" in log
    assert "runner.trim_padding_multiple=128" in log
    asyncio.run(drive(PaddingHint(io.log, config(128))))
    assert (cfg.run_dir / "log" / "main.log").read_text().count("PERF_HINT") == 1


def test_each_steps_compile_seconds_and_a_later_step_that_compiles_is_logged(run):
    """compile/<component>/<rank>/seconds is each process's torch.compile time during the
    step, from the running totals its process reports after each step; a process that never
    compiles (the reward) gets none. From step 2 on, a process that compiled for
    LATE_COMPILE_S or more says so in main.log, once for that step."""
    cfg, io = run
    record = StepCompileTime(io.log)
    steps = {
        1: {"actor/0": 14.0, "inference/0": 3.0, "reward/0": 0.0},
        2: {"actor/0": 14.0 + LATE_COMPILE_S / 2, "inference/0": 3.0, "reward/0": 0.0},
        3: {"actor/0": 19.5, "inference/0": 3.0, "reward/0": 0.0},
    }
    seen = {}
    for step, totals in steps.items():
        result = _result(step, 0.5)
        record.record(step, step == 1, totals, result)
        seen[step] = {k: v for k, v in result.metrics.items() if k.startswith("compile/")}
    asyncio.run(io.call(lambda: None))  # after the queued log lines
    assert seen[1] == {"compile/actor/0/seconds": 14.0, "compile/inference/0/seconds": 3.0}
    assert seen[2]["compile/actor/0/seconds"] == pytest.approx(LATE_COMPILE_S / 2)
    assert seen[3] == {
        "compile/actor/0/seconds": pytest.approx(5.5 - LATE_COMPILE_S / 2),
        "compile/inference/0/seconds": 0.0,
    }
    log = (cfg.run_dir / "log" / "main.log").read_text()
    assert log.count("COMPILED") == 1
    assert "COMPILED step 3 actor:0: 5.0 s in torch.compile" in log


def test_background_work_that_nobody_awaits_never_loses_its_error():
    reported: list[dict] = []

    async def fails() -> None:
        raise RuntimeError("lost?")

    async def drive() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        future = background(fails())
        await asyncio.sleep(0.05)
        assert future.done() and isinstance(future.exception(), RuntimeError)
        del future
        gc.collect()

    asyncio.run(drive())
    assert reported == []  # retrieved: asyncio reports no "exception was never retrieved"

    async def unretrieved() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        asyncio.ensure_future(fails())  # the way background avoids
        await asyncio.sleep(0.05)
        gc.collect()

    asyncio.run(unretrieved())
    assert reported and "never retrieved" in reported[0]["message"]


def test_a_hanging_release_is_left_in_a_daemon_thread_and_a_failing_one_raises():
    """The run's release (a call to Ray's GCS, which hangs once the cluster is gone) runs in a
    daemon thread: the wait ends at its limit, and the thread, still blocked, cannot hold the
    process at its exit (asyncio's executor threads are joined there)."""
    blocked, release = threading.Event(), threading.Event()

    def hang() -> None:
        blocked.set()
        release.wait()

    start = time.monotonic()
    assert asyncio.run(in_daemon_thread(hang, "release", 0.3)) is False
    assert 0.3 <= time.monotonic() - start < 5 and blocked.is_set()
    [left] = [t for t in threading.enumerate() if t.name == "rlinf-release"]
    assert left.daemon and left.is_alive()
    release.set()
    left.join(5)

    assert asyncio.run(in_daemon_thread(lambda: None, "release", 5)) is True

    def fail() -> None:
        raise RuntimeError("the group could not be killed")

    with pytest.raises(RuntimeError, match="could not be killed"):
        asyncio.run(in_daemon_thread(fail, "release", 5))
