"""The actor's parameters and optimiser state, however they are held: FSDP2's DTensors (a
shard of each tensor a rank) or, at one actor rank trained without the wrapper
(ActorConfig.fsdp_wraps), plain tensors."""

from __future__ import annotations

import torch


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered over its mesh (a collective of the actor group),
    a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
