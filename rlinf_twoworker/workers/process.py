"""A component process's own facts, without heavy imports: where it runs (its first answer to
the run comes before its model loads, and the preflight waits for it), when it started, its
memory and its log. The process's host (run/group.ComponentHost) answers these for every
worker, so no worker implements them; the reward's process never imports torch for them."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

from rlinf_twoworker import components

GIB = 2**30


def node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:
        pass
    return "127.0.0.1"


def place(component: str, rank: int) -> dict[str, Any]:
    """Component, rank, host, IP, pid and, in a Ray worker, node and GPU ids of this process
    (for topology and error messages)."""
    info: dict[str, Any] = {
        "component": component,
        "rank": rank,
        "host": socket.gethostname(),
        "ip": node_ip(),
        "pid": os.getpid(),
    }
    try:
        import ray

        if ray.is_initialized():
            info["node_id"] = ray.get_runtime_context().get_node_id()
            info["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    except Exception:
        pass
    return info


def process_memory(gpu: bool = False) -> dict[str, float]:
    """This process's memory, in GiB: host RSS now and its peak since the process started
    and, with `gpu`, the peak allocated and reserved by PyTorch on its GPU (cuda:0, the one
    Ray gave it) since the last report (the peaks are reset, so each report covers one
    step)."""
    import resource

    import psutil

    rss = psutil.Process().memory_info().rss
    # Linux reports ru_maxrss in KiB; the kernel's high-water mark can trail the current RSS.
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    out = {"host_rss_gib": rss / GIB, "host_peak_rss_gib": peak / GIB}
    if gpu:
        import torch

        device = torch.device("cuda", 0)
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / GIB
        out["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / GIB
        torch.cuda.reset_peak_memory_stats(device)
    return out


class _Tee:
    """A text stream that also writes to a log file (per-worker logs keep what the process
    prints as well as its log records)."""

    def __init__(self, stream: Any, log: Any) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.log.write(text)
        self.log.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


_attached: list[tuple[Any, Any, Any, logging.Handler]] = []
"""(stdout, stderr, the log file, the handler) as they were before each attach_log."""


def attach_log(path: str, component: str, rank: int) -> None:
    """runner.per_worker_log: this process's prints, warnings and log records also go to
    `path` (log/<component>-<rank>.log in the run directory), until `detach_log`."""
    log = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed by detach_log)
    before = (sys.stdout, sys.stderr)
    sys.stdout = _Tee(sys.stdout, log)
    sys.stderr = _Tee(sys.stderr, log)  # warnings print here too
    handler = logging.StreamHandler(sys.stderr)  # records reach Ray's worker log and the file
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {component}:{rank} %(levelname)s %(name)s: %(message)s")
    )
    library = logging.getLogger("rlinf_twoworker")
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    _attached.append((*before, log, handler))
    logging.getLogger("rlinf_twoworker").info(f"{component} rank {rank} logs to {path}")


def detach_log() -> None:
    """Undo every attach_log: the process logs as it did before (a kept process's next run
    has a log of its own)."""
    while _attached:
        stdout, stderr, log, handler = _attached.pop()
        logging.getLogger("rlinf_twoworker").removeHandler(handler)
        sys.stdout, sys.stderr = stdout, stderr
        log.close()


def drop_worker(cuda: bool) -> None:
    """After a kept process's worker is dropped: collect it (what engines/offload.settle_heap
    froze included: a frozen cycle would keep the old model alive), forget what torch.compile
    traced of its model (a later model is traced afresh, not counted against the recompile
    limit), and give its GPU memory back."""
    import gc

    gc.unfreeze()
    gc.collect()
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    if cuda and "torch" in sys.modules:
        sys.modules["torch"].cuda.empty_cache()


def process_times(began: float) -> dict[str, Any]:
    """Wall-clock marks of this process's start: created (by Ray's worker pool), imported
    (the library's first import) and began (the component's constructor); preloaded: whether
    Ray's worker imported rlinf_twoworker.preload before it took the component."""
    import rlinf_twoworker

    try:
        import psutil

        created: float | None = psutil.Process().create_time()
    except Exception:  # psutil comes with ray[default]; without it the split is unknown
        created = None
    return {
        "created": created,
        "imported": rlinf_twoworker._imported_at,
        "began": began,
        "preloaded": components.PRELOAD_MODULE in sys.modules,
    }
