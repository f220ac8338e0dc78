"""Export a checkpoint in the form RLinf's FSDP actor loads (`runner.resume_dir`).

The library's checkpoint already has RLinf's directory layout and DCP keys for the model and the
optimiser state; RLinf's loader also asserts three things the library writes otherwise:
`fsdp_checkpoint.fsdp_version` (absent here), `lr_schedulers` as a list of scheduler states (one
state here) and `rng` as one process's {cpu, numpy, random, cuda} states (one CPU state per rank
here). The export copies the shards byte for byte (the weights and AdamW's moments are never
loaded, so a 1.5 B model needs no more memory than its small items), writes those items in
RLinf's form to one more shard, and writes a `.metadata` naming both. It is written under a
temporary name and renamed; an existing checkpoint is never overwritten.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from rlinf_twoworker.errors import CheckpointReadError, TwoWorkerError
from rlinf_twoworker.storage.checkpoints import (
    DCP_SUBDIR,
    FULL_WEIGHTS,
    METADATA,
    MODEL_PREFIX,
    checkpoint_problems,
    fsync_dir,
    fsync_tree,
    read_metadata,
    write_error,
)
from rlinf_twoworker.storage.readback import existing_run_dir, load_dcp
from rlinf_twoworker.storage.rundir import CONFIG_YAML, checkpoint_dir, complete_checkpoint_steps

FSDP_VERSIONS = ("fsdp", "fsdp2")
"""RLinf's FSDPVersion values; its loader refuses a checkpoint of the other one."""
SCHEDULERS = ("constant", "cosine")
OPTIM_STATE_PREFIX = "fsdp_checkpoint.optimizers.state."
PARAM_GROUPS_PREFIX = "fsdp_checkpoint.optimizers.param_groups."
SCHEDULER_PREFIX = "fsdp_checkpoint.lr_schedulers."
RNG_PREFIX = "fsdp_checkpoint.rng.rank_"
RLINF_SHARD = "__rlinf_0.distcp"
"""The shard holding the items written in RLinf's form (the copied ones keep their names)."""
DEFAULT_OUT = Path("rlinf") / "checkpoints"


@dataclass
class RlinfExport:
    out_dir: str
    checkpoint: str
    step: int
    fsdp_version: str
    lr_scheduler: str
    files: list[str]

    def lines(self) -> list[str]:
        """What `rlinf-twoworker export-rlinf` prints."""
        return [
            f"EXPORT_DIR={self.out_dir} step={self.step} checkpoint={self.checkpoint}",
            f"EXPORT_FSDP_VERSION={self.fsdp_version} lr_scheduler={self.lr_scheduler}",
            f"EXPORT_FILES={','.join(self.files)}",
            f"EXPORT_RESUME=runner.resume_dir={self.out_dir}",
        ]


@dataclass(frozen=True)
class _RunSettings:
    seed: int
    lr_scheduler: str
    strategy: str


def export_rlinf(
    run_dir: str | Path,
    out: str | Path | None = None,
    step: int | None = None,
    fsdp_version: str | None = None,
) -> RlinfExport:
    """Write `<out>/global_step_<N>/` (out default RUN_DIR/rlinf/checkpoints) from the
    checkpoint of `step` (default: the newest), loadable by RLinf with
    `runner.resume_dir=<out>/global_step_<N>`. fsdp_version: RLinf's
    actor.fsdp_config.strategy (default: the run's)."""
    run_dir = existing_run_dir(run_dir)
    settings = _run_settings(run_dir)
    version = fsdp_version or settings.strategy
    if version not in FSDP_VERSIONS:
        raise TwoWorkerError(
            f"fsdp version {version!r} is not one RLinf knows; give --fsdp-version with one of "
            f"{FSDP_VERSIONS} (RLinf's actor.fsdp_config.strategy)"
        )
    checkpoint = _source_checkpoint(run_dir, step)
    target = (Path(out) if out is not None else run_dir / DEFAULT_OUT).resolve() / checkpoint.name
    if target.exists():
        raise TwoWorkerError(
            f"{target} already exists; exports never overwrite: remove it or choose another --out"
        )
    source = checkpoint / DCP_SUBDIR
    metadata = read_metadata(source)
    small = _rlinf_items(source, metadata, settings, version)
    staging = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)  # mode from the umask, as every directory and file below
        _write_dcp(source, metadata, small, staging / DCP_SUBDIR)
        if (checkpoint / FULL_WEIGHTS).is_file():
            (staging / FULL_WEIGHTS).parent.mkdir(parents=True)
            shutil.copyfile(checkpoint / FULL_WEIGHTS, staging / FULL_WEIGHTS)
        fsync_tree(staging)
        os.rename(staging, target)
        fsync_dir(target.parent)
    except BaseException as exc:
        shutil.rmtree(staging, ignore_errors=True)
        error = write_error(target.parent, exc)
        if error is exc and isinstance(exc, OSError):
            error = TwoWorkerError(
                f"cannot write {target} ({type(exc).__name__}: {exc}); nothing was left "
                "there: choose an --out on storage you can write"
            )
        if error is exc:
            raise
        raise error from exc
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    return RlinfExport(
        str(target),
        str(checkpoint),
        int(checkpoint.name.removeprefix("global_step_")),
        version,
        settings.lr_scheduler,
        files,
    )


def _source_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of `step`, or the newest under its final name; CheckpointReadError naming
    the file when it is damaged or incomplete."""
    if step is None:
        steps = complete_checkpoint_steps(run_dir)
        if not steps:
            raise CheckpointReadError(
                f"{run_dir / 'checkpoints'} holds no checkpoint to export (global_step_<N>/); "
                "the run saved none (runner.save_interval=-1) or this is not a run directory"
            )
        step = steps[-1]
    checkpoint = checkpoint_dir(run_dir, step)
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise CheckpointReadError(f"{problems[0]}; export another step with --step")
    return checkpoint


def _run_settings(run_dir: Path) -> _RunSettings:
    """The run's actor.seed, lr schedule and FSDP strategy, from its resolved config."""
    path = run_dir / CONFIG_YAML
    try:
        cfg: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        actor = cfg["actor"]
        settings = _RunSettings(
            seed=int(actor["seed"]),
            lr_scheduler=str(actor["optim"]["lr_scheduler"]),
            strategy=str(actor.get("fsdp_config", {}).get("strategy", "fsdp")),
        )
    except Exception as exc:  # missing file or keys: say which file
        raise CheckpointReadError(
            f"{path} cannot give actor.seed and actor.optim.lr_scheduler "
            f"({type(exc).__name__}: {exc}); the run's resolved config is missing or damaged"
        ) from exc
    if settings.lr_scheduler not in SCHEDULERS:
        raise CheckpointReadError(
            f"{path} names actor.optim.lr_scheduler={settings.lr_scheduler!r}; the export "
            f"writes RLinf's state of {SCHEDULERS} only"
        )
    return settings


def _rlinf_items(
    source: Path, metadata: Any, settings: _RunSettings, version: str
) -> dict[str, Any]:
    """The checkpoint's small items (param groups, lr schedule, RNG) in RLinf's form, nested
    as RLinf's `Checkpoint.state_dict()` nests them."""
    wanted = (PARAM_GROUPS_PREFIX, SCHEDULER_PREFIX, f"{RNG_PREFIX}0")
    keys = [k for k in metadata.state_dict_metadata if k.startswith(wanted)]
    flat = load_dcp(source, keys)
    groups: dict[int, dict[str, Any]] = {}
    schedule: dict[str, Any] = {}
    for key, value in flat.items():
        if key.startswith(PARAM_GROUPS_PREFIX):
            index, name = key.removeprefix(PARAM_GROUPS_PREFIX).split(".", 1)
            groups.setdefault(int(index), {})[name] = value
        elif key.startswith(SCHEDULER_PREFIX):
            schedule[key.removeprefix(SCHEDULER_PREFIX)] = value
    missing = [
        what
        for what, found in (
            ("optimizers.param_groups", groups),
            ("lr_schedulers", schedule),
            ("rng.rank_0", f"{RNG_PREFIX}0" in flat),
        )
        if not found
    ]
    if missing:
        raise CheckpointReadError(
            f"{source / METADATA} has no fsdp_checkpoint.{', '.join(missing)}: not a checkpoint "
            "of this library's actor (an RLinf checkpoint needs no export)"
        )
    for group in groups.values():
        group["fused"] = False  # RLinf's sharded AdamW is never fused (fused breaks its scaler)
    return {
        "fsdp_checkpoint": {
            "optimizers": {"param_groups": [groups[i] for i in sorted(groups)]},
            "lr_schedulers": [_scheduler_state(schedule, settings.lr_scheduler)],
            "fsdp_version": version,
            "rng": _rng_state(flat[f"{RNG_PREFIX}0"], settings.seed),
        }
    }


def _copied(key: str) -> bool:
    """Items that keep their key and bytes: the weights and the optimiser's per-parameter state."""
    return key.startswith((MODEL_PREFIX, OPTIM_STATE_PREFIX))


def _rlinf_constant(step: int) -> float:
    return 1.0


def _scheduler_state(saved: dict[str, Any], kind: str) -> dict[str, Any]:
    """`saved` as the state_dict() of the LambdaLR RLinf builds for `kind`: its "constant" is a
    plain function (lr_lambdas [None]), its "cosine" the transformers partial (state {})."""
    dummy = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=saved["base_lrs"][0])
    lam = _rlinf_constant if kind == "constant" else functools.partial(_rlinf_constant)
    scheduler = torch.optim.lr_scheduler.LambdaLR(dummy, lam)
    scheduler.load_state_dict({**saved, "lr_lambdas": [None]})
    return scheduler.state_dict()


def _rng_state(cpu: torch.Tensor, seed: int) -> dict[str, Any]:
    """RLinf's `get_rng_state()` of a GPU process: rank 0's CPU generator as saved; numpy's,
    Python's and the GPU's (seed, offset 0) seeded with actor.seed, which the library does
    not save (its actor draws no numbers from them)."""
    cuda = torch.tensor([seed, 0], dtype=torch.int64).view(torch.uint8)
    return {
        "cpu": cpu.to(torch.uint8),
        "numpy": np.random.RandomState(seed).get_state(),
        "random": random.Random(seed).getstate(),
        "cuda": cuda.clone(),
    }


def _write_dcp(source: Path, metadata: Any, small: dict[str, Any], target: Path) -> None:
    """`target` = the copied shards + RLINF_SHARD with `small` + a .metadata naming both."""
    import torch.distributed.checkpoint as dcp

    written = target.with_name(".small")
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(small, storage_writer=dcp.FileSystemWriter(str(written)), no_dist=True)
    extra = read_metadata(written)
    (shard,) = {info.relative_path for info in extra.storage_data.values()}
    target.mkdir(parents=True)
    os.rename(written / shard, target / RLINF_SHARD)
    shutil.rmtree(written)
    kept = {i: s for i, s in metadata.storage_data.items() if _copied(i.fqn)}
    for name in sorted({s.relative_path for s in kept.values()}):
        shutil.copyfile(source / name, target / name)  # new files: modes from the umask
    merged = dataclasses.replace(
        metadata,
        state_dict_metadata={
            **{k: v for k, v in metadata.state_dict_metadata.items() if _copied(k)},
            **extra.state_dict_metadata,
        },
        storage_data={
            **kept,
            **{
                i: dataclasses.replace(s, relative_path=RLINF_SHARD)
                for i, s in extra.storage_data.items()
            },
        },
        planner_data={
            **{k: v for k, v in (metadata.planner_data or {}).items() if _copied(k)},
            **(extra.planner_data or {}),
        },
    )
    with open(target / METADATA, "wb") as handle:
        pickle.dump(merged, handle)
