"""Per-node preflight: one probe pinned to each node, checking its GPUs, before any training.

`preflight` pins one `probe.NodeProbe` to each bundle of the placement group, compares what
the nodes report, runs a cross-node all-reduce, prints the status lines, writes
`preflight.json` and raises PreflightError on any failure. A run starts its components'
processes at the same time (`Beside`): the probes then check the GPUs Ray gave them, and
no model is loaded before the preflight and the memory plan have passed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlinf_twoworker.cluster.placement import bundle_node_ids
from rlinf_twoworker.cluster.probe import NodeProbe
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.errors import PreflightError
from rlinf_twoworker.storage.rundir import PREFLIGHT_JSON, atomic_write_text


def compare_nodes(nodes: list[dict[str, Any]]) -> list[str]:
    """Cross-node errors: manifest digests and driver versions must be equal on every node."""
    errors = []
    labels = dict.fromkeys(k for n in nodes for k in n.get("manifests", {}))
    where = lambda n: f"node {n['node_rank']} ({n.get('hostname')})"  # noqa: E731
    for label in labels:
        seen = {where(n): n["manifests"][label] for n in nodes if label in n.get("manifests", {})}
        if len(set(seen.values())) > 1:
            errors.append(
                f"input {label}: the SHA256SUMS digests differ between nodes ({seen}); the nodes "
                "see different files: make every node read the same copy on shared storage"
            )
    drivers = {where(n): n.get("driver_version") for n in nodes if n.get("driver_version")}
    if len(set(drivers.values())) > 1:
        errors.append(
            f"NVIDIA driver versions differ between nodes ({drivers}); run every node on the "
            "same driver (the same machine image)"
        )
    return errors


@dataclass
class PreflightReport:
    passed: bool
    nodes: list[dict[str, Any]]
    errors: list[str]
    cluster_resources: dict[str, float]
    collective: dict[str, Any] | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _collective(probes: _Probes, nodes: list[dict], cfg: GRPOConfig, deadline: float) -> dict:
    """All-reduce across the probes; a stall fails within the timeout, naming the addresses."""
    backend = "nccl" if cfg.cluster.accelerator == "cuda" else "gloo"
    timeout_s = max(1.0, min(cfg.runner.timeouts.collective_s, deadline - time.monotonic()))
    world = len(probes)
    out: dict[str, Any] = {"backend": backend, "init_method": None, "world_size": world}
    out.update(expected=world * (world + 1) / 2, results=[], error=None)
    try:
        port = await asyncio.wait_for(probes.call(0, "free_port"), timeout_s)
        out["init_method"] = f"tcp://{nodes[0]['ip']}:{port}"
        args = (out["init_method"], world, backend, timeout_s)
        refs = [probes.call(i, "all_reduce", args[0], i, *args[1:]) for i in range(world)]
        out["results"] = await asyncio.wait_for(asyncio.gather(*refs), timeout_s + 10.0)
    except Exception as exc:  # a stall or a failed rendezvous, reported below
        text = str(exc).strip().splitlines() or [type(exc).__name__]
        out["error"] = f"{type(exc).__name__}: {text[-1][:300]}"
    if out["error"] or any(v != out["expected"] for v in out["results"]):
        addresses = ", ".join(f"node {n['node_rank']} {n['hostname']} {n['ip']}" for n in nodes)
        out["error"] = (
            f"cross-node all-reduce ({backend}, rendezvous {out['init_method']}) between "
            f"{addresses} failed: {out['error'] or out['results']}; check that the nodes reach "
            "each other over TCP (firewall, NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME)"
        )
    return out


@dataclass
class Beside:
    """The run's components, started together with the probes (run/controller.py): they hold
    the GPUs of `bundles`, so those bundles' probes hold none and check the GPUs that
    `gpu_ids` names once every component has answered ({bundle: Ray's GPU ids})."""

    bundles: frozenset[int]
    gpu_ids: Awaitable[dict[int, list[str]]]


def _probe_task(probe_cls: type[NodeProbe], method: str, *args: Any) -> Any:
    """One call of a node probe, as a Ray task (`_Probes`)."""
    return getattr(probe_cls(), method)(*args)


class _Probes:
    """One node probe per bundle, pinned to it, holding that node's GPUs (logical ones on a
    CPU cluster) or none where the bundle's components hold them (`shared`).

    On GPUs each probe is an actor: its process, CUDA context and all, ends with the
    preflight (`release`), before the components need the memory. Where no CUDA is touched
    (cluster.accelerator=cpu) each call is a Ray task instead, run in the node's pooled
    worker, which serves the next run's probe too with its heavy imports done (the import
    check finds them imported: probe.import_in_subprocesses); a probe keeps no state between
    calls. `release` ends every call still running (a stalled node, a cancelled run)."""

    def __init__(
        self, cfg: GRPOConfig, pg: PlacementGroup, probe_cls: type[NodeProbe], shared: frozenset
    ) -> None:
        self.pooled = cfg.cluster.accelerator != "cuda"
        self.probe_cls = probe_cls
        self.refs: list[Any] = []

        def pinned(i: int) -> dict[str, Any]:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            )
            gpus = 0 if i in shared else cfg.cluster.num_gpus_per_node
            return {"scheduling_strategy": strategy, "num_gpus": gpus, "num_cpus": 0}

        bundles = range(pg.bundle_count)
        if self.pooled:  # max_calls=0: the worker serves later calls (Ray's default for
            # a task that holds no GPU; one holding GPUs, logical ones included, would get 1)
            task = ray.remote(max_calls=0)(_probe_task)
            name = f"{probe_cls.__name__}.node"
            self.nodes = [task.options(**pinned(i), name=f"{name}{i}") for i in bundles]
        else:
            actor = ray.remote(probe_cls)
            self.nodes = [actor.options(**pinned(i)).remote() for i in bundles]

    def __len__(self) -> int:
        return len(self.nodes)

    def call(self, node: int, method: str, *args: Any) -> Any:
        if self.pooled:
            ref = self.nodes[node].remote(self.probe_cls, method, *args)
        else:
            ref = getattr(self.nodes[node], method).remote(*args)
        self.refs.append(ref)
        return ref

    def release(self) -> None:
        if not self.pooled:
            for actor in self.nodes:
                ray.kill(actor)
            return
        for ref in self.refs:
            try:
                ray.cancel(ref, force=True)  # a no-op for a call that has finished
            except Exception:  # gone with its worker already: nothing left to end
                pass


async def _gather(
    probes: _Probes,
    cfg: GRPOConfig,
    node_ids: list[str],
    deadline: float,
    gpu_ids: dict[int, list[str]],
) -> list[dict]:
    refs = [probes.call(i, "run", cfg, i, gpu_ids.get(i)) for i in range(len(probes))]
    nodes_info = await asyncio.to_thread(ray.nodes)
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in nodes_info}

    async def one(i: int, ref: Any) -> dict:
        where = f"node {i} (Ray node {node_ids[i][:8]}, {ips.get(node_ids[i], '?')})"
        empty = {"node_rank": i, "hostname": "unknown", "ip": ips.get(node_ids[i])}
        try:
            result = await asyncio.wait_for(ref, max(0.1, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            todo = "the node is stalled (storage? imports?); raise runner.timeouts.preflight_s"
            result = dict(empty, errors=[f"{where}: the preflight probe did not answer; {todo}"])
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1][:300]
            result = dict(empty, errors=[f"{where}: the preflight probe failed: {reason}"])
        result.update(bundle=i, ray_node_id=node_ids[i])
        return result

    return list(await asyncio.gather(*(one(i, ref) for i, ref in enumerate(refs))))


def _write_report(output_dir: Path, record: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output_dir / PREFLIGHT_JSON, record)


def resources_line(resources: dict[str, float]) -> str:
    """The cluster's resources as a person reads them: CPU, GPU and other resources by count,
    memory and object store in GiB; what Ray derives from others (placement groups' bundle
    resources, `node:<ip>` markers) left out. preflight.json keeps the whole map."""
    derived = ("node:", "bundle_group_")
    kept = {k: v for k, v in resources.items() if not k.startswith(derived) and "_group_" not in k}
    shown = []
    for key in sorted(kept, key=lambda k: (k not in ("CPU", "GPU"), k)):
        value = kept[key]
        if key in ("memory", "object_store_memory"):
            shown.append(f"{key}={value / 1024**3:.1f}GiB")
        else:
            shown.append(f"{key}={value:g}")
    return " ".join(shown)


def _status_lines(report: PreflightReport, head_ids: set[str], log: Callable) -> None:
    log(f"RAY_CLUSTER_RESOURCES={resources_line(report.cluster_resources)}")
    for n in report.nodes:
        role = "Ray Head" if n["ray_node_id"] in head_ids else "Ray Worker"
        gpu = ",".join(dict.fromkeys(n.get("gpu_names") or [])) or "none"
        log(
            f"WORKER_TOPOLOGY=rank={n['node_rank']} role={role} host={n['hostname']} "
            f"gpu_count={n.get('gpu_count', 0)} gpu={gpu}"
        )
    for n in report.nodes:
        log(f"NVIDIA_DRIVER_VERSION_NODE_{n['node_rank']}={n.get('driver_version') or 'none'}")
    first = f" error={report.errors[0]}" if report.errors else ""
    log(f"RLINF_PREFLIGHT_STATUS={'passed' if report.passed else 'failed'}{first}")


def run_preflight(
    cfg: GRPOConfig,
    pg: PlacementGroup,
    output_dir: Path | None,
    log: Callable[[str], None] = print,
    timeout_s: float | None = None,
    probe_cls: type[NodeProbe] = NodeProbe,
) -> PreflightReport:
    """`preflight` for a caller without an event loop (the CLI's preflight command)."""
    return asyncio.run(preflight(cfg, pg, output_dir, log, timeout_s, probe_cls))


async def preflight(
    cfg: GRPOConfig,
    pg: PlacementGroup,
    output_dir: Path | None,
    log: Callable[[str], None] = print,
    timeout_s: float | None = None,
    probe_cls: type[NodeProbe] = NodeProbe,
    beside: Beside | None = None,
) -> PreflightReport:
    """Probe every bundle's node, compare them, all-reduce across them; raise on any failure.

    Every wait is awaited (the run's controller keeps answering status() and cancel() while
    the probes work). Writes `output_dir/preflight.json` (when given) before raising. The
    probes are killed at the end so the bundles' GPUs are free for the training components;
    with `beside`, the components hold those GPUs already and the probes check theirs.
    """
    start = time.monotonic()
    deadline = start + (timeout_s or cfg.runner.timeouts.preflight_s)
    shared = beside.bundles if beside is not None else frozenset()
    probes = _Probes(cfg, pg, probe_cls, shared)
    try:
        node_ids, nodes_info, resources = await asyncio.gather(
            asyncio.to_thread(bundle_node_ids, pg),
            asyncio.to_thread(ray.nodes),
            asyncio.to_thread(ray.cluster_resources),
        )
        head_ids = {n["NodeID"] for n in nodes_info if "node:__internal_head__" in n["Resources"]}
        gpu_ids = await beside.gpu_ids if beside is not None else {}
        nodes = await _gather(probes, cfg, node_ids, deadline, gpu_ids)
        errors = [e for n in nodes for e in n["errors"]] + compare_nodes(nodes)
        report = PreflightReport(False, nodes, errors, dict(resources))
        if cfg.cluster.preflight.check_collective:
            if all(n.get("ip") and "python_prefix" in n for n in nodes):
                began = time.monotonic()
                report.collective = await _collective(probes, nodes, cfg, deadline)
                report.collective["seconds"] = round(time.monotonic() - began, 3)
                if report.collective["error"]:
                    report.errors.append(report.collective["error"])
            else:
                report.notes.append("collective check skipped: not every probe answered")
    finally:
        probes.release()
    report.passed = not report.errors
    report.seconds = round(time.monotonic() - start, 3)
    _status_lines(report, head_ids, log)
    if output_dir is not None:
        record = json.dumps(report.to_dict(), indent=2)
        # In a thread: the run's controller calls this, and its event loop must not wait on storage.
        await asyncio.to_thread(_write_report, Path(output_dir), record)
    if not report.passed:
        count = len(report.errors)
        problems = "1 problem" if count == 1 else f"{count} problems"
        raise PreflightError(f"preflight failed ({problems}): " + "; ".join(report.errors))
    return report
