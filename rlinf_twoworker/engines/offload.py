"""Giving GPU memory back between stages (actor.enable_offload).

The actor moves its FSDP2 parameters (`nn.Module.to`, which FSDP2 supports: its sharded
parameters are re-registered) and its optimiser state to CPU memory, and frees its gradients;
the policy copies (rollout, inference) free the storage of their weights outright: the next
weight sync writes every parameter, so there is nothing to keep. A released copy refuses to
compute until the sync has refilled it.
"""

from __future__ import annotations

import gc
from typing import Any

import torch

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


class _Away:
    """An optimiser state tensor while it lives in CPU memory: its local values (pinned on
    GPU hosts, reused from step to step) and, for a DTensor, how to rebuild it."""

    def __init__(self, value: torch.Tensor, host: torch.Tensor | None) -> None:
        from torch.distributed.tensor import DTensor

        self.dtensor = (
            (value.device_mesh, value.placements, value.shape, value.stride())
            if isinstance(value, DTensor)
            else None
        )
        local = value.to_local() if isinstance(value, DTensor) else value
        pin = local.device.type == "cuda"
        if host is None or host.shape != local.shape or host.dtype != local.dtype:
            host = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
        host.copy_(local, non_blocking=pin)
        self.host = host

    def back(self, device: torch.device) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        local = self.host.to(device, non_blocking=True)
        if self.dtensor is None:
            return local
        mesh, placements, shape, stride = self.dtensor
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )


def move_optimizer_state(
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    to_host: bool,
    hosts: dict[tuple[int, str], torch.Tensor] | None = None,
) -> int:
    """Move every tensor of the optimiser's state to CPU memory (`to_host`: into the pinned
    buffers of `hosts`, made on first use) or back to `device`; returns the bytes moved."""
    hosts = {} if hosts is None else hosts
    moved = 0
    for param, state in optimizer.state.items():
        for key, value in state.items():
            slot = (id(param), key)
            if to_host and isinstance(value, torch.Tensor):
                away = _Away(value, hosts.get(slot))
                hosts[slot] = away.host
                state[key] = away
                moved += away.host.numel() * away.host.element_size()
            elif not to_host and isinstance(value, _Away):
                state[key] = value.back(device)
                moved += value.host.numel() * value.host.element_size()
            elif not to_host and isinstance(value, torch.Tensor):
                state[key] = value.to(device, non_blocking=True)
    return moved


def free_cached(device: torch.device) -> None:
    """Hand the caching allocator's free blocks back to the driver, for the other processes
    on this GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class ActorOffload:
    """The actor's parameters and optimiser state, on its GPU or in CPU memory."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, device: torch.device):
        self.model, self.optimizer, self.device = model, optimizer, device
        self.params_away = False
        self.optimizer_away = False
        self.hosts: dict[tuple[int, str], torch.Tensor] = {}
        """Pinned CPU buffers of the optimiser state, kept from step to step."""
        self.seconds = 0.0
        """Seconds spent moving, since the last `take_seconds`."""

    def _timed(self, fn: Any) -> None:
        import time

        start = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.seconds += time.perf_counter() - start

    def offload_optimizer(self) -> None:
        """Gradients freed, optimiser state to CPU memory."""
        self.optimizer.zero_grad(set_to_none=True)
        if not self.optimizer_away:
            self._timed(lambda: move_optimizer_state(self.optimizer, self.device, True, self.hosts))
            self.optimizer_away = True
        free_cached(self.device)

    def offload_params(self) -> None:
        if not self.params_away:
            self._timed(lambda: self.model.to("cpu"))
            self.params_away = True
        free_cached(self.device)

    def offload(self) -> None:
        self.offload_optimizer()
        self.offload_params()

    def load_params(self) -> None:
        if self.params_away:
            self._timed(lambda: self.model.to(self.device))
            self.params_away = False

    def load(self) -> None:
        """Everything back on the GPU, for an update."""
        self.load_params()
        if self.optimizer_away:
            self._timed(
                lambda: move_optimizer_state(self.optimizer, self.device, False, self.hosts)
            )
            self.optimizer_away = False

    def take_seconds(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
