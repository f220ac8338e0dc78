"""The run directory on shared storage: created once, atomically, never reused.

Layout (SCENARIO.md): driver.log, preflight.json, hydra/.hydra/{config,overrides}.yaml,
log/main.log, tensorboard/, checkpoints/global_step_<N>/{actor/dcp_checkpoint,data/data.pt},
verification.json; and the library's own records beside them: placement.json (where each
component was placed and each process landed), memory_plan.json, failure.json.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock, Timeout
from omegaconf import DictConfig

from rlinf_twoworker.config import GRPOConfig, run_id_problem, to_yaml
from rlinf_twoworker.errors import ComponentError, ConfigError, RunDirError, RunDirExistsError

DRIVER_LOG = "driver.log"
MAIN_LOG = "log/main.log"
CONFIG_YAML = "hydra/.hydra/config.yaml"
OVERRIDES_YAML = "hydra/.hydra/overrides.yaml"
PREFLIGHT_JSON = "preflight.json"
VERIFICATION_JSON = "verification.json"
FAILURE_JSON = "failure.json"
PLACEMENT_JSON = "placement.json"
TENSORBOARD_DIR = "tensorboard"
CHECKPOINTS_DIR = "checkpoints"


def run_dir_of(output_root: str | Path, run_id: str) -> Path:
    """output_root/run_id, refusing ids that could escape output_root."""
    problem = run_id_problem(run_id)
    if problem is not None:
        raise RunDirError(f"RUN_ID {run_id!r} is invalid: it {problem}")
    return Path(output_root).resolve() / run_id


def escaping_paths(typed: GRPOConfig) -> list[ConfigError]:
    """hydra.run.dir, hydra.output_subdir and runner.logger.log_path must lead inside the run
    directory (a relative path is taken from it), outside checkpoints/ (which the library
    renames and deletes): one ConfigError per key that does not. A `..` part is refused by
    name, whatever it resolves to: a run writes only its own directory."""
    run_dir = typed.run_dir.resolve()
    given = [
        ("hydra.run.dir", typed.hydra.run.dir, typed.hydra_record_dir),
        ("hydra.output_subdir", typed.hydra.output_subdir, typed.hydra_record_dir),
        ("runner.logger.log_path", typed.runner.logger.log_path, typed.log_dir),
    ]
    errors = []
    for key, value, lands in given:
        if not value or lands is None:
            continue
        if ".." in Path(value).parts:
            rule = "'..' is refused: a run writes only inside its own run directory"
        elif not lands.resolve().is_relative_to(run_dir):
            rule = f"leads to {lands}, outside the run directory {run_dir}"
        elif lands.resolve().is_relative_to(run_dir / CHECKPOINTS_DIR):
            rule = f"leads to {lands}, inside checkpoints/, which the library renames and prunes"
        else:
            continue
        errors.append(
            ConfigError(
                key,
                value,
                f"{rule}; give a path inside the run directory {run_dir} (a relative path "
                "is taken from it), "
                "or leave it unset",
            )
        )
    return errors


def refuse_existing(run_dir: Path) -> None:
    """RunDirExistsError if `run_dir` exists (a cheap early check; `create_run_dir` is the
    atomic one)."""
    if run_dir.exists():
        raise _exists(run_dir)


def _exists(run_dir: Path) -> RunDirExistsError:
    return RunDirExistsError(
        "runner.experiment_name",
        run_dir.name,
        f"run directory {run_dir} already exists; runs are never reused or overwritten: "
        "choose a new run id (RUN_ID of `rlinf-twoworker run`, --run-id of `demo`, "
        "runner.experiment_name in a config)",
    )


def create_run_dir(cfg: DictConfig, typed: GRPOConfig, overrides: Sequence[str] = ()) -> Path:
    """Create the run directory and write the resolved config; refuse an existing one.

    Safe against two launchers racing on shared storage: a file lock serialises them and
    `os.mkdir` is atomic, so exactly one wins and the loser changes nothing.
    """
    output_root = Path(cfg.runner.output_dir).resolve()
    run_dir = run_dir_of(output_root, cfg.runner.experiment_name)
    try:
        output_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(
            f"cannot create the output root {output_root}: {exc}; check that the "
            "shared storage is mounted and writable"
        ) from exc
    lock = FileLock(str(output_root / f".{run_dir.name}.lock"), timeout=30)
    try:
        with lock:
            try:
                os.mkdir(run_dir)
            except FileExistsError:
                raise _exists(run_dir) from None
            except OSError as exc:
                raise RunDirError(f"cannot create run directory {run_dir}: {exc}") from exc
    except Timeout as exc:
        raise RunDirError(
            f"another launcher holds the lock {lock.lock_file} for more than 30 s; "
            "if none is running, delete the lock file"
        ) from exc
    (run_dir / "log").mkdir()
    (run_dir / MAIN_LOG).touch()
    (run_dir / DRIVER_LOG).touch()
    _write_config(run_dir, cfg, typed, overrides)  # its record dir may be log/: made above
    return run_dir


def _write_config(
    run_dir: Path, cfg: DictConfig, typed: GRPOConfig, overrides: Sequence[str]
) -> None:
    """The resolved config and the overrides in <run dir>/hydra/.hydra/ (the postflight reads
    them there) and, where hydra.run.dir/hydra.output_subdir point elsewhere inside the run
    directory (`escaping_paths` refused the rest), there too."""
    record = typed.hydra_record_dir
    places = [run_dir / "hydra" / ".hydra", *([record] if record is not None else [])]
    for hydra_dir in dict.fromkeys(p.resolve() for p in places):
        hydra_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(hydra_dir / "config.yaml", to_yaml(cfg))
        atomic_write_text(hydra_dir / "overrides.yaml", yaml.safe_dump(list(overrides)))


def atomic_write_text(path: Path, text: str) -> None:
    """Write a file under a temporary name, fsync, rename, then fsync the directory: readers
    never see half of it, and after a crash of the node it is either the old or the new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # two writers never share one
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # the write failed (a full storage): leave no temporary behind
            tmp.unlink()
    fd = os.open(path.parent, os.O_RDONLY)  # the rename itself is durable only then
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_placement(
    run_dir: Path, components: dict[str, dict[str, Any]], processes: list[dict[str, Any]]
) -> None:
    """placement.json, once the components have started: each component's placement as the
    run resolved it (config/placement.placement_record) and each process as it landed (its
    bundle, node id and IP, GPU ids and pid: RunHandle.topology()). The postflight reads the
    placement from here."""
    record = {"components": components, "processes": processes}
    atomic_write_text(run_dir / PLACEMENT_JSON, json.dumps(record, indent=2))


def write_failure(run_dir: Path, exc: BaseException, state: str, step: int | None) -> None:
    """failure.json: state ('failed' or 'cancelled'), the error, its type, the step it hit
    and, for a component's failure, which component, rank and node and why."""
    record: dict[str, object] = {"state": state, "error": str(exc), "type": type(exc).__name__}
    if step is not None:
        record["step"] = step
    if isinstance(exc, ComponentError):
        record.update(component=exc.component, rank=exc.rank, node=exc.node, cause=exc.cause)
    record["time"] = time.time()
    atomic_write_text(run_dir / FAILURE_JSON, json.dumps(record, indent=2))


class RunLog:
    """Appends lines to driver.log and log/main.log (one write per line, O_APPEND)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def _append(self, relative: str, line: str) -> None:
        with open(self.run_dir / relative, "a", encoding="utf-8") as handle:
            handle.write(line.rstrip("\n") + "\n")

    def status(self, line: str) -> None:
        """A status line of the tutorial's interface: driver.log (and main.log)."""
        self._append(DRIVER_LOG, line)
        self._append(MAIN_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")

    def detail(self, line: str) -> None:
        """A line for log/main.log only (start-up phases, compile cache): too fine for the
        Driver's console."""
        self._append(MAIN_LOG, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}")

    def info(self, line: str) -> None:
        """A log line of the run: main.log and driver.log."""
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        self._append(MAIN_LOG, stamped)
        self._append(DRIVER_LOG, line)


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"global_step_{step}"


def staging_checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where a checkpoint is written before its rename to the final name."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".global_step_{step}.incomplete"


def pruning_checkpoint_dir(run_dir: Path, step: int) -> Path:
    """Where a pruned checkpoint is renamed before it is deleted."""
    return Path(run_dir) / CHECKPOINTS_DIR / f".global_step_{step}.pruning"


def stale_checkpoint_dirs(run_dir: Path) -> list[Path]:
    """The staging (`.incomplete`) and pruned (`.pruning`) directories under checkpoints/:
    never complete, so never resumed from; left behind only by a crash."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    return sorted(
        child
        for child in root.iterdir()
        if child.is_dir()
        and child.name.startswith(".global_step_")
        and child.name.endswith((".incomplete", ".pruning"))
    )


def complete_checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps with a checkpoint under its final name (so complete), ascending."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        name = child.name
        if child.is_dir() and name.startswith("global_step_") and name[12:].isdigit():
            steps.append(int(name[12:]))
    return sorted(steps)
