"""TensorBoard scalars of a run, written once per step by the controller (the last included)."""

from __future__ import annotations

from pathlib import Path

from rlinf_twoworker.rundir import TENSORBOARD_DIR


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
