"""Weight sync from the FSDP actor to rollout and inference through torch.distributed.

Topology of one sync: every actor rank takes part in gathering each parameter's full tensor
(FSDP2 `full_tensor`, a collective of the actor group); actor rank 0 packs them into flat
buckets and broadcasts each bucket once across the node boundary to a relay (the first
consumer), which fans it out to the other consumers on its node. Nothing goes through the Ray
object store or files. Both sides derive the same bucket layout from the same architecture.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlinf_twoworker.engines import tensors

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class SyncGroups:
    """Global ranks of the sync and the process groups that carry it."""

    source: int  # actor rank 0
    relay: int  # first consumer: receives across the node boundary
    consumers: tuple[int, ...]  # relay first
    cross: dist.ProcessGroup  # group {source, relay}
    fanout: dist.ProcessGroup | None  # group {consumers}, None when there is one consumer
    cross_on_host: bool = False  # the group is gloo: GPU buckets travel through host memory
    fanout_on_host: bool = False


def new_sync_groups(
    actor_ranks: list[int],
    consumer_ranks: list[int],
    shared_gpu: tuple[bool, bool] = (False, False),
) -> SyncGroups:
    """Create the groups; every process of the world must call this, in the same order.

    NCCL cannot join two processes on one GPU, so a group whose members share a GPU (the
    colocated single-GPU topology) uses gloo and stages buckets in host memory instead."""
    source, relay = actor_ranks[0], consumer_ranks[0]
    cross = dist.new_group([source, relay], backend="gloo" if shared_gpu[0] else None)
    fanout = None
    if len(consumer_ranks) > 1:
        fanout = dist.new_group(consumer_ranks, backend="gloo" if shared_gpu[1] else None)
    return SyncGroups(source, relay, tuple(consumer_ranks), cross, fanout, *shared_gpu)


def _broadcast(
    flat: torch.Tensor, src: int, group: dist.ProcessGroup | None, on_host: bool
) -> None:
    if on_host and flat.device.type == "cuda":
        staged = flat.cpu()
        dist.broadcast(staged, src=src, group=group)
        flat.copy_(staged)
    else:
        dist.broadcast(flat, src=src, group=group)


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


def _model_buckets(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int
) -> tuple[list[torch.nn.Parameter], list[list[int]]]:
    """The model's parameters in order and their bucket layout for `dtype`: what the actor's
    and the consumers' sides each derive, so both agree without exchanging it."""
    params = [p for _, p in model.named_parameters()]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return params, bucket_plan([p.shape for p in params], itemsize, bucket_bytes)


def _source_buckets(
    model: torch.nn.Module, dtype: torch.dtype, bucket_bytes: int, is_source: bool
) -> Iterator[torch.Tensor]:
    """Flat buckets of the full weights, yielded on the source; every actor rank must iterate
    (gathering a full tensor is a collective of the actor group)."""
    params, plan = _model_buckets(model, dtype, bucket_bytes)
    for bucket in plan:
        fulls = [tensors.full(params[i]) for i in bucket]
        if is_source:
            yield torch.cat([t.detach().to(dtype).reshape(-1) for t in fulls])


def _unpack(flat: torch.Tensor, params: Sequence[torch.Tensor], bucket: list[int]) -> None:
    offset = 0
    for i in bucket:
        n = params[i].numel()
        params[i].copy_(flat[offset : offset + n].view_as(params[i]))
        offset += n


@torch.no_grad()
def send_weights(
    model: torch.nn.Module,
    groups: SyncGroups,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Actor side (all actor ranks call it). Returns the bytes broadcast by the source."""
    sent = 0
    for flat in _source_buckets(model, dtype, bucket_bytes, dist.get_rank() == groups.source):
        _broadcast(flat, groups.source, groups.cross, groups.cross_on_host)
        sent += flat.numel() * flat.element_size()
    return sent


@torch.no_grad()
def receive_weights(
    model: torch.nn.Module,
    groups: SyncGroups,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Consumer side (rollout, inference). Returns the bytes received."""
    params, plan = _model_buckets(model, dtype, bucket_bytes)
    rank = dist.get_rank()
    received = 0
    for bucket in plan:
        numel = sum(params[i].numel() for i in bucket)
        flat = torch.empty(numel, dtype=dtype, device=params[0].device)
        if rank == groups.relay:
            _broadcast(flat, groups.source, groups.cross, groups.cross_on_host)
        if groups.fanout is not None:
            _broadcast(flat, groups.relay, groups.fanout, groups.fanout_on_host)
        _unpack(flat, params, bucket)
        received += flat.numel() * flat.element_size()
    return received


@torch.no_grad()
def export_weights(
    model: torch.nn.Module,
    dtype: torch.dtype,
    is_source: bool,
    consumers: int = 1,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[list[torch.Tensor], list[list]]:
    """Colocated sync, actor side: the buckets stay on the GPU and consumers map them through
    CUDA IPC handles (no host copy, no NCCL between processes of one GPU). One list of handles
    per consumer: each handle carries one count of the sender's IPC reference counter, which
    the consumer that opens it gives back, so a handle shared by two consumers would be given
    back twice and the block never freed (one copy of the weights a step). The caller keeps
    the returned buckets alive until every consumer has imported them, then collects them
    (torch.cuda.ipc_collect)."""
    from torch.multiprocessing.reductions import reduce_tensor

    buckets = list(_source_buckets(model, dtype, bucket_bytes, is_source))
    if buckets:
        torch.cuda.synchronize()  # the buckets are complete before anyone maps them
    return buckets, [[reduce_tensor(b) for b in buckets] for _ in range(consumers)]


@torch.no_grad()
def import_weights(
    model: torch.nn.Module,
    handles: list,
    dtype: torch.dtype,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> int:
    """Colocated sync, consumer side: copy each bucket from the actor's GPU memory."""
    params, plan = _model_buckets(model, dtype, bucket_bytes)
    if len(plan) != len(handles):
        raise RuntimeError(
            f"weight sync: {len(handles)} buckets exported, {len(plan)} expected; "
            "the actor's and this component's models differ in architecture"
        )
    received = 0
    for bucket, (rebuild, args) in zip(plan, handles):
        flat = rebuild(*args)
        _unpack(flat, params, bucket)
        received += flat.numel() * flat.element_size()
        del flat
    torch.cuda.synchronize()  # copies done before the actor may free the buckets
    return received


@torch.no_grad()
def weights_digest(model: torch.nn.Module, dtype: torch.dtype) -> str:
    """SHA-256 of every full parameter in `dtype`, in parameter order (a collective on FSDP
    models: every actor rank calls it; all return the same digest)."""
    import hashlib

    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        full = tensors.full(param).detach().to(dtype).contiguous().cpu()
        digest.update(name.encode())
        digest.update(full.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
