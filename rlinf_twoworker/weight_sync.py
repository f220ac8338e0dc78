"""Weight sync from the FSDP actor to rollout and inference through torch.distributed.

Topology of one sync: every actor rank takes part in gathering each parameter's full tensor
(FSDP2 `full_tensor`, a collective of the actor group); actor rank 0 packs them into flat
buckets and broadcasts each bucket once across the node boundary to a relay (the first
consumer), which fans it out to the other consumers on its node. Nothing goes through the Ray
object store or files. Both sides derive the same bucket layout from the same architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class SyncGroups:
    """Global ranks of the sync and the process groups that carry it."""

    source: int  # actor rank 0
    relay: int  # first consumer: receives across the node boundary
    consumers: tuple[int, ...]  # relay first
    cross: object  # group {source, relay}
    fanout: object | None  # group {consumers}, None when there is one consumer


def new_sync_groups(
    actor_ranks: list[int], consumer_ranks: list[int], backend: str | None = None
) -> SyncGroups:
    """Create the groups; every process of the world must call this, in the same order."""
    source, relay = actor_ranks[0], consumer_ranks[0]
    cross = dist.new_group([source, relay], backend=backend)
    fanout = dist.new_group(consumer_ranks, backend=backend) if len(consumer_ranks) > 1 else None
    return SyncGroups(source, relay, tuple(consumer_ranks), cross, fanout)


def bucket_plan(shapes: list[torch.Size], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Split parameter indices into consecutive buckets of at most bucket_bytes (or one param)."""
    buckets: list[list[int]] = [[]]
    size = 0
    for index, shape in enumerate(shapes):
        nbytes = shape.numel() * itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(index)
        size += nbytes
    return [b for b in buckets if b]


def _full(param: torch.Tensor) -> torch.Tensor:
    return param.full_tensor() if hasattr(param, "full_tensor") else param


@torch.no_grad()
def send_weights(
    model: torch.nn.Module,
    groups: SyncGroups,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Actor side (all actor ranks call it). Returns the bytes broadcast by the source."""
    params = [p for _, p in model.named_parameters()]
    is_source = dist.get_rank() == groups.source
    sent = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bucket in bucket_plan([p.shape for p in params], itemsize, bucket_bytes):
        fulls = [_full(params[i]) for i in bucket]  # collective over the actor group
        if not is_source:
            continue
        flat = torch.cat([t.detach().to(dtype).reshape(-1) for t in fulls])
        dist.broadcast(flat, src=groups.source, group=groups.cross)
        sent += flat.numel() * itemsize
    return sent


@torch.no_grad()
def receive_weights(
    model: torch.nn.Module,
    groups: SyncGroups,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Consumer side (rollout, inference). Returns the bytes received."""
    params = [p for _, p in model.named_parameters()]
    rank = dist.get_rank()
    device = params[0].device
    received = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for bucket in bucket_plan([p.shape for p in params], itemsize, bucket_bytes):
        flat = torch.empty(sum(params[i].numel() for i in bucket), dtype=dtype, device=device)
        if rank == groups.relay:
            dist.broadcast(flat, src=groups.source, group=groups.cross)
        if groups.fanout is not None:
            dist.broadcast(flat, src=groups.relay, group=groups.fanout)
        offset = 0
        for i in bucket:
            n = params[i].numel()
            params[i].copy_(flat[offset : offset + n].view_as(params[i]))
            offset += n
        received += flat.numel() * itemsize
    return received


def state_digest(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters on the CPU (for tests and debugging; a collective on FSDP models)."""
    return {name: _full(p).detach().float().cpu().clone() for name, p in model.named_parameters()}


@torch.no_grad()
def weights_digest(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """SHA-256 of every full parameter in `dtype`, in parameter order (a collective on FSDP
    models: every actor rank calls it; all return the same digest)."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        full = _full(param).detach().to(dtype).contiguous().cpu()
        digest.update(name.encode())
        digest.update(full.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
