"""LocalCluster: real Ray nodes on one host, loopback only, no dashboard, logical GPUs."""

from __future__ import annotations

import importlib
import os

import pytest
import ray

from rlinf_twoworker.cluster.local import LocalCluster

# Ray ships psutil in ray/thirdparty_files and puts that on sys.path when imported.
psutil = importlib.import_module("psutil")

LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1", "::1")


@ray.remote(num_cpus=0)
class Pinned:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def cluster_processes() -> list[psutil.Process]:
    """This process and every process it started: GCS, raylets, agents, workers."""
    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def cmdline_of(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):  # a worker that just exited
        return ""


def bound_sockets(process: psutil.Process) -> list[tuple[str, int, str]]:
    """(ip, port, kind) of each listening TCP socket and each bound UDP socket."""
    try:
        conns = process.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []
    return [
        (c.laddr.ip, c.laddr.port, "tcp" if c.status == psutil.CONN_LISTEN else "udp")
        for c in conns
        if c.laddr and (c.status == psutil.CONN_LISTEN or c.status == psutil.CONN_NONE)
    ]


def test_every_ray_socket_listens_on_loopback(cluster_2x2):
    # A worker on every node, so the workers' own servers are checked too.
    actors = [
        Pinned.options(resources={f"local_node_{i}": 0.01}).remote()
        for i in range(cluster_2x2.num_nodes)
    ]
    assert len(set(ray.get([a.node.remote() for a in actors], timeout=60))) == 2
    try:
        processes = cluster_processes()
        names = [cmdline_of(p) for p in processes]
        assert sum("gcs_server" in n for n in names) == 1
        assert sum("raylet/raylet" in n for n in names) == cluster_2x2.num_nodes
        exposed, checked = [], 0
        for process in processes:
            for ip, port, kind in bound_sockets(process):
                checked += 1
                if ip not in LOOPBACK:
                    exposed.append(f"{process.pid} {cmdline_of(process)[:80]} {kind} {ip}:{port}")
        assert checked >= 5
        assert exposed == []
    finally:
        for actor in actors:
            ray.kill(actor)


def test_no_dashboard_is_started(cluster_2x2):
    assert ray._private.worker.global_worker.node.address_info.get("webui_url") in (None, "")
    # Ray always runs its head API process; without the dashboard it serves no web frontend
    # and loads only the usage-stats module.
    for process in cluster_processes():
        cmdline = cmdline_of(process)
        if "dashboard/dashboard.py" in cmdline:
            assert "--disable-frontend" in cmdline
            assert "--modules-to-load=UsageStatsHead" in cmdline
        for _, port, kind in bound_sockets(process):
            assert not (kind == "tcp" and port == 8265), cmdline


def test_nodes_declare_their_gpus_as_logical_resources(cluster_2x2):
    alive = sorted(
        (n for n in ray.nodes() if n["Alive"]),
        key=lambda n: "local_node_0" not in n["Resources"],
    )
    assert len(alive) == cluster_2x2.num_nodes == 2
    for index, node in enumerate(alive):
        resources = node["Resources"]
        assert resources["GPU"] == cluster_2x2.gpus_per_node == 2
        assert resources["CPU"] == cluster_2x2.cpus_per_node
        assert resources[f"local_node_{index}"] == 1
        assert node["NodeManagerAddress"] == "127.0.0.1"
    assert ray.cluster_resources()["GPU"] == 4
    assert cluster_2x2.address.startswith("127.0.0.1:")


@pytest.mark.parametrize(("nodes", "gpus"), [(0, 2), (2, 0), (-1, 1)])
def test_refuses_an_empty_cluster(nodes: int, gpus: int):
    with pytest.raises(ValueError, match="num_nodes >= 1 and gpus_per_node >= 1"):
        LocalCluster(num_nodes=nodes, gpus_per_node=gpus)


def test_address_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="not started"):
        _ = LocalCluster(1, 1).address


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def test_a_second_local_cluster_leaves_this_process_and_another_clusters_files_alone(
    cluster_2x2,
):
    """A second LocalCluster, started from this session's process (already connected to its
    cluster):
    - the process is neither moved nor disconnected;
    - on a managed Head the platform's cluster is found through <default temp dir>/
      ray_current_cluster and /tmp/ray/session_latest: a LocalCluster must not rewrite or
      delete either (its own session files live in a directory of its own, removed with it)."""
    from ray._common.utils import get_default_ray_temp_dir

    default = get_default_ray_temp_dir()
    address_file = os.path.join(default, "ray_current_cluster")
    latest = os.path.join(default, "session_latest")
    before = _read(address_file) if os.path.exists(address_file) else None
    latest_before = os.path.realpath(latest) if os.path.lexists(latest) else None
    os.makedirs(default, exist_ok=True)
    with open(address_file, "w") as handle:
        handle.write("10.11.12.13:6379")  # "the platform's cluster"
    try:
        with LocalCluster(num_nodes=1, gpus_per_node=1, cpus_per_node=1) as other:
            assert other.address != cluster_2x2.address
            assert len([n for n in ray.nodes() if n["Alive"]]) == 2  # still the session's
            own = other._temp_dir
            assert own is not None and not own.startswith(default + os.sep)
            assert any(name.startswith("session_") for name in os.listdir(own))
            assert _read(address_file) == "10.11.12.13:6379"
        assert _read(address_file) == "10.11.12.13:6379"
        assert not os.path.exists(own)  # its own files go with it
        now = os.path.realpath(latest) if os.path.lexists(latest) else None
        assert now == latest_before
    finally:
        if before is None:
            os.remove(address_file)
        else:
            with open(address_file, "w") as handle:
                handle.write(before)
    assert ray.is_initialized()
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    actor = Pinned.remote()
    assert ray.get(actor.node.remote(), timeout=60)
    ray.kill(actor)


def test_system_config_reaches_the_driver_and_the_workers(cluster_2x2):
    """conftest.py starts the session's cluster with Ray's metrics reported every 2 s."""

    @ray.remote(num_cpus=0)
    def interval() -> int:
        return ray._config.metrics_report_interval_ms()

    assert ray._config.metrics_report_interval_ms() == 2000
    assert ray.get(interval.remote(), timeout=60) == 2000
