"""What the run's futures resolve to."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

STEP_STAGES = (
    "time/rollout",
    "time/reward",
    "time/inference",
    "time/actor/training",
    "time/sync_weights",
)
"""A step's stages in StepResult.timings; its other timings are parts of these, the whole step
(time/step), or moments (time/at/...)."""


@dataclass
class StepResult:
    """One finished GRPO step: its metrics (TensorBoard tags) and per-stage seconds."""

    step: int
    metrics: dict[str, float]
    timings: dict[str, float]
    finished_at: float = 0.0
    """time.time() when the step completed."""
    startup: dict[str, float] = field(default_factory=dict, repr=False)
    """The run's start-up phases in seconds (run/startup.py), on the run's first step only."""
    minibatches: list[dict[str, float]] = field(default_factory=list, repr=False)
    """The actor's metrics of each minibatch, in training order, under the tags of `metrics`
    (whose actor values are their means, maxes or sums): what RLinf logs one by one."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def scalars(self) -> dict[str, float]:
        """Its metrics and timings in one mapping, by TensorBoard tag (what a step logs)."""
        return {**self.metrics, **self.timings}

    def __repr__(self) -> str:
        """A line a person reads: the step, its reward, loss and seconds, and how much more
        the fields hold (`metrics`, `timings`, `startup`, `minibatches`; to_dict() has all)."""
        shown = [f"step={self.step}"]
        for name, key in (
            ("reward", "rollout/reward_scores"),
            ("loss", "actor/training/actor/final_loss"),
        ):
            if key in self.metrics:
                shown.append(f"{name}={self.metrics[key]:.4g}")
        if "time/step" in self.timings:
            shown.append(f"time={self.timings['time/step']:.2f}s")
        shown.append(f"{len(self.metrics)} metrics, {len(self.timings)} timings")
        if self.startup:
            shown.append(f"{len(self.startup)} start-up phases")
        return f"StepResult({', '.join(shown)})"


@dataclass
class CheckpointInfo:
    """A checkpoint complete on storage: its directory and every file with its size."""

    step: int
    directory: str
    files: dict[str, int] = field(default_factory=dict)
    finished_at: float = 0.0
    """time.time() when the checkpoint was renamed to its final name."""

    @property
    def shards(self) -> dict[str, int]:
        return {k: v for k, v in self.files.items() if k.endswith(".distcp")}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Placed:
    """Where one component process runs (one row of RunHandle.topology())."""

    component: str
    rank: int
    bundle: int
    resource_rank: int
    node_id: str
    node_ip: str
    gpu_ids: list[str]
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class VerificationReport:
    passed: bool
    run_dir: str
    target_steps: int
    expected_nodes: int
    errors: list[str] = field(default_factory=list)
    run_id: str = ""
    output_root: str = ""
    """The expected run id and output root (the run directory must be output_root/run_id)."""
    checkpoint_step: int | None = None
    """The step whose checkpoint was checked; None when the run was expected to save none."""
    required_tags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What was not checked, and why (a checkpoint the run was not expected to save)."""
    checkpoint_dir: str | None = None
    checkpoint_files: dict[str, int] = field(default_factory=dict)
    """Path relative to checkpoint_dir -> size in bytes."""
    metrics: dict[str, dict] = field(default_factory=dict)
    """Tag -> {"step": last step, "value": last value, "steps": every logged step}."""
    workers: list[dict] = field(default_factory=list)
    """preflight.json's per-node entries (empty when the file is absent)."""
    placement: dict = field(default_factory=dict)
    """Component -> {"spec", "resource_ranks", "nodes"}, as the run recorded them in
    placement.json."""
    actor_fsdp_shards: int = 0
    memory_peaks: dict[str, float] = field(default_factory=dict)
    """memory/<component>/<rank>/<what> -> the largest value of any step (GiB)."""
    memory_estimates: dict[str, float] = field(default_factory=dict)
    """memory/<component>/<rank>/plan_estimate_gib -> the memory plan's estimate for that
    process (memory_plan.json; CUDA context included), beside the measured peaks."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: non-finite metric values become the strings 'nan', 'inf', '-inf'."""
        data = asdict(self)
        for entry in data["metrics"].values():
            if not math.isfinite(entry["value"]):
                entry["value"] = str(entry["value"])
        return data
