"""Durable checkpoints: written under a temporary name, renamed only when complete.

Layout (RLinf's): checkpoints/global_step_<N>/actor/dcp_checkpoint/{.metadata,__<r>_0.distcp}
with a top-level `fsdp_checkpoint` key holding model, optimizers, lr_schedulers and rng; and
checkpoints/global_step_<N>/data/data.pt with the data sampler's state. A directory under its
final name is complete by construction: every shard, .metadata and data.pt were written and
flushed before the rename. Resuming trusts a directory only after `checkpoint_problems` finds
nothing wrong with its files (readback.py reads one back without Ray).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.results import CheckpointInfo
from rlinf_twoworker.rundir import (
    atomic_write_text,
    checkpoint_dir,
    complete_checkpoint_steps,
    staging_checkpoint_dir,
)

if TYPE_CHECKING:
    from rlinf_twoworker.components import ComponentGroup
    from rlinf_twoworker.rundir import RunLog

DCP_SUBDIR = Path("actor") / "dcp_checkpoint"
DATA_FILE = Path("data") / "data.pt"
HF_SUBDIR = Path("actor") / "huggingface"  # with runner.save_full_weights
FULL_WEIGHTS = Path("actor") / "model_state_dict" / "full_weights.pt"
"""RLinf's full-model file (actor.fsdp_config.save_full_model_weights)."""
METADATA = ".metadata"
MODEL_PREFIX = "fsdp_checkpoint.model."
"""DCP key prefix of the actor's model weights (keys are flattened with dots)."""
RESUMED_FROM_JSON = "resumed_from.json"


class CheckpointReadError(TwoWorkerError):
    """A checkpoint's files are missing, damaged or unreadable; the message names the file."""


def scheduled_steps(cfg: GRPOConfig, last: int | None = None) -> list[int]:
    """Steps that get a checkpoint, as RLinf decides: every save_interval steps and the last
    step (runner.max_steps, or `last` when the epochs end the run earlier); none with
    save_interval <= 0 (RLinf's -1)."""
    last = cfg.runner.max_steps if last is None else last
    interval = cfg.runner.save_interval
    if interval <= 0:
        return []
    return sorted(set(range(interval, last + 1, interval)) | {last})


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
    if cfg.actor.fsdp_config.save_full_model_weights:
        await asyncio.to_thread(write_full_weights, staging)
    _fsync_tree(staging)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if cfg.runner.save_full_weights:  # opt-in: a full model copy costs a full gather
        from rlinf_twoworker.export import export_hf

        await asyncio.to_thread(export_hf, run_dir, final / HF_SUBDIR, step)
    prune(run_dir, cfg.runner.keep_last_checkpoints)
    return CheckpointInfo(
        step=step, directory=str(final), files=files_of(final), finished_at=time.time()
    )


def write_full_weights(checkpoint: Path) -> Path:
    """RLinf's actor/model_state_dict/full_weights.pt: the model's full state dict (parameter
    name -> tensor), read back from the checkpoint's DCP shards."""
    from rlinf_twoworker.readback import model_state

    path = checkpoint / FULL_WEIGHTS
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_state(checkpoint / DCP_SUBDIR), path)
    return path


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune(run_dir: Path, keep_last: int) -> list[int]:
    """Delete all but the newest `keep_last` complete checkpoints (0 keeps all)."""
    steps = complete_steps(run_dir)
    if keep_last <= 0 or len(steps) <= keep_last:
        return []
    doomed = steps[:-keep_last]
    for step in doomed:
        shutil.rmtree(checkpoint_dir(run_dir, step))
    return doomed


# ---- finding complete checkpoints ---------------------------------------------------------


def read_metadata(dcp_dir: Path) -> Any:
    """The DCP `.metadata` of `dcp_dir`; raises CheckpointReadError naming the file."""
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(dcp_dir) / METADATA
    if not path.is_file() or path.stat().st_size == 0:
        raise CheckpointReadError(f"{path} is missing or empty: the checkpoint was not finished")
    try:
        return FileSystemReader(str(dcp_dir)).read_metadata()
    except Exception as exc:  # truncated or foreign pickle: one line naming the file
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
    under runner.output_dir, the newest complete checkpoint (staging `.incomplete` directories
    and checkpoints with missing files are never taken); a path may be a run directory or a
    global_step_<N> directory."""
    value = cfg.runner.resume_dir
    if not value:
        return None
    if value == "auto":
        output_root = Path(cfg.runner.output_dir)
        here = Path(run_dir).resolve()
        candidates = [
            found
            for p in (sorted(output_root.iterdir()) if output_root.is_dir() else [])
            if p.is_dir() and p.resolve() != here and (found := last_complete(p)) is not None
        ]
        if not candidates:
            raise TwoWorkerError(
                f"runner.resume_dir=auto found no run with a complete checkpoint under "
                f"{output_root}; give the run directory to resume from, or drop resume_dir"
            )
        return max(candidates, key=lambda c: (_finished_at(c), c.parent.parent.name))
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


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("global_step_"))


def load_data_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / DATA_FILE, weights_only=True)


async def restore(group: ComponentGroup, cfg: GRPOConfig, checkpoint: Path, log: RunLog) -> int:
    """Load model, optimiser, lr schedule and RNG on every actor rank; returns the step.
    Records the source in the new run's resumed_from.json and driver.log (RESUMED_FROM=)."""
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
    source = Path(checkpoint).resolve()
    record = {
        "checkpoint": str(source),
        "step": step,
        "run_dir": str(source.parent.parent),
        "run_id": source.parent.parent.name,
        "resume_dir": cfg.runner.resume_dir,
        "time": time.time(),
    }
    atomic_write_text(log.run_dir / RESUMED_FROM_JSON, json.dumps(record, indent=2) + "\n")
    log.info(f"RESUMED_FROM={source} step={step}")
    return step


def inherited_info(resume_from: Path, step: int) -> CheckpointInfo:
    """A resumed run's checkpoint future for a step done by the run it resumed from: that
    run's checkpoint of the step (files empty when it was pruned or never written)."""
    directory = checkpoint_dir(Path(resume_from).parent.parent, step)
    files = files_of(directory) if directory.is_dir() else {}
    return CheckpointInfo(step=step, directory=str(directory), files=files, finished_at=0.0)
