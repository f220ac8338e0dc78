"""rlinf_twoworker: GRPO training across several Ray nodes, as one library call.

handle = run_grpo_two_worker(cfg)
ray.get(handle.step(1))
ray.get(handle.checkpoint(2))
report = handle.result()
"""

import time as _time

_imported_at = _time.time()  # when this process began importing the library (start-up record)

from rlinf_twoworker.config import GRPOConfig, load_config  # noqa: E402
from rlinf_twoworker.errors import (  # noqa: E402
    ClusterError,
    ComponentError,
    ConfigError,
    PlacementError,
    PreflightError,
    RunCancelledError,
    RunDirError,
    RunDirExistsError,
    TwoWorkerError,
    VerificationError,
)

__all__ = [
    "ClusterError",
    "ComponentError",
    "ConfigError",
    "GRPOConfig",
    "PlacementError",
    "PreflightError",
    "RunCancelledError",
    "RunDirError",
    "RunDirExistsError",
    "RunHandle",
    "TwoWorkerError",
    "VerificationError",
    "load_config",
    "release_kept",
    "run_grpo_two_worker",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # The handle pulls in Ray, torch and transformers; load them only when asked for.
    if name in ("run_grpo_two_worker", "RunHandle"):
        from rlinf_twoworker.api import handle

        return getattr(handle, name)
    if name == "release_kept":  # cluster.keep_processes' idle processes, freed
        from rlinf_twoworker.run.kept import release_kept

        return release_kept
    raise AttributeError(name)
