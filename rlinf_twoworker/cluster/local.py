"""A multi-node Ray cluster on one host, on loopback only, for the demo and the tests.

Each node is a real raylet process; STRICT_SPREAD, bundle pinning and cross-node collectives are
exercised for real. Where the host has enough CUDA GPUs every node gets its own slice through
CUDA_VISIBLE_DEVICES; otherwise the nodes declare logical GPUs and components run on the CPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

from rlinf_twoworker.components import PRELOAD_MODULE

LOOPBACK = "127.0.0.1"
# Ray picks the address its processes bind to from this switch at import time; with it off,
# every node and the Driver use loopback instead of the machine's external address.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The scenario's clusters have no RDMA; its preflight requires this on every node.
os.environ.setdefault("NCCL_IB_DISABLE", "1")


def visible_cuda_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


@contextlib.contextmanager
def _host_address_untouched() -> Iterator[None]:
    """Keep this host's record of *its* Ray cluster (<default temp dir>/ray_current_cluster,
    how `ray.init("auto")` and `ray status` find the platform's cluster) as it is: Ray's test
    cluster would overwrite it on start and delete it on shutdown."""
    import ray._common.utils
    import ray._private.utils

    write, reset = ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address
    ray._private.utils.write_ray_address = lambda *args, **kwargs: None
    ray._common.utils.reset_ray_address = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ray._private.utils.write_ray_address, ray._common.utils.reset_ray_address = write, reset


class LocalCluster:
    """Several real Ray nodes on this host, on loopback, for the demo, tests and notebooks.

        with LocalCluster(num_nodes=2, gpus_per_node=2) as cluster:
            handle = run_grpo_two_worker(cfg)   # this process is connected already

    The context manager connects this process (unless connect=False; then connect with
    `ray.init(address=cluster.address)`) and shuts everything down on exit. The cluster keeps
    its session files in a temporary directory of its own and never touches another Ray
    cluster running on the host (its address file, its session directory). preload=True
    starts the nodes as `RAY_preload_python_modules=rlinf_twoworker.preload
    RAY_enable_worker_prestart=1 ray start` would: each node's idle workers (one per CPU)
    import the library ahead of a run (rlinf_twoworker/preload.py). cpu_head=True adds a
    head node without GPUs in front of the num_nodes GPU nodes, as KubeRay and hosted Ray
    make it: this process connects to it, and the run's bundle 0 goes to a GPU node.
    system_config: Ray's system settings for every node (`_system_config`), e.g.
    {"metrics_report_interval_ms": 2000} to see Ray's metrics sooner than every 10 s.
    """

    def __init__(
        self,
        num_nodes: int = 2,
        gpus_per_node: int = 2,
        cpus_per_node: int = 4,
        connect: bool = True,
        object_store_mb: int = 150,
        preload: bool = False,
        cpu_head: bool = False,
        system_config: dict[str, Any] | None = None,
    ) -> None:
        if num_nodes < 1 or gpus_per_node < 1:
            raise ValueError(
                f"LocalCluster needs num_nodes >= 1 and gpus_per_node >= 1, got "
                f"{num_nodes} x {gpus_per_node}"
            )
        self.num_nodes, self.gpus_per_node = num_nodes, gpus_per_node
        self.cpus_per_node, self.connect = cpus_per_node, connect
        self.preload, self.cpu_head = preload, cpu_head
        self.system_config = dict(system_config or {})
        self.object_store_bytes = object_store_mb * 1024 * 1024
        self.real_gpus = visible_cuda_gpus() >= num_nodes * gpus_per_node
        self._cluster: Any = None  # ray.cluster_utils.Cluster once started
        self._temp_dir: str | None = None  # this cluster's own Ray temp directory
        self._connected = False  # whether start() connected this process (and so may shut down)
        self._added: dict[str, Any] = {}  # node id -> the node add_node started

    @property
    def address(self) -> str:
        if self._cluster is None:
            raise RuntimeError("LocalCluster is not started; use it as a context manager")
        return self._cluster.address

    @property
    def accelerator(self) -> str:
        return "cuda" if self.real_gpus else "cpu"

    def _node_args(self, index: int) -> dict:
        args = {
            "num_cpus": self.cpus_per_node,
            "num_gpus": self.gpus_per_node,
            "node_ip_address": LOOPBACK,
            "object_store_memory": self.object_store_bytes,
            "resources": {f"local_node_{index}": 1.0},
            "temp_dir": self._temp_dir,
        }
        if self.real_gpus:
            first = index * self.gpus_per_node
            gpus = ",".join(str(first + g) for g in range(self.gpus_per_node))
            args["env_vars"] = {"CUDA_VISIBLE_DEVICES": gpus}
        return args

    def start(self) -> LocalCluster:
        import ray
        import ray._private.ray_constants as ray_constants
        from ray.cluster_utils import Cluster

        # Ray reads this switch when it is imported; a process that imported Ray before this
        # module needs the constant itself turned off, or the head dials the external address.
        ray_constants.ENABLE_RAY_CLUSTER = False
        # Short: Ray's unix socket paths live under it and must stay under ~100 characters.
        self._temp_dir = tempfile.mkdtemp(prefix="rlinf-ray-", dir="/tmp")
        if self.cpu_head:  # a node of CPUs only, then every GPU node
            head = dict(self._node_args(0), num_gpus=0, resources={"local_head": 1.0})
            head.pop("env_vars", None)
            gpu_nodes = range(self.num_nodes)
        else:
            head, gpu_nodes = self._node_args(0), range(1, self.num_nodes)
        head.update(include_dashboard=False, dashboard_host=LOOPBACK)
        system = dict(self.system_config)  # cluster-wide: every raylet reads it from the head
        if self.preload:
            system.update(preload_python_modules=[PRELOAD_MODULE], enable_worker_prestart=True)
        if system:
            head["_system_config"] = system
        with _host_address_untouched():
            cluster = Cluster(initialize_head=True, head_node_args=head)
            self._cluster = cluster
            for index in gpu_nodes:
                cluster.add_node(**self._node_args(index))
        cluster.wait_for_nodes()
        if self.connect and not ray.is_initialized():
            ray.init(
                address=self.address,
                _node_ip_address=LOOPBACK,
                namespace="rlinf_twoworker",
                log_to_driver=True,
            )
            self._connected = True
        return self

    def add_node(self, gpus: int | None = None, timeout_s: float = 60.0) -> str:
        """Start one more node (gpus: its GPUs, default gpus_per_node; its CPUs and object
        store as the others'), wait until it has joined, and return its Ray node id: a cluster
        that grows while it runs, as an autoscaler grows one. `remove_node` takes it out."""
        if self._cluster is None:
            raise RuntimeError("LocalCluster is not started; start it before adding a node")
        index = len(self._cluster.list_all_nodes())
        args = self._node_args(index)
        if gpus is not None:
            args["num_gpus"] = gpus
        with _host_address_untouched():
            node = self._cluster.add_node(**args)
        self._cluster.wait_for_nodes(timeout=timeout_s)
        self._added[node.node_id] = node
        return node.node_id

    def remove_node(self, node_id: str, timeout_s: float = 30.0, graceful: bool = True) -> None:
        """Stop a node that add_node started and wait until Ray no longer counts it alive
        (TimeoutError after timeout_s). graceful=False kills its processes at once, with no
        drain: a machine lost."""
        import ray

        node = self._added.pop(node_id)
        self._cluster.remove_node(node, allow_graceful=graceful)
        deadline = time.monotonic() + timeout_s
        while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id[:8]} still counts as alive {timeout_s:g} s on")
            time.sleep(0.1)

    def shutdown(self) -> None:
        import ray

        # A process already connected elsewhere (a test session's cluster) stays connected.
        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
        if self._cluster is not None:
            with _host_address_untouched():
                self._cluster.shutdown()
            self._cluster = None
            self._added.clear()
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
