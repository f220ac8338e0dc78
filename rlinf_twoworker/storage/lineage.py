"""A run's lineage: what must be the same for another run to continue it by `resume_dir=auto`.

`lineage.json`, written when the run directory is made, holds the SHA256 of the model's and the
training data's manifests (the digests the preflight compares across nodes) and the settings
that decide what is trained: GRPO's (`algorithm.*`), the optimiser's and its schedule's, the
seeds, the precisions, the reward (its kind, scale, grader and any reward.reward_fn, by name:
the function's code is the user's to keep the same), the data's order and shape (`data.*`) and
`runner.seq_length`. Input paths are left out (the digests stand for the inputs, so a copy of
the same model elsewhere is the same lineage), and so is what only changes how fast or where
it runs (engines, offload, activation recompute, compile, micro-batch sizes, workers), the step
limits, output places, logging, timeouts and the cluster: the settings a user changes to get a
failed run going again. It is plain JSON: reading another user's run never unpickles anything.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.storage.manifest import MANIFEST_NAME, manifest_dir_for, sha256_file

LINEAGE_JSON = "lineage.json"
_KEPT = (
    "algorithm.",
    "actor.optim.",
    "actor.lr_sched.",
    "actor.seed",
    "actor.fsdp_config.mixed_precision.",
    "actor.fsdp_config.grad_scaler.",
    "actor.model.precision",
    "rollout.model.precision",
    "inference.model.precision",
    "reward.reward_type",
    "reward.reward_scale",
    "reward.grader",
    "reward.reward_fn",
    "data.",
)
_SCALER = "actor.fsdp_config.grad_scaler."
ABSENT_MEANS: dict[str, Any] = {
    "reward.reward_fn": None,
    f"{_SCALER}enabled": False,
    f"{_SCALER}init_scale": 65536.0,
    f"{_SCALER}growth_interval": 2000,
    f"{_SCALER}growth_factor": 2.0,
    f"{_SCALER}backoff_factor": 0.5,
}
"""Kept keys added after lineage.json was first written, and what a lineage without one was
trained with (reward.grader is not here: its default changed, so an older run's is unknown)."""
_MP = "actor.fsdp_config.mixed_precision."
_OLD_MIXED_PRECISION: dict[bool, dict[str, Any]] = {
    True: {f"{_MP}param_dtype": "bf16", f"{_MP}reduce_dtype": "fp32", f"{_MP}buffer_dtype": "fp32"},
    False: {f"{_MP}param_dtype": None, f"{_MP}reduce_dtype": None, f"{_MP}buffer_dtype": None},
}
"""A lineage written before RLinf's precision keys acted kept the library's bool
actor.mixed_precision: bf16 compute with fp32 reduction, or no cast."""
_LEFT_OUT = (
    "algorithm.logprob_forward_micro_batch_size",
    "data.train_data_paths",
    "data.val_",
    "data.validation_",
    "data.num_workers",
)


def _flat(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _flat(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = list(value) if isinstance(value, tuple) else value


def training_settings(cfg: GRPOConfig) -> dict[str, Any]:
    """The settings two runs of one lineage share, as flat 'section.key' -> JSON value."""
    out: dict[str, Any] = {}
    _flat(dataclasses.asdict(cfg), "", out)
    kept = {k: v for k, v in out.items() if k.startswith(_KEPT) and not k.startswith(_LEFT_OUT)}
    kept["runner.seq_length"] = cfg.runner.seq_length
    return json.loads(json.dumps(kept, default=str))  # as it reads back from the file


def _manifest_digest(path: str | Path) -> str | None:
    manifest = manifest_dir_for(path) / MANIFEST_NAME
    try:
        return sha256_file(manifest)
    except OSError:
        return None  # no manifest: the preflight refuses the run; no lineage matches it


def lineage_of(cfg: GRPOConfig) -> dict[str, Any]:
    return {
        "model_digest": _manifest_digest(cfg.actor.model.model_path),
        "data_digest": [_manifest_digest(p) for p in cfg.data.train_data_paths],
        "training": training_settings(cfg),
    }


def write_lineage(run_dir: Path, cfg: GRPOConfig) -> None:
    from rlinf_twoworker.storage.rundir import atomic_write_text

    atomic_write_text(Path(run_dir) / LINEAGE_JSON, json.dumps(lineage_of(cfg), indent=1) + "\n")


def lineage_problems(run_dir: Path, mine: dict[str, Any]) -> list[str]:
    """Why the run in `run_dir` is not of the lineage `mine` (lineage_of this run); empty when
    it is. Each problem names what differs, with both values."""
    path = Path(run_dir) / LINEAGE_JSON
    try:
        theirs = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(theirs, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        return [f"{path} cannot be read ({type(exc).__name__}): its lineage is unknown"]
    problems = []
    for key, what in (("model_digest", "model manifest"), ("data_digest", "data manifest")):
        known = mine[key] if isinstance(mine[key], list) else [mine[key]]
        if None in known or theirs.get(key) != mine[key]:
            problems.append(f"another {what} (SHA256 {theirs.get(key)} there, {mine[key]} here)")
    found = theirs.get("training")
    settings: dict[str, Any] = found if isinstance(found, dict) else {}
    old_precision = settings.pop("actor.mixed_precision", None)
    if isinstance(old_precision, bool):
        settings.update(_OLD_MIXED_PRECISION[old_precision])
    for key, value in ABSENT_MEANS.items():  # a run written before the key existed
        settings.setdefault(key, value)
    differing = sorted(
        k
        for k in set(settings) | set(mine["training"])
        if settings.get(k) != mine["training"].get(k)
    )
    if differing:
        shown = ", ".join(
            f"{k} ({settings.get(k)!r} there, {mine['training'].get(k)!r} here)"
            for k in differing[:5]
        )
        more = f" and {len(differing) - 5} more" if len(differing) > 5 else ""
        problems.append(f"other training settings: {shown}{more}")
    return problems
