"""Watching a run: its TensorBoard scalars as a per-step table and a PNG plot, and the Driver's
console (the run's log lines, with a one-line progress display on a terminal).

Only files are read (tensorboard/events.out.tfevents.*), so `report` works on a finished run
from any machine with the shared storage, and on a running one while it writes. matplotlib (a
dependency of the package) is imported only to draw.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.results import STEP_STAGES
from rlinf_twoworker.storage.metrics import event_files, read_scalars, tensorboard_dir
from rlinf_twoworker.storage.rundir import DRIVER_LOG

REWARD = "rollout/reward_scores"
LOSS = "actor/training/actor/final_loss"
GRAD_NORM = "actor/training/actor/grad_norm"
LR = "actor/training/actor/lr"
STAGES = (*STEP_STAGES, "time/step")
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", (REWARD,)),
    ("loss", (LOSS,)),
    ("grad norm", (GRAD_NORM,)),
    ("learning rate", (LR,)),
    ("stage seconds", STAGES),
)
COLUMNS: tuple[tuple[str, str], ...] = (
    ("reward", REWARD),
    ("loss", LOSS),
    ("grad_norm", GRAD_NORM),
    ("lr", LR),
    ("step_s", "time/step"),
)

Scalars = dict[str, dict[int, float]]
"""Tag -> step -> value."""


def load_scalars(run_dir: str | Path) -> Scalars:
    """Every scalar of the run's event files; a step logged twice keeps the newest value."""
    files = event_files(run_dir)
    if not files:
        raise TwoWorkerError(
            f"{tensorboard_dir(run_dir)} holds no events.out.tfevents.* file: the run "
            "has not finished a step yet, or this is not a run directory"
        )
    return read_scalars(files)


def table(scalars: Scalars) -> str:
    """One row a step: reward, loss, grad norm, lr and step seconds."""
    steps = sorted({s for tag in (t for _, t in COLUMNS) for s in scalars.get(tag, {})})
    header = f"{'step':>6} " + " ".join(f"{name:>12}" for name, _ in COLUMNS)
    rows = [header]
    for step in steps:
        cells = [_cell(scalars.get(tag, {}).get(step)) for _, tag in COLUMNS]
        rows.append(f"{step:>6} " + " ".join(f"{c:>12}" for c in cells))
    return "\n".join(rows)


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if math.isfinite(value) and value != 0 else str(value)


def plot(scalars: Scalars, out: str | Path, title: str = "") -> Path:
    """Draw one panel per quantity (reward, loss, grad norm, lr, stage seconds) to a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a cluster node
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise TwoWorkerError(
            "the plot needs matplotlib, which the package depends on but this environment "
            "lacks: pip install matplotlib (or reinstall rlinf_twoworker), or pass --no-plot"
        ) from exc
    out = Path(out)
    figure, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.2 * len(PANELS)), sharex=True)
    for axis, (name, tags) in zip(axes, PANELS, strict=True):
        for tag in tags:
            series = scalars.get(tag, {})
            if series:
                axis.plot(list(series), list(series.values()), marker="o", label=tag)
        axis.set_ylabel(name)
        axis.grid(True, alpha=0.3)
        if len(tags) > 1:
            axis.legend(fontsize="x-small", loc="upper right")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def one_line(text: str) -> str:
    """A multi-line message on one line: lines joined with '; ', a list's '- ' markers dropped,
    and a line that introduces a list (ends with ':') joined by a space."""
    parts = [line.strip().removeprefix("- ") for line in text.splitlines() if line.strip()]
    out = ""
    for part in parts:
        out += part if not out else (" " if out.endswith(":") else "; ") + part
    return out


def progress_line(status: dict[str, Any]) -> str:
    """`2/10 steps done | step 3 | reward -4.38 | loss 0.0121 | step 0.45s | 1m20s` from
    RunHandle.status(): the phase, then the last finished step's metrics."""
    metrics = status.get("metrics") or {}
    total = status.get("total_steps", status.get("max_steps", "?"))
    phase = status.get("phase") or status.get("state")
    parts = [f"{status.get('steps_done', 0)}/{total} steps done", str(phase)]
    for label, tag, unit in (
        ("reward", REWARD, ""),
        ("loss", LOSS, ""),
        ("step", "time/step", "s"),
    ):
        if tag in metrics:
            parts.append(f"{label} {metrics[tag]:.4g}{unit}")
    elapsed = int(status.get("elapsed_s", 0))
    parts.append(f"{elapsed // 60}m{elapsed % 60:02d}s")
    return " | ".join(parts)


class DriverConsole:
    """The Driver's output. Its own lines go to stdout and, once the run directory exists, to
    driver.log; the run's lines are read from driver.log and echoed; on a terminal a `\\r`
    progress line from RunHandle.status() sits under them (plain lines otherwise)."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.tty = self.out.isatty()
        self.log_path: Path | None = None
        self._own: Counter[str] = Counter()  # lines we appended: the tail must not echo them
        self._offset = 0
        self._progress = ""

    def attach(self, run_dir: Path) -> None:
        self.log_path = Path(run_dir) / DRIVER_LOG

    def _write(self, stream: TextIO, text: str) -> None:
        self._clear_progress()
        print(text, file=stream, flush=True)
        if self.log_path is not None:
            self._own[text] += 1
            with open(self.log_path, "a", encoding="utf-8") as handle:
                handle.write(text + "\n")

    def line(self, text: str) -> None:
        self._write(self.out, text)

    def error(self, text: str) -> None:
        """One line, whatever the message: `RLINF_ERROR=<reason>` on stderr."""
        self._write(self.err, "RLINF_ERROR=" + one_line(text))

    def final(self, code: int) -> int:
        self.line(f"STARTUP_EXIT_CODE={code}")
        return code

    def training_exit_code(self, code: int) -> None:
        """A run that failed after its preflight passed still reports how training ended."""
        if self.log_path is None or not self.log_path.is_file():
            return
        text = self.log_path.read_text(encoding="utf-8", errors="replace")
        if "RLINF_PREFLIGHT_STATUS=passed" in text and "RLINF_PYTHON_EXIT_CODE=" not in text:
            self.line(f"RLINF_PYTHON_EXIT_CODE={code}")

    def _echo_new_lines(self) -> None:
        assert self.log_path is not None
        with open(self.log_path, "rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        end = chunk.rfind(b"\n")  # a line still being written waits for the next poll
        if end < 0:
            return
        self._offset += end + 1
        complete = chunk[:end].decode("utf-8", errors="replace")
        for text in complete.split("\n"):
            if self._own[text] > 0:
                self._own[text] -= 1
                continue
            self._clear_progress()
            print(text, file=self.out, flush=True)

    def _show_progress(self, text: str) -> None:
        if self.tty and text != self._progress:
            self.out.write("\r\033[K" + text)
            self.out.flush()
            self._progress = text

    def _clear_progress(self) -> None:
        if self._progress:
            self.out.write("\r\033[K")
            self.out.flush()
            self._progress = ""

    def watch(self, handle: Any, timeout_s: float, poll_s: float = 0.5) -> Any:
        """Echo the run's log until it ends; returns handle.result() (raises the run's error).
        Past `timeout_s` the run is cancelled and TimeoutError raised."""
        deadline = time.monotonic() + timeout_s
        while True:
            finished = handle.done()
            self._echo_new_lines()
            if finished:
                break
            if time.monotonic() > deadline:
                handle.cancel()
                raise TimeoutError(f"run {handle.run_id} still running after {timeout_s:g} s")
            if self.tty:
                try:
                    self._show_progress(progress_line(handle.status()))
                except Exception:  # the display must never fail the run; the log goes on
                    pass
            time.sleep(poll_s)
        self._clear_progress()
        return handle.result(timeout=120)
