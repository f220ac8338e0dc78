"""TensorBoard scalars of a run, written once per step by the controller (the last included),
and RLinf's layout of them beside (storage/rlinf_scalars.py)."""

from __future__ import annotations

from pathlib import Path

from rlinf_twoworker.storage.rlinf_scalars import RlinfLayout
from rlinf_twoworker.storage.rundir import CONFIG_YAML, TENSORBOARD_DIR


class MetricsWriter:
    """Writes `<log dir>/tensorboard/events.out.tfevents.*` (the library's tags, x = step) and,
    given `rlinf`, RLinf's tags at RLinf's x in `rlinf.directory`; flushes after every step."""

    def __init__(self, log_dir: Path, rlinf: RlinfLayout | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(log_dir) / TENSORBOARD_DIR))
        self.rlinf = rlinf
        self.rlinf_writer = None if rlinf is None else SummaryWriter(str(rlinf.directory))

    def write(
        self,
        step: int,
        scalars: dict[str, float],
        minibatches: list[dict[str, float]] | None = None,
    ) -> None:
        """The step's scalars (the library's tags); `minibatches`: the actor's metrics of each
        minibatch, for RLinf's layout."""
        # NaN and inf are written as they are: hiding them would let the postflight pass.
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()
        if self.rlinf is None or self.rlinf_writer is None:
            return
        for x, row in self.rlinf.scalars(step, scalars, minibatches or []).items():
            for tag, value in row.items():
                self.rlinf_writer.add_scalar(tag, float(value), global_step=x)
        self.rlinf_writer.flush()

    def close(self) -> None:
        self.writer.close()
        if self.rlinf_writer is not None:
            self.rlinf_writer.close()


def tensorboard_dir(run_dir: str | Path) -> Path:
    """Where the run's TensorBoard files are: <runner.logger.log_path>/tensorboard, as the
    run's record (hydra/.hydra/config.yaml) gives it (a relative one from the run directory, as
    GRPOConfig.log_dir takes it), else <run dir>/tensorboard."""
    import yaml

    try:
        record = yaml.safe_load((Path(run_dir) / CONFIG_YAML).read_text(encoding="utf-8"))
        log_path = record["runner"]["logger"]["log_path"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):  # no record: the default place
        log_path = None
    return Path(run_dir) / (log_path or "") / TENSORBOARD_DIR


def event_files(run_dir: str | Path) -> list[Path]:
    """The run's TensorBoard event files of the library's scalars, in name order: those in
    tensorboard/ itself (its subdirectories hold RLinf's layout, whose x is not the step)."""
    directory = tensorboard_dir(run_dir)
    return sorted(p for p in directory.glob("events.out.tfevents.*") if p.is_file())


def read_scalars(files: list[Path]) -> dict[str, dict[int, float]]:
    """Tag -> step -> value of every scalar in `files`; a step logged twice keeps the value
    with the newest wall time (a resumed run may log a step again)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    newest: dict[str, dict[int, tuple[float, float]]] = {}
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={SCALARS: 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            steps = newest.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                if event.step not in steps or steps[event.step][0] <= event.wall_time:
                    steps[event.step] = (event.wall_time, float(event.value))
    return {tag: {s: v for s, (_, v) in sorted(steps.items())} for tag, steps in newest.items()}
