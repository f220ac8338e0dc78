"""Durable checkpoints: written under a temporary name, renamed only when complete.

Layout (RLinf's): checkpoints/global_step_<N>/actor/dcp_checkpoint/{.metadata,__<r>_0.distcp}
with a top-level `fsdp_checkpoint` key holding model, optimizers, lr_schedulers and rng; and
checkpoints/global_step_<N>/data/data.pt with the data sampler's state. A directory under its
final name is complete by construction: every shard, .metadata and data.pt were written and
flushed before the rename.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.results import CheckpointInfo
from rlinf_twoworker.rundir import checkpoint_dir, complete_checkpoint_steps, staging_checkpoint_dir

if TYPE_CHECKING:
    from rlinf_twoworker.components import ComponentGroup
    from rlinf_twoworker.rundir import RunLog

DCP_SUBDIR = Path("actor") / "dcp_checkpoint"
DATA_FILE = Path("data") / "data.pt"


def scheduled_steps(cfg: GRPOConfig) -> list[int]:
    """Steps that get a checkpoint: every save_interval steps, and always the last step."""
    last, interval = cfg.runner.max_steps, cfg.runner.save_interval
    steps = set(range(interval, last + 1, interval)) if interval > 0 else set()
    return sorted(steps | {last})


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(directory)


def files_of(directory: Path) -> dict[str, int]:
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(Path(directory).rglob("*"))
        if p.is_file()
    }


async def save(
    group: ComponentGroup, cfg: GRPOConfig, run_dir: Path, step: int, data_state: dict[str, Any]
) -> CheckpointInfo:
    """All actor ranks write their DCP shards, then data.pt, then the rename makes it final."""
    staging = staging_checkpoint_dir(run_dir, step)
    final = checkpoint_dir(run_dir, step)
    if staging.exists():  # left by a crash of an earlier attempt: never complete, so safe
        shutil.rmtree(staging)
    (staging / DATA_FILE).parent.mkdir(parents=True)
    await group.call_each(
        group.actors(),
        "save_checkpoint",
        str(staging / DCP_SUBDIR),
        timeout=cfg.runner.timeouts.checkpoint_s,
        stage=f"checkpoint {step}",
    )
    torch.save(data_state, staging / DATA_FILE)
    _fsync_tree(staging)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    prune(run_dir, cfg.runner.keep_last_checkpoints)
    return CheckpointInfo(
        step=step, directory=str(final), files=files_of(final), finished_at=time.time()
    )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(run_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    steps = complete_checkpoint_steps(run_dir)
    if keep_last <= 0 or len(steps) <= keep_last:
        return []
    doomed = steps[:-keep_last]
    for step in doomed:
        shutil.rmtree(checkpoint_dir(run_dir, step))
    return doomed


def last_complete(run_dir: Path) -> Path | None:
    steps = complete_checkpoint_steps(run_dir)
    return checkpoint_dir(run_dir, steps[-1]) if steps else None


def resume_source(cfg: GRPOConfig, run_dir: Path) -> Path | None:
    """The checkpoint directory to resume from, or None. 'auto' takes the newest other run
    under runner.output_dir that has a complete checkpoint; a path may be a run directory or
    a global_step_<N> directory."""
    value = cfg.runner.resume_dir
    if not value:
        return None
    if value == "auto":
        runs = [
            p
            for p in Path(cfg.runner.output_dir).iterdir()
            if p.is_dir() and p.resolve() != Path(run_dir).resolve() and last_complete(p)
        ]
        if not runs:
            raise TwoWorkerError(
                f"runner.resume_dir=auto found no run with a complete "
                f"checkpoint under {cfg.runner.output_dir}"
            )
        newest = max(runs, key=lambda p: (last_complete(p).stat().st_mtime, p.name))
        return last_complete(newest)
    path = Path(value)
    if path.name.startswith("global_step_") and (path / DCP_SUBDIR / ".metadata").is_file():
        return path
    found = last_complete(path)
    if found is None:
        raise TwoWorkerError(
            f"runner.resume_dir={value}: no complete checkpoint there "
            "(checkpoints/global_step_<N>/ with actor/dcp_checkpoint/.metadata)"
        )
    return found


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("global_step_"))


def load_data_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / DATA_FILE, weights_only=True)


async def restore(group: ComponentGroup, cfg: GRPOConfig, checkpoint: Path, log: RunLog) -> int:
    """Load model, optimiser, lr schedule and RNG on every actor rank; returns the step."""
    step = step_of(checkpoint)
    if step >= cfg.runner.max_steps:
        raise TwoWorkerError(
            f"resume checkpoint {checkpoint} is at step {step}, but "
            f"runner.max_steps={cfg.runner.max_steps}: ask for more steps"
        )
    await group.call_each(
        group.actors(),
        "load_checkpoint",
        str(checkpoint / DCP_SUBDIR),
        timeout=cfg.runner.timeouts.checkpoint_s,
        stage="resume",
    )
    log.info(f"RESUMED_FROM={checkpoint} step={step}")
    return step
