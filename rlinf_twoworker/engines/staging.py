"""Checkpoint staging: host buffers for the actor's state, allocated once, in the background.

A checkpoint written straight from the GPU copies each tensor to fresh CPU memory inside DCP's
write threads; on the H200 that copying, not the disk, set the pace (the 1.5B actor's 21.3 GB:
19-22 s with 8 streams, against 9-12 s for the same bytes written from CPU memory). So each
actor rank keeps buffers for its state in host memory for the run: allocated and touched in a
thread as soon as the actor is built, and reused by every checkpoint
(`runner.checkpoint_staging`), which copies its state into them and writes from there.

The buffers are ordinary (pageable) memory, touched ahead (by ALLOCATION_THREADS threads) so
the copy meets no page faults:
the GPU copies into them at 13.5 GB/s, and making them (0.9 s for 8 GiB, on the CPU) leaves the
process's GPU work alone. Pinned buffers copy at 55 GB/s, but pinning holds the CUDA driver
against the process's other GPU calls while it runs: 12 s for 21.3 GB, during which the
actor's weight sync took 7.1-12.6 s instead of 0.4 s (`benchmarks/probe_staging.py`,
`benchmarks/results/staging-default-h200.json`, f8d33aa).

Buffers are matched to the state's tensors by local shape and dtype: a model's parameters'
shards and, for AdamW, two moments of the same shapes. A tensor without a matching buffer is
copied to fresh memory (correct, just slower).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rlinf_twoworker.engines import tensors

Key = tuple[tuple[int, ...], torch.dtype]
ALLOCATION_THREADS = 4
"""Threads that fault the buffers' pages in: the 1.5B actor's 21.3 GB took 10-13 s in one."""


class StagingBuffers:
    """Host buffers for `copies` tensors of each of `shapes`, allocated and touched by
    `start()` in a thread; `stage(state)` copies a state dict into them and `release` hands
    them back."""

    def __init__(self, shapes: Iterable[Key], copies: int) -> None:
        self.wanted = [key for key in shapes for _ in range(copies)]
        self.bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.wanted)
        self._pool: dict[Key, list[torch.Tensor]] = defaultdict(list)
        self._ready = threading.Event()
        self.seconds: float | None = None  # the allocation's, once done
        self.error: BaseException | None = None
        self.misses = 0  # tensors of the last stage() that had no buffer

    def start(self) -> None:
        threading.Thread(target=self._allocate, name="checkpoint-staging", daemon=True).start()

    def _allocate(self) -> None:
        start = time.perf_counter()

        def make(keys: list[Key]) -> list[torch.Tensor]:
            # zero_: the pages faulted in now, not in the copy (the kernel's work, page by
            # page: one thread gives about 2 GB/s, so several share the buffers).
            return [torch.empty(shape, dtype=dtype).zero_() for shape, dtype in keys]

        try:
            shares = [self.wanted[i::ALLOCATION_THREADS] for i in range(ALLOCATION_THREADS)]
            with ThreadPoolExecutor(ALLOCATION_THREADS, "checkpoint-staging") as pool:
                for keys, made in zip(shares, pool.map(make, shares)):
                    for key, buffer in zip(keys, made):
                        self._pool[key].append(buffer)
        except BaseException as exc:  # out of host memory: checkpoints copy as before
            self.error = exc
            self._pool.clear()
        finally:
            self.seconds = time.perf_counter() - start
            self._ready.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def stage(self, state: Any) -> tuple[Any, list[torch.Tensor]]:
        """`state` with every tensor (a DTensor's local shard) copied into a buffer; waits for
        the allocation. Returns the staged state and the buffers it took (give them back with
        `release` once the state is written)."""
        from torch.distributed.tensor import DTensor

        self._ready.wait()
        taken: list[torch.Tensor] = []
        self.misses = 0

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            free = self._pool.get((tuple(tensor.shape), tensor.dtype))
            if free:
                buffer = free.pop()
                taken.append(buffer)
            else:
                self.misses += 1
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            return buffer.copy_(tensor)

        def walk(value: Any) -> Any:
            if isinstance(value, DTensor):
                # The same sharding over a host copy of the local shard (as torch's own stager
                # builds it), so DCP writes it where the GPU shard would have gone.
                return DTensor(copy(value._local_tensor), value._spec, requires_grad=False)
            if isinstance(value, torch.Tensor):
                return copy(value.detach())
            if isinstance(value, dict):
                return {k: walk(v) for k, v in value.items()}
            if isinstance(value, list):
                return [walk(v) for v in value]
            return value

        return walk(state), taken

    def release(self, taken: list[torch.Tensor]) -> None:
        for buffer in taken:
            self._pool[(tuple(buffer.shape), buffer.dtype)].append(buffer)


def for_model(model: torch.nn.Module, copies: int) -> StagingBuffers:
    """Buffers for `copies` tensors shaped like each parameter's local shard (an FSDP2
    DTensor's, or the parameter's own), e.g. 3 for the weights and AdamW's two moments."""
    shapes = [(tuple(tensors.local(p).shape), p.dtype) for p in model.parameters()]
    return StagingBuffers(shapes, copies)


def started_if_room(buffers: StagingBuffers, available: int, who: str) -> StagingBuffers | None:
    """`buffers` started, unless they need over half of the `available` host bytes: then
    None, with a warning that names `who` (the actor rank and node), the sizes and the
    switch; checkpoints then copy from the GPU as they write."""
    if buffers.bytes > available / 2:
        logging.getLogger("rlinf_twoworker").warning(
            f"{who}: runner.checkpoint_staging skipped: its buffers need "
            f"{buffers.bytes / 2**30:.1f} GiB of host memory, over half of the "
            f"{available / 2**30:.1f} GiB available; checkpoints copy from the GPU as they "
            "write (set runner.checkpoint_staging=false to silence this)"
        )
        return None
    buffers.start()
    return buffers
