"""Durable checkpoints: written under a temporary name, renamed only when complete.

Layout (RLinf's): checkpoints/global_step_<N>/actor/dcp_checkpoint/{.metadata,__<r>_<i>.distcp}
(rank r's shard in runner.checkpoint_write_threads files i; RLinf writes one, i = 0)
with a top-level `fsdp_checkpoint` key holding model, optimizers, lr_schedulers and rng; and
checkpoints/global_step_<N>/data/data.pt with the data sampler's state. A directory under its
final name is complete by construction: every shard, .metadata and data.pt were written and
flushed before the rename. Resuming trusts a directory only after `checkpoint_problems` finds
nothing wrong with its files (readback.py reads one back without Ray).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import CheckpointReadError, TwoWorkerError
from rlinf_twoworker.results import CheckpointInfo
from rlinf_twoworker.storage.rundir import (
    FAILURE_JSON,
    VERIFICATION_JSON,
    checkpoint_dir,
    complete_checkpoint_steps,
    pruning_checkpoint_dir,
    stale_checkpoint_dirs,
)

DCP_SUBDIR = Path("actor") / "dcp_checkpoint"
DATA_FILE = Path("data") / "data.pt"
HF_SUBDIR = Path("actor") / "huggingface"  # with runner.save_full_weights
FULL_WEIGHTS = Path("actor") / "model_state_dict" / "full_weights.pt"
"""RLinf's full-model file (actor.fsdp_config.save_full_model_weights)."""
METADATA = ".metadata"
MODEL_PREFIX = "fsdp_checkpoint.model."
"""DCP key prefix of the actor's model weights (keys are flattened with dots)."""
RESUMED_FROM_JSON = "resumed_from.json"
FULL_STORAGE_BYTES = 256 * 2**20
"""A failed write with less than this free under the checkpoint is reported as a full storage."""


def full_storage(path: str | Path) -> tuple[int, int] | None:
    """(free, total) bytes of the storage under `path` when it is (nearly) full, else None."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return None
    return (usage.free, usage.total) if usage.free < FULL_STORAGE_BYTES else None


def write_error(path: str | Path, exc: BaseException) -> BaseException:
    """The error to raise for a checkpoint write that failed with `exc`: when the storage under
    `path` is full, one that says so and what to do (torch's own message for it is an archive
    writer's position check); otherwise `exc` itself."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return exc
    full = full_storage(path)
    if full is None:
        return exc
    free, total = full
    # One line (DCP's own message carries every rank's traceback): its last line says what.
    said = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return TwoWorkerError(
        f"checkpoint write to {path} failed: the storage under it is full "
        f"({free / 2**20:.0f} MiB free of {total / 2**30:.1f} GiB; "
        f"{said[-1] if said else type(exc).__name__}); free space there or point "
        "runner.output_dir at larger storage (the incomplete checkpoint is removed)"
    )


def scheduled_steps(cfg: GRPOConfig, last: int | None = None) -> list[int]:
    """Steps that get a checkpoint, as RLinf decides: every save_interval steps and the last
    step (runner.max_steps, or `last` when the epochs end the run earlier); none with
    save_interval <= 0 (RLinf's -1)."""
    last = cfg.runner.max_steps if last is None else last
    interval = cfg.runner.save_interval
    if interval <= 0:
        return []
    return sorted(set(range(interval, last + 1, interval)) | {last})


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fsync_dir(directory)


def files_of(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(run_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all). Each is first
    renamed away (`.global_step_<N>.pruning`, the rename made durable), then deleted: a crash
    at any moment leaves `global_step_<N>` complete or absent, never half deleted; what is
    left under the away name is reclaimed at a later run's start (`reclaim_staging`)."""
    steps = complete_steps(run_dir)
    if keep_last <= 0 or len(steps) <= keep_last:
        return []
    doomed = steps[:-keep_last]
    for step in doomed:
        away = pruning_checkpoint_dir(run_dir, step)
        if away.exists():  # an earlier prune of this step crashed mid-delete
            shutil.rmtree(away)
        os.rename(checkpoint_dir(run_dir, step), away)
        fsync_dir(away.parent)
        shutil.rmtree(away)
    return doomed


def reclaim_staging(cfg: GRPOConfig, run_dir: Path, log: Callable[[str], None]) -> list[Path]:
    """At a run's start, delete what failed runs left half written: the `.incomplete` staging
    and `.pruning` directories under `checkpoints/` of the runs this run may read from (the
    other runs under runner.output_dir, which resume_dir=auto searches, and the run that
    runner.resume_dir names). Only runs that have ended (failure.json or verification.json)
    are touched: a live run may still be writing its staging directory. Returns what was
    removed; a directory that cannot be removed is logged and left, never fatal."""
    here = Path(run_dir).resolve()
    output_root = Path(cfg.runner.output_dir)
    runs = [p for p in sorted(output_root.iterdir()) if p.is_dir()] if output_root.is_dir() else []
    resume = cfg.runner.resume_dir
    if resume and resume != "auto":
        named = Path(resume)
        runs.append(named.parent.parent if named.name.startswith("global_step_") else named)
    removed = []
    for run in dict.fromkeys(r.resolve() for r in runs):
        if run == here or not any((run / f).is_file() for f in (FAILURE_JSON, VERIFICATION_JSON)):
            continue
        for stale in stale_checkpoint_dirs(run):
            try:
                shutil.rmtree(stale)
            except OSError as exc:
                log(f"RECLAIM_FAILED {stale}: {exc}; delete it by hand to free its space")
                continue
            log(f"RECLAIMED {stale} (left half written by an ended run)")
            removed.append(stale)
    return removed


# ---- finding complete checkpoints ---------------------------------------------------------


def read_metadata(dcp_dir: Path) -> Any:
    """The DCP `.metadata` of `dcp_dir`, read by the allow-list unpickler of safe_dcp.py (the
    file may come from anyone who can write the shared storage); raises CheckpointReadError
    naming the file (UnsafeCheckpointError, one of them, for a file that is not DCP's)."""
    from rlinf_twoworker.storage.safe_dcp import UnsafeCheckpointError, unpickle_metadata

    path = Path(dcp_dir) / METADATA
    if not path.is_file() or path.stat().st_size == 0:
        raise CheckpointReadError(f"{path} is missing or empty: the checkpoint was not finished")
    try:
        return unpickle_metadata(path)
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # truncated or damaged pickle: one line naming the file
        raise CheckpointReadError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}): the file is damaged"
        ) from exc


def dcp_problems(dcp_dir: Path) -> list[str]:
    """What makes a DCP directory unloadable, judged from its files: an unreadable .metadata,
    a shard it names that is missing or shorter than the bytes it must hold."""
    try:
        metadata = read_metadata(dcp_dir)
    except CheckpointReadError as exc:
        return [str(exc)]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, size in sorted(needed.items()):
        shard = Path(dcp_dir) / name
        if not shard.is_file():
            problems.append(f"shard {shard} named in {METADATA} is missing")
        elif shard.stat().st_size < size:
            problems.append(
                f"shard {shard} has {shard.stat().st_size} bytes but {METADATA} needs {size}: "
                "the file is truncated"
            )
    return problems


def checkpoint_problems(checkpoint: Path) -> list[str]:
    """Empty when `checkpoints/global_step_<N>` can be resumed from: DCP files and data.pt."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        return [f"checkpoint directory {checkpoint} does not exist"]
    problems = dcp_problems(checkpoint / DCP_SUBDIR)
    data = checkpoint / DATA_FILE
    if not data.is_file() or data.stat().st_size == 0:
        problems.append(f"{data} is missing or empty: the data order cannot be restored")
    return problems


def complete_steps(run_dir: Path) -> list[int]:
    """Steps whose checkpoint is under its final name and whose files are all there."""
    return [
        step
        for step in complete_checkpoint_steps(run_dir)
        if not checkpoint_problems(checkpoint_dir(run_dir, step))
    ]


def last_complete(run_dir: Path) -> Path | None:
    steps = complete_steps(run_dir)
    return checkpoint_dir(run_dir, steps[-1]) if steps else None


def _finished_at(checkpoint: Path) -> float:
    return (checkpoint / DCP_SUBDIR / METADATA).stat().st_mtime


def resume_source(cfg: GRPOConfig, run_dir: Path) -> Path | None:
    """The checkpoint directory to resume from, or None. 'auto' takes, among the other runs
    under runner.output_dir of this run's lineage (lineage.py; named by runner.resume_prefix or
    runner.resume_runs when set), the newest complete checkpoint (staging `.incomplete`
    directories and checkpoints with missing files are never taken); a path may be a run
    directory or a global_step_<N> directory."""
    value = cfg.runner.resume_dir
    if not value:
        return None
    if value == "auto":
        return _auto_source(cfg, Path(run_dir))
    path = Path(value)
    if path.name.startswith("global_step_"):
        problems = checkpoint_problems(path)
        if problems:
            raise TwoWorkerError(
                f"runner.resume_dir={value} cannot be resumed from: {problems[0]}; choose a "
                "complete checkpoint, or give its run directory to take the newest complete one"
            )
        return path
    found = last_complete(path)
    if found is None:
        raise TwoWorkerError(
            f"runner.resume_dir={value}: no complete checkpoint there "
            "(checkpoints/global_step_<N>/ with actor/dcp_checkpoint/.metadata, its shards "
            "and data/data.pt)"
        )
    return found


def _auto_source(cfg: GRPOConfig, run_dir: Path) -> Path:
    from rlinf_twoworker.storage.lineage import lineage_of, lineage_problems

    output_root, runner = Path(cfg.runner.output_dir), cfg.runner
    here = run_dir.resolve()
    named = [
        p
        for p in (sorted(output_root.iterdir()) if output_root.is_dir() else [])
        if p.is_dir()
        and not p.name.startswith(".")
        and p.resolve() != here
        and (runner.resume_prefix is None or p.name.startswith(runner.resume_prefix))
        and (not runner.resume_runs or p.name in runner.resume_runs)
    ]
    mine, candidates, refused = lineage_of(cfg), [], []
    for run in named:  # the lineage first: a run of another one is never opened further
        problems = lineage_problems(run, mine)
        if problems:
            refused.append(f"run {run.name}: {'; '.join(problems)}")
        elif (found := last_complete(run)) is not None:
            candidates.append(found)
    if not candidates:
        which = (f" named {runner.resume_runs}" if runner.resume_runs else "") + (
            f" starting with {runner.resume_prefix!r}" if runner.resume_prefix else ""
        )
        why = f"; runs with one not of this lineage: {' | '.join(refused[:5])}" if refused else ""
        raise TwoWorkerError(
            f"runner.resume_dir=auto found no run{which} of this run's lineage with a complete "
            f"checkpoint under {output_root}{why}; auto continues only a run of the same model, "
            "data and training settings: give the run directory to resume from explicitly, "
            "or drop resume_dir"
        )
    return max(candidates, key=lambda c: (_finished_at(c), c.parent.parent.name))


def resume_limit_problem(checkpoint: Path, max_steps: int) -> str | None:
    """Why a run of `max_steps` cannot resume from `checkpoint` (it is not behind), or None:
    the one resume-limit rule."""
    step = step_of(checkpoint)
    if step < max_steps:
        return None
    return (
        f"the resume checkpoint {checkpoint} is at step {step}, but the run stops at "
        f"runner.max_steps={max_steps}: ask for more steps"
    )


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("global_step_"))


def load_data_state(checkpoint: Path) -> dict[str, Any]:
    import torch  # here: the run's controller reads the schedule above without torch

    return torch.load(checkpoint / DATA_FILE, weights_only=True)


def inherited_info(resume_from: Path, step: int) -> CheckpointInfo:
    """A resumed run's checkpoint future for a step done by the run it resumed from: that
    run's checkpoint of the step (files empty when it was pruned or never written)."""
    directory = checkpoint_dir(Path(resume_from).parent.parent, step)
    files = files_of(directory) if directory.is_dir() else {}
    return CheckpointInfo(step=step, directory=str(directory), files=files, finished_at=0.0)
