"""TensorBoard scalars of a run, written once per step by the controller (the last included)."""

from __future__ import annotations

from pathlib import Path

from rlinf_twoworker.storage.rundir import CONFIG_YAML, TENSORBOARD_DIR


class MetricsWriter:
    """Writes `<run dir>/tensorboard/events.out.tfevents.*`; flushes after every step."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR))

    def write(self, step: int, scalars: dict[str, float]) -> None:
        # NaN and inf are written as they are: hiding them would let the postflight pass.
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


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
    """The run's TensorBoard event files, in name order."""
    directory = tensorboard_dir(run_dir)
    return sorted(p for p in directory.rglob("events.out.tfevents.*") if p.is_file())


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
