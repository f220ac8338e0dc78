"""Connecting a Driver (or a notebook, or another Ray program) to a running cluster, never
starting one, and checking that the cluster is the one the config asks for."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import ray

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import ClusterError

NAMESPACE = "rlinf_twoworker"
"""The Ray namespace of every run's actors, named by `ray_name`."""
CONNECT_PROBE_S = 10.0
_WHERE_TO_CONNECT = (
    "The library connects to a running cluster and never starts one: run the Driver on a "
    "node of the cluster (the Head), or give the cluster's address (the CLI's --address "
    "HOST:PORT, the RAY_ADDRESS environment variable, or run_grpo_two_worker(..., "
    "ray_address=...)). To try the library on this machine alone: rlinf-twoworker demo"
)


def ray_name(run_dir: str | Path, *parts: str | int) -> str:
    """The name of a run's actor or placement group: `<run_id>-<8 hex>:<part>:...`, the hex
    being the start of sha256 of the resolved run directory. The RUN_ID leads, so operators
    recognise the run in `ray list actors`; the hash makes two runs with one RUN_ID under two
    output roots, or a dead run's leftovers, never share (or remove) each other's names."""
    resolved = Path(run_dir).resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:8]
    return ":".join([f"{resolved.name}-{digest}", *map(str, parts)])


def _probe_address(ray_address: str) -> None:
    """Fail in seconds when nothing listens at host:port (ray.init would retry for minutes)."""
    import socket

    host, sep, port = ray_address.rpartition(":")
    if not sep or not port.isdigit() or "://" in ray_address:
        return  # 'auto', a ray:// client address: left to ray.init
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_PROBE_S):
            pass
    except OSError as exc:
        raise ClusterError(
            f"no Ray cluster reachable at {ray_address}: cannot open a TCP connection to the "
            f"GCS ({exc}). Check the address (the head's `ray start --head` prints it) and "
            f"that the head is up. {_WHERE_TO_CONNECT}"
        ) from exc


def _bootstrap_address(ray_address: str | None) -> str:
    """The GCS address ray.init will dial: the argument, RAY_ADDRESS, or the address this
    host's last `ray start` recorded ('auto' when none is known)."""
    address = ray_address or os.environ.get("RAY_ADDRESS") or "auto"
    if address != "auto":
        return address
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address("auto") or "auto"
    except Exception:  # no cluster recorded on this host: ray.init says so itself
        return "auto"


def connect(ray_address: str | None, cfg: GRPOConfig | None = None) -> None:
    """Connect to a running cluster (never start one), failing in seconds when none answers;
    with `cfg`, check that the cluster has the nodes and GPUs it asks for."""
    if not ray.is_initialized():  # else: embedded in another Ray program, use its connection
        _connect(ray_address)
    if cfg is not None:
        check_cluster(cfg)


def _connect(ray_address: str | None) -> None:
    _probe_address(_bootstrap_address(ray_address))
    try:
        ray.init(address=ray_address or "auto", namespace=NAMESPACE, log_to_driver=False)
    except (ConnectionError, RuntimeError) as exc:
        reason = " ".join(str(exc).split()).rstrip(".")
        raise ClusterError(
            f"no Ray cluster reachable at {ray_address or 'auto'}: {reason}. {_WHERE_TO_CONNECT}"
        ) from exc


def check_cluster(cfg: GRPOConfig) -> None:
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus = sorted(int(n["Resources"].get("GPU", 0)) for n in alive)
    if len(alive) < cfg.cluster.num_nodes:
        raise ClusterError(
            f"Ray finds {len(alive)} alive node(s) but cluster.num_nodes={cfg.cluster.num_nodes}: "
            "the cluster is not what the config asks for. Wait for the workers to join, or "
            "lower cluster.num_nodes."
        )
    enough = [g for g in gpus if g >= cfg.cluster.num_gpus_per_node]
    if len(enough) < cfg.cluster.num_nodes:
        raise ClusterError(
            f"{cfg.cluster.num_nodes} nodes with {cfg.cluster.num_gpus_per_node} GPUs each are "
            f"needed; the alive nodes have GPUs {gpus}. Fix cluster.num_gpus_per_node."
        )
