"""What the run's futures resolve to."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StepResult:
    """One finished GRPO step: its metrics (TensorBoard tags) and per-stage seconds."""

    step: int
    metrics: dict[str, float]
    timings: dict[str, float]
    finished_at: float = 0.0
    """time.time() when the step completed."""
    startup: dict[str, float] = field(default_factory=dict)
    """The run's start-up phases in seconds (run/startup.py), on the run's first step only."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
