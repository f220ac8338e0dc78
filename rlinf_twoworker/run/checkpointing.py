"""Checkpoints of a running run: every actor rank writes its DCP shard under a staging name,
then data.pt (and RLinf's full_weights.pt when asked), then the rename makes it complete
(storage/checkpoints.py is the file format); and the restore of a run resumed from one."""

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
from rlinf_twoworker.storage.checkpoints import (
    DATA_FILE,
    DCP_SUBDIR,
    FULL_WEIGHTS,
    HF_SUBDIR,
    RESUMED_FROM_JSON,
    files_of,
    fsync_dir,
    fsync_tree,
    full_storage,
    prune,
    resume_limit_problem,
    step_of,
)
from rlinf_twoworker.storage.rundir import atomic_write_text, checkpoint_dir, staging_checkpoint_dir
from rlinf_twoworker.workers.contract import Trainer

if TYPE_CHECKING:
    from rlinf_twoworker.run.group import ComponentGroup
    from rlinf_twoworker.storage.rundir import RunLog


async def save(
    group: ComponentGroup,
    cfg: GRPOConfig,
    run_dir: Path,
    step: int,
    data_state: dict[str, Any],
    log: RunLog | None = None,
) -> CheckpointInfo:
    """All actor ranks write their DCP shards, then data.pt, then the rename makes it final.
    The file work runs off the event loop: the controller answers meanwhile. Each rank's
    write (its seconds, and with runner.checkpoint_staging the staging's) goes to `log`."""
    staging = staging_checkpoint_dir(run_dir, step)
    final = checkpoint_dir(run_dir, step)
    await asyncio.to_thread(_fresh_staging, staging)
    try:
        answers = await group.call_each(
            group.actors(),
            Trainer.save_checkpoint,
            str(staging / DCP_SUBDIR),
            timeout=cfg.runner.timeouts.checkpoint_s,
            stage=f"checkpoint {step}",
        )
        for member, answer in zip(group.actors(), answers):
            if log is not None and isinstance(answer, dict):
                parts = " ".join(
                    f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in answer.items()
                )
                log.detail(f"CHECKPOINT_WRITE step={step} actor:{member.slot.rank} {parts}")
        await asyncio.to_thread(_complete, cfg, staging, final, data_state)
    except BaseException:
        if await asyncio.to_thread(full_storage, staging) is not None:  # give its space back
            await asyncio.to_thread(shutil.rmtree, staging, True)
        raise
    if cfg.runner.save_full_weights:  # opt-in: a full model copy costs a full gather
        await asyncio.to_thread(_export_full_weights, run_dir, final, step, log)
    await asyncio.to_thread(prune, run_dir, cfg.runner.keep_last_checkpoints)
    files = await asyncio.to_thread(files_of, final)
    return CheckpointInfo(step=step, directory=str(final), files=files, finished_at=time.time())


def _export_full_weights(run_dir: Path, final: Path, step: int, log: RunLog | None) -> None:
    """The optional Hugging Face copy (runner.save_full_weights) of a checkpoint that is
    complete already: its failure is logged, never the step's (the export leaves no partial
    directory; `rlinf-twoworker export-hf` makes it later)."""
    from rlinf_twoworker.storage.export import export_hf

    try:
        export_hf(run_dir, final / HF_SUBDIR, step)
    except Exception as exc:
        if log is not None:
            said = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            log.info(
                f"EXPORT_FAILED step={step} error={type(exc).__name__}: {said}; checkpoint "
                f"{final} is complete: export it later with `rlinf-twoworker export-hf "
                f"{run_dir} --step {step} --out DIR`"
            )


def _fresh_staging(staging: Path) -> None:
    if staging.exists():  # left by a crash of an earlier attempt: never complete, so safe
        shutil.rmtree(staging)
    (staging / DATA_FILE).parent.mkdir(parents=True)


def _complete(cfg: GRPOConfig, staging: Path, final: Path, data_state: dict[str, Any]) -> None:
    """data.pt (and full_weights.pt when asked), everything flushed, then the rename."""
    torch.save(data_state, staging / DATA_FILE)
    if cfg.actor.fsdp_config.save_full_model_weights:
        write_full_weights(staging)
    fsync_tree(staging)
    os.rename(staging, final)
    fsync_dir(final.parent)


def write_full_weights(checkpoint: Path) -> Path:
    """RLinf's actor/model_state_dict/full_weights.pt: the model's full state dict (parameter
    name -> tensor), read back from the checkpoint's DCP shards."""
    from rlinf_twoworker.storage.readback import model_state

    path = checkpoint / FULL_WEIGHTS
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model_state(checkpoint / DCP_SUBDIR), path)
    return path


async def restore(group: ComponentGroup, cfg: GRPOConfig, checkpoint: Path, log: RunLog) -> int:
    """Load model, optimiser, lr schedule and RNG on every actor rank; returns the step.
    Records the source in the new run's resumed_from.json and driver.log (RESUMED_FROM=)."""
    step = step_of(checkpoint)
    problem = resume_limit_problem(checkpoint, cfg.runner.max_steps)
    if problem is not None:
        raise TwoWorkerError(problem)
    await group.call_each(
        group.actors(),
        Trainer.load_checkpoint,
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
    text = json.dumps(record, indent=2) + "\n"  # written off the event loop: storage may stall
    await asyncio.to_thread(atomic_write_text, log.run_dir / RESUMED_FROM_JSON, text)
    log.info(f"RESUMED_FROM={source} step={step}")
    return step
