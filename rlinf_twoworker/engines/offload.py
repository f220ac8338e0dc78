"""Giving GPU memory back between stages (actor.enable_offload).

The actor copies the storages of its FSDP2 parameter shards and of its optimiser state to
pinned host memory and frees them (every tensor object stays: nothing in FSDP2 or the
optimiser is rebuilt), and frees its gradients;
the policy copies (rollout, inference) free the storage of their weights outright: the next
weight sync writes every parameter, so there is nothing to keep. A released copy refuses to
compute until the sync has refilled it.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

from rlinf_twoworker.engines.tensors import local
from rlinf_twoworker.errors import TwoWorkerError


def _storages(module: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages under the module's parameters (fused views share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in module.parameters():
        storage = p.untyped_storage()
        seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def release_weights(model: torch.nn.Module) -> int:
    """Free the memory of every parameter of `model`, keeping the tensors (their shapes, views
    and the modules that hold them). Returns the bytes freed; `restore_weights` gives them back
    (uninitialised: the caller writes them)."""
    if getattr(model, "_rlinf_released", None):
        return 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.untyped_storage().resizable():  # mapped from the checkpoint file (CPUs)
                p.data = p.data.clone()
    sizes = []
    for storage in _storages(model):
        sizes.append((storage, storage.nbytes()))
        storage.resize_(0)
    model._rlinf_released = sizes  # type: ignore[assignment]
    return sum(n for _, n in sizes)


def restore_weights(model: torch.nn.Module) -> None:
    """Reallocate what `release_weights` freed (contents undefined until written)."""
    sizes = getattr(model, "_rlinf_released", None)
    if not sizes:
        return
    for storage, nbytes in sizes:
        storage.resize_(nbytes)
    model._rlinf_released = None  # type: ignore[assignment]


def weights_released(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_rlinf_released", None))


def require_weights(model: torch.nn.Module, where: str) -> None:
    """Refuse to compute with weights that were given back and not yet refilled."""
    if weights_released(model):
        raise TwoWorkerError(
            f"{where}: its weights were given back for the actor's update "
            "(actor.enable_offload) and no weight sync has refilled them since; a library "
            "bug if it reaches a user: set actor.enable_offload=false to run without it"
        )


class StorageSwap:
    """Storages moved to host memory and back in place: every tensor that views them (FSDP2's
    sharded parameters, the optimiser's moments, DTensors or not) stays the same object, so
    nothing is re-registered or rebuilt. The host copies are pinned on GPUs and kept from step
    to step (no page faults after the first time)."""

    def __init__(self) -> None:
        self.away: list[tuple[torch.UntypedStorage, int]] = []
        self.hosts: list[torch.UntypedStorage] = []

    def out(self, tensors: list[torch.Tensor], device: torch.device) -> int:
        """Copy the storages under `tensors` to the host and free them; returns the bytes."""
        if self.away:
            return 0
        unique: dict[int, torch.UntypedStorage] = {}
        for t in tensors:
            storage = local(t).untyped_storage()
            if storage.nbytes():
                unique.setdefault(storage.data_ptr(), storage)
        storages = list(unique.values())
        pin = device.type == "cuda"
        for i, storage in enumerate(storages):
            n = storage.nbytes()
            if i >= len(self.hosts) or self.hosts[i].nbytes() != n:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=pin).untyped_storage()
                self.hosts[i : i + 1] = [host]
            self.hosts[i].copy_(storage, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)  # copied before the memory is freed
        for storage in storages:
            self.away.append((storage, storage.nbytes()))
            storage.resize_(0)
        return sum(n for _, n in self.away)

    def back(self, device: torch.device) -> int:
        """Reallocate every storage and copy its bytes back; returns the bytes."""
        moved = 0
        for (storage, n), host in zip(self.away, self.hosts):
            storage.resize_(n)
            storage.copy_(host, non_blocking=device.type == "cuda")
            moved += n
        self.away = []
        return moved


def still_held(device: torch.device, limit: int = 6) -> str:
    """What this process's allocator still holds on `device` after giving memory back: the
    live blocks by size, the bytes in CUDA-graph pools, and the largest live tensors (with
    their shapes), for the warning a release that freed less than planned logs."""
    try:
        snapshot = torch.cuda.memory_snapshot()
    except Exception as exc:  # a description must never fail the release it describes
        return f"(the allocator's snapshot failed: {exc})"
    index = device.index if device.index is not None else torch.cuda.current_device()
    live: list[int] = []
    pools: dict[str, int] = {}
    for segment in snapshot:
        if segment.get("device") != index:
            continue
        pool = str(segment.get("segment_pool_id", (0, 0)))
        pools[pool] = pools.get(pool, 0) + segment["total_size"]
        live += [b["size"] for b in segment["blocks"] if b["state"] == "active_allocated"]
    tensors: dict[int, tuple[int, str]] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.is_cuda:
                storage = obj.untyped_storage()
                if storage.nbytes():
                    desc = f"{tuple(obj.shape)} {str(obj.dtype).removeprefix('torch.')}"
                    tensors.setdefault(storage.data_ptr(), (storage.nbytes(), desc))
        except Exception:  # objects half torn down, or tensors without storage
            continue
    gib = 1024**3
    biggest = sorted(tensors.values(), reverse=True)[:limit]
    return (
        f"allocated {torch.cuda.memory_allocated(device) / gib:.2f} GiB in {len(live)} live "
        f"blocks (largest MiB: {[round(n / 2**20, 1) for n in sorted(live)[-limit:][::-1]]}); "
        f"segments by pool (GiB): { {k: round(v / gib, 2) for k, v in pools.items()} }; "
        f"largest live tensors: {[(round(n / 2**20, 1), d) for n, d in biggest]}"
    )


def collect_garbage() -> None:
    """Collect what only reference cycles hold: what a release frees must be free at once
    (the next component allocates it). Cheap once `settle_heap` has run."""
    gc.collect()


def settle_heap() -> None:
    """Collect, then move every survivor out of the collector's view (`gc.freeze`), so later
    collections walk only what was made since. A full collection walks every tracked object,
    and a process holding torch, transformers and compiled code tracks millions: 0.1-0.4 s a
    call, several calls a step under actor.enable_offload. Frozen objects are still freed by
    reference counting (tensors, lists, dataclasses); only one that later becomes garbage
    through a cycle alone would stay. So call it only where nothing transient is alive: the
    start of an update, a copy's release after its samplers are gone (never between a weight
    export and its release)."""
    gc.collect()
    gc.freeze()


def free_cached(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the driver, for the other processes
    on this GPU."""
    collect_garbage()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # cuBLAS keeps a 32 MiB workspace per stream it ran on, made by the caching allocator
        # and never freed: one such block inside a segment that held weights keeps the whole
        # segment from going back (measured on an H200: 3.35 GiB of the rollout's freed
        # weights stayed reserved, pinned by 0.10 GiB of workspaces). The next matmul makes one.
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


class ActorOffload:
    """The actor's parameters and optimiser state, on its device or in host memory."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.params = StorageSwap()
        self.state = StorageSwap()
        self.seconds = 0.0
        """Seconds spent moving, since the last `take_seconds`."""

    @property
    def params_away(self) -> bool:
        return bool(self.params.away)

    @property
    def optimizer_away(self) -> bool:
        return bool(self.state.away)

    def _timed(self, fn: Any) -> Any:
        import time

        start = time.perf_counter()
        result = fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start
        return result

    def _state_tensors(self) -> list[torch.Tensor]:
        return [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        ]

    def offload_optimizer(self) -> None:
        """Gradients freed, optimiser state to host memory."""
        self._out(optimizer=True, params=False)

    def offload_params(self) -> None:
        self._out(optimizer=False, params=True)

    def offload(self) -> None:
        self._out(optimizer=True, params=True)

    def _out(self, optimizer: bool, params: bool) -> None:
        """Move what is asked and still on the device to host memory, then hand the freed
        blocks back once; a call with nothing left to move costs nothing (the step asks after
        the sync as well, where the sync already moved everything)."""
        freed = False
        if optimizer:
            grads = any(p.grad is not None for p in self.model.parameters())
            self.optimizer.zero_grad(set_to_none=True)
            moved = self._timed(lambda: self.state.out(self._state_tensors(), self.device))
            freed = grads or moved > 0
        if params and not self.params.away:
            self._timed(lambda: self.params.out(list(self.model.parameters()), self.device))
            freed = True
        if freed:
            free_cached(self.device)

    def load_params(self) -> None:
        self._timed(lambda: self.params.back(self.device))

    def load(self) -> None:
        """Everything back on the device, for an update."""
        self._timed(lambda: (self.params.back(self.device), self.state.back(self.device)))

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
