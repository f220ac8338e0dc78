"""What the run asks of each kind of component process, as Protocols.

The run's controller calls a component by a reference to one of these functions
(`group.call(member, Trainer.train_step, shards, ...)`, run/group.py): Ray is sent the
function's name, and the answer has the function's return type. Each worker module states,
for mypy only, that its class is what its kind promises (`_: type[Trainer] = ActorWorker`),
so a worker that lacks a method the run calls, or has it with another signature, fails
`mypy rlinf_twoworker`.

No runtime imports but typing and collections.abc: the controller imports this and never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only
    from rlinf_twoworker import messages
    from rlinf_twoworker.config.settings import ProcessSettings
    from rlinf_twoworker.engines.models import SequenceBatch


class Process(Protocol):
    """A component's process itself (run/group.ComponentHost), answering before its worker is
    built; every other call runs on the worker."""

    def where(self) -> dict[str, Any]:
        """Its component, rank, node, pid and the GPUs Ray gave it."""
        ...

    def memory_report(self) -> dict[str, float]:
        """Its memory since the last report, in GiB by what."""
        ...

    def attach_log(self, path: str) -> None:
        """Also log to `path` (runner.per_worker_log)."""
        ...

    def import_ahead(self) -> dict[str, Any]:
        """Import the worker's module and what its load will; its seconds and bytecode lines."""
        ...

    def load(self, settings: ProcessSettings | None = None) -> dict[str, Any]:
        """Build the worker (its model load) with its settings under the settled config
        (config/settings.py); answers `where`."""
        ...

    def ping(self) -> bool:
        """True while the process is alive."""
        ...

    def startup_report(self) -> dict[str, Any]:
        """The worker's start-up report with the process's own marks (began, load_began)."""
        ...

    def prepare_compiler(self) -> dict[str, Any]:
        """A model component's preparation, right after its load: on GPUs the compiler's
        imports and its compile-cache entry (run/head_start.py); 'seconds' by part and 'cache'
        lines."""
        ...

    def save_compile_cache(self) -> dict[str, Any]:
        """Save what it compiled since the last save: 'cache' (lines to log), 'compile_s'."""
        ...

    def rebind(self, settings: ProcessSettings, rank: int) -> None:
        """Take a run's settings for its component: a kept process's first call of each later
        run (cluster.keep_processes, run/kept.py)."""
        ...

    def unload(self) -> dict[str, Any]:
        """Drop the worker, its process groups and its log, and give its memory back, for the
        next run (a kept process); answers `where`."""
        ...

    def claim(self, run_id: str) -> bool:
        """Whether `run_id` now holds the kept group whose lock this process is."""
        ...

    def claimed_by(self) -> str | None:
        """The run that holds the kept group (None: idle)."""
        ...

    def unclaim(self) -> None:
        """The group is idle again."""
        ...


class Component(Protocol):
    """Every worker: what the run asks of each one after it is built."""

    def startup_report(self) -> dict[str, Any]:
        """Its start-up marks and the seconds of its parts ('seconds': {part: s})."""
        ...


class Policy(Component, Protocol):
    """A member of the run's process group holding the policy: an actor rank or a copy."""

    def join(
        self,
        master: tuple[str, int],
        world_rank: int,
        world_size: int,
        actor_ranks: list[int],
        consumer_ranks: list[int],
        shared_gpu: tuple[bool, bool] = (False, False),
    ) -> None:
        """Join the world process group at `master`, then make the sub-groups (a collective)."""
        ...

    def weights_digest(self, sync_dtype: str) -> str:
        """SHA-256 of its full parameters in `sync_dtype` (a collective on the actor ranks)."""
        ...


class PolicyCopy(Policy, Protocol):
    """A copy of the policy the actor's weights are synced to (rollout, inference)."""

    def weights_dtype(self) -> str:
        """The dtype of its weights ('bfloat16')."""
        ...

    def receive_weights(self, sync_dtype: str) -> dict[str, float]:
        """Take part in the collective weight sync; 'bytes' and 'seconds'."""
        ...

    def import_weights(self, handles: list[Any], sync_dtype: str) -> dict[str, float]:
        """Colocated sync: copy the actor's exported buckets (CUDA IPC handles)."""
        ...

    def release_memory(self) -> dict[str, float]:
        """Give its GPU memory back for the actor's update; 'reserved_gib' still held."""
        ...


class Rollout(PolicyCopy, Protocol):
    """The rollout: answers to prompts."""

    def generate(self, prompts: list[list[int]], seed: int) -> messages.Rollout:
        """group_size answers per prompt, contiguous per prompt, sampled after seeding `seed`."""
        ...


class LogProbModel(Component, Protocol):
    """A worker that computes log-probs of a step's answers (inference, the reference)."""

    def compute_logprobs(self, batch: SequenceBatch) -> messages.LogProbs:
        """The log-prob of every answer token of `batch` (zero on padding)."""
        ...

    def warm_up(self, batch: SequenceBatch) -> dict[str, float]:
        """Compute on a made-up batch, answer dropped; 'seconds' and 'compile_s'."""
        ...


class Inference(PolicyCopy, LogProbModel, Protocol):
    """Inference: the old log-probs, with the weights synced after every update."""


class Trainer(Policy, Protocol):
    """One FSDP rank of the actor."""

    def rendezvous_address(self) -> tuple[str, int]:
        """An address for the process group's rendezvous (asked of rank 0)."""
        ...

    def build(self) -> None:
        """Shard the model and make the optimiser (after `join`)."""
        ...

    def train_step(self, shards: list[messages.ActorShard]) -> messages.TrainStats:
        """One optimiser step per minibatch shard given to this rank."""
        ...

    def warm_up(self, shard: messages.ActorShard) -> dict[str, float]:
        """Forward and backward of a made-up shard, training untouched; 'seconds', 'compile_s'."""
        ...

    def send_weights(self, sync_dtype: str) -> dict[str, float]:
        """Take part in the collective weight sync as a sender; 'bytes' and 'seconds'."""
        ...

    def export_weights(
        self, sync_dtype: str, consumers: int = 1, offload_after: bool = False
    ) -> dict[str, Any]:
        """Colocated sync: keep the buckets and answer their IPC 'handles' per consumer."""
        ...

    def release_weights(self) -> None:
        """Free the exported buckets once every consumer has copied them."""
        ...

    def offload(self) -> dict[str, float]:
        """Move its parameters and optimiser state to CPU memory; 'seconds'."""
        ...

    def save_checkpoint(self, path: str) -> dict[str, Any]:
        """Write its DCP shard under `path` (a collective of the actor ranks); its timings."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Restore model, optimiser, schedule, loss scale and RNG from the DCP checkpoint."""
        ...


class Grader(Component, Protocol):
    """The reward. Its methods are coroutines: the process awaits them, so a call's answer is
    the coroutine's result (ComponentGroup.call's overload for async methods)."""

    async def warm_up_grader(self) -> dict[str, Any]:
        """Its preparation: start the grading processes; 'seconds' by part, 'cache' ([])."""
        ...

    async def score(
        self,
        answers: list[str],
        solutions: list[list[str]],
        rows: list[messages.PromptRow] | None = None,
    ) -> messages.Graded:
        """Each answer's reward against its gold solutions (`rows` only with reward_fn)."""
        ...


PREPARATIONS: dict[str, Callable[..., Any]] = {
    f.__name__: f for f in (Process.prepare_compiler, Grader.warm_up_grader)
}
"""The preparation methods a component's row may name (components.Component.prepare, a name:
the table cannot import this module, whose types import the config, which reads the table)."""
