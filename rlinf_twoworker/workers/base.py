"""What every component process shares: its identity and its place in the process groups.

The plain component classes (rollout, inference, actor) inherit this; Ray only adds placement
and remoteness around them (`ray.remote(RolloutWorker).options(...)`), so each class also runs
in a plain process for tests.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlinf_twoworker.config.settings import ProcessSettings
from rlinf_twoworker.engines import compile_cache, offload, weight_sync
from rlinf_twoworker.engines.models import device_for, load_causal_lm
from rlinf_twoworker.engines.weight_sync import SyncGroups, new_sync_groups
from rlinf_twoworker.workers.process import (
    node_ip,
    process_times,
)


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


GIB = 2**30
HELD_WARNING_BYTES = GIB // 2
"""A copy that still holds more than this after giving its memory back is reported."""


class Worker:
    """Identity, device and process-group membership of one component process."""

    model: Any

    def __init__(self, settings: ProcessSettings, component: str, rank: int) -> None:
        self.began = time.time()  # the process started and imported its worker module
        self.settings, self.component, self.rank = settings, component, rank
        self.device = device_for(settings.accelerator)
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.actor_group: Any = None
        self._sync: SyncGroups | None = None
        self.startup: dict[str, float] = {}
        """Seconds of this process's start-up parts (model load), for the run's log."""
        torch.manual_seed(settings.seed + rank)

    def load_model(self, path: str, dtype: torch.dtype) -> Any:
        """Load the model (timed: startup['load'])."""
        start = time.perf_counter()
        model = load_causal_lm(path, dtype, self.device)
        self.startup["load"] = time.perf_counter() - start
        return model

    def timed_warm_up(self, run: Callable[[], object]) -> dict[str, float]:
        """runner.compile_warm_up's answer (run/warmup.py): `run()`'s seconds and, on GPUs,
        the seconds torch.compile spent in it."""
        cuda = self.device.type == "cuda"
        compiled = compile_cache.compile_seconds() if cuda else 0.0
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        compile_s = compile_cache.compile_seconds() - compiled if cuda else 0.0
        return {"seconds": seconds, "compile_s": compile_s}

    def startup_report(self) -> dict[str, Any]:
        """What this process's start-up took (its model load)."""
        return {**process_times(self.began), "seconds": dict(self.startup)}

    @property
    def sync(self) -> SyncGroups:
        """The weight-sync groups, made by `join`."""
        if self._sync is None:
            raise RuntimeError(
                f"{self.component} rank {self.rank}: weight sync before join(); the run's "
                "process groups are made first (a library bug if it reaches a user)"
            )
        return self._sync

    def rendezvous_address(self) -> tuple[str, int]:
        ip = node_ip()
        return ip, free_port(ip)

    def join(
        self,
        master: tuple[str, int],
        world_rank: int,
        world_size: int,
        actor_ranks: list[int],
        consumer_ranks: list[int],
        shared_gpu: tuple[bool, bool] = (False, False),
    ) -> None:
        """Join the run's world process group and create the sub-groups (same order everywhere)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=self.settings.collective_timeout_s)
        if master[0].startswith("127."):
            # Keep collectives on loopback when the whole cluster lives on one host.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        # One default group with a backend per device: NCCL for GPU tensors, gloo for CPU ones.
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if self.backend == "nccl" else "gloo",
            init_method=f"tcp://{master[0]}:{master[1]}",
            rank=world_rank,
            world_size=world_size,
            timeout=timeout,
        )
        self.actor_group = dist.new_group(actor_ranks)
        shared = (bool(shared_gpu[0]), bool(shared_gpu[1]))
        self._sync = new_sync_groups(actor_ranks, consumer_ranks, shared)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def weights_dtype(self) -> str:
        """The dtype of this process's copy of the weights (for the weight check)."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def weights_digest(self, sync_dtype: str) -> str:
        """SHA-256 of the full parameters in the sync dtype (a collective on the actor's ranks)."""
        return weight_sync.weights_digest(self.model, getattr(torch, sync_dtype))


class PolicyCopy(Worker):
    """A component holding a copy of the policy (rollout, inference): it receives weights."""

    _held_reported = 0
    """Bytes still reserved after a release when that was last reported (release_memory)."""

    def receive_weights(self, sync_dtype: str) -> dict[str, float]:
        """Take part in the collective weight sync (actor ranks send)."""
        start = time.perf_counter()
        offload.restore_weights(self.model)  # given back for the update: the sync refills it
        got = weight_sync.receive_weights(self.model, self.sync, getattr(torch, sync_dtype))
        return {"bytes": got, "seconds": time.perf_counter() - start}

    def import_weights(self, handles: list, sync_dtype: str) -> dict[str, float]:
        """Colocated sync: copy the actor's exported buckets through CUDA IPC."""
        start = time.perf_counter()
        offload.restore_weights(self.model)
        got = weight_sync.import_weights(self.model, handles, getattr(torch, sync_dtype))
        return {"bytes": got, "seconds": time.perf_counter() - start}

    def release_memory(self) -> dict[str, float]:
        """Give this copy's GPU memory back while an actor rank on its GPU trains
        (actor.enable_offload): its weights (the next sync writes them all) and its cache."""
        start = time.perf_counter()
        freed = offload.release_weights(self.model)
        # The samplers are gone by now (nothing transient is alive), so the survivors can
        # leave the collector's view: next step's collections walk only what it makes.
        offload.settle_heap()
        offload.free_cached(self.device)
        held = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        # The memory plan counts none of it during the update. Said once, and again only
        # when it has grown by as much (describing it walks every Python object).
        if held > max(HELD_WARNING_BYTES, self._held_reported + HELD_WARNING_BYTES):
            self._held_reported = held
            logging.getLogger("rlinf_twoworker").warning(
                f"{self.component} rank {self.rank} still holds {held / GIB:.2f} GiB of GPU "
                f"memory after giving it back for the actor's update; the memory plan counts "
                f"none, so the update may run out of memory: {offload.still_held(self.device)}"
            )
        return {
            "bytes": float(freed),
            "seconds": time.perf_counter() - start,
            "reserved_gib": held / 1024**3,  # what PyTorch still holds on the GPU
        }

    def weights_digest(self, sync_dtype: str) -> str:
        offload.require_weights(self.model, f"{self.component} rank {self.rank}")
        return super().weights_digest(sync_dtype)


# For mypy: the bases give what every policy copy owes (workers/contract.py).
if TYPE_CHECKING:
    from rlinf_twoworker.workers import contract

    _model: type[contract.Component] = Worker
    _copy: type[contract.PolicyCopy] = PolicyCopy
