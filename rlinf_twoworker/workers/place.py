"""Where a component process runs, without heavy imports: its first answer to the run comes
before its model is loaded, and the preflight waits for it (run/group.py)."""

from __future__ import annotations

import os
import socket
from typing import Any


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
