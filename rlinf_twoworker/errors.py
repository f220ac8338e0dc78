"""The library's exceptions. Each says what happened, where, and what to do."""

from __future__ import annotations


class TwoWorkerError(RuntimeError):
    """Base class of every error this library raises on purpose."""


class ConfigError(TwoWorkerError, ValueError):
    """A config key has a value that breaks a rule (raised at load, before anything is created)."""

    def __init__(self, key: str, value: object, rule: str, message: str | None = None) -> None:
        self.key, self.value, self.rule, self.message = key, value, rule, message
        super().__init__(message or f"config key '{key}' = {value!r}: {rule}")

    def __reduce__(self) -> tuple:  # errors cross process boundaries through Ray
        return (type(self), (self.key, self.value, self.rule, self.message))


class RunDirError(TwoWorkerError):
    """The run directory cannot be created (it exists, or its parent is not writable)."""


class RunDirExistsError(RunDirError, ConfigError):
    """The run directory exists already: runs are never reused or overwritten. Both a
    RunDirError and a ConfigError (the fix is a new runner.experiment_name, the RUN_ID)."""


class PlacementError(TwoWorkerError):
    """The placement group could not be scheduled within its timeout."""


class PreflightError(TwoWorkerError):
    """A per-node preflight check failed; no training was started."""


class ClusterError(TwoWorkerError):
    """No Ray cluster is reachable, or it is not the cluster the config asks for."""


class ComponentError(TwoWorkerError):
    """A component (rollout, reward, inference, actor) failed; names the component, rank and node."""

    def __init__(self, component: str, rank: int, node: str, cause: str) -> None:
        self.component, self.rank, self.node, self.cause = component, rank, node, cause
        super().__init__(f"component {component} rank {rank} on node {node} failed: {cause}")

    def __reduce__(self) -> tuple:  # errors cross process boundaries through Ray
        return (type(self), (self.component, self.rank, self.node, self.cause))


class RunCancelledError(TwoWorkerError):
    """The run was cancelled (RunHandle.cancel(), Ctrl-C, or the Driver exiting)."""


class VerificationError(TwoWorkerError):
    """The postflight found a problem in the run directory."""


class CheckpointReadError(TwoWorkerError):
    """A checkpoint's files are missing, damaged or unreadable; the message names the file."""
