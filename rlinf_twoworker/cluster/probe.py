"""What one node checks about itself before training: its GPUs, driver, Python env, code
checkout, inputs and model directories, and whether it can join a collective.

`NodeProbe` is a plain class (tested without Ray); `preflight.run_preflight` pins one to each
bundle of the placement group (holding that node's GPUs, or none where the run's components
hold them and name them: `run(gpu_ids=...)`) and compares what they report.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import ray
from omegaconf import DictConfig, OmegaConf

from rlinf_twoworker import components
from rlinf_twoworker.bytecode import bulk_imports, for_this_process
from rlinf_twoworker.config import GRPOConfig, to_typed
from rlinf_twoworker.errors import PreflightError
from rlinf_twoworker.storage.manifest import verify_input

_CMD_TIMEOUT_S = 30.0


def _command(argv: list[str]) -> tuple[int, str]:
    """Run a fixed argv (never a shell string) with a timeout; (return code, stdout or stderr)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return done.returncode, (done.stdout if done.returncode == 0 else done.stderr).strip()


def _as_typed(cfg: GRPOConfig | Mapping[str, Any]) -> GRPOConfig:
    if isinstance(cfg, GRPOConfig):
        return cfg
    merged = OmegaConf.merge(OmegaConf.structured(GRPOConfig), dict(cfg))
    return to_typed(cast(DictConfig, merged))


def _driver_versions() -> list[str]:
    """The NVIDIA driver version of every GPU of this node (nvidia-smi, else pynvml)."""
    if shutil.which("nvidia-smi"):
        argv = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        code, out = _command(argv)
        if code == 0:
            return [line.strip() for line in out.splitlines() if line.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        version = version.decode() if isinstance(version, bytes) else str(version)
        return [version] * pynvml.nvmlDeviceGetCount()
    except Exception:  # no NVML on this node: reported as "no driver found"
        return []


_IMPORT_TIMEOUT_S = 300.0
_IMPORT_CHECK = """
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        module = importlib.import_module(name)
        answer = {"version": str(getattr(module, "__version__", "ok"))}
    except Exception as exc:
        answer = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps({name: answer}), flush=True)
"""
_CORES_PER_IMPORT_PROCESS = 4


def _import_here(names: list[str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    versions: dict[str, str] = {}
    failed: list[tuple[str, str]] = []
    with bulk_imports():
        for name in names:
            try:
                module = importlib.import_module(name)
                versions[name] = str(getattr(module, "__version__", "ok"))
            except Exception as exc:  # any import failure is a finding, never a crash
                failed.append((name, f"{type(exc).__name__}: {exc}"))
    return versions, failed


def import_in_subprocesses(names: list[str]) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """Import the modules in processes of their own, beside the probe: this interpreter, its
    sys.path (Ray's runtime_env paths included) and environment. Imports are Python work
    under one lock per process, so threads would take them one after another; one process
    per module where the node has 4 cores for each, fewer where it has fewer (each process
    imports torch again), in this process on a host of under 4 cores, and here too those this
    process imported already. Returns {module: version} and [(module, why)] for those that
    fail."""
    # Imported in this worker already (a node that preloads the library): they import here.
    done = [n for n in names if n in sys.modules]
    if done:
        versions, failed = import_in_subprocesses([n for n in names if n not in sys.modules])
        return {**_import_here(done)[0], **versions}, failed
    count = min(len(names), (os.cpu_count() or 1) // _CORES_PER_IMPORT_PROCESS)
    if count == 0 or not names:  # a small host: here, where torch is imported once for all
        return _import_here(names)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if sys.pycache_prefix:  # this probe keeps bytecode in the compile cache: so do they
        cached = {**env, "PYTHONPYCACHEPREFIX": sys.pycache_prefix, "PYTHONDONTWRITEBYTECODE": ""}
        versions, failed = _import_each(names, count, cached)
        if failed:  # a damaged cache entry fails an import: those again without the cache
            again, failed = _import_each([n for n, _ in failed], count, env)
            versions.update(again)
        return versions, failed
    return _import_each(names, count, env)


def _import_each(
    names: list[str], count: int, env: dict[str, str]
) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """`names` imported in `count` processes with environment `env`."""
    count = min(count, len(names))
    groups = [names[i::count] for i in range(count) if names[i::count]]
    procs = [
        (
            group,
            subprocess.Popen(
                [sys.executable, "-c", _IMPORT_CHECK, *group],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            ),
        )
        for group in groups
    ]
    answers: dict[str, dict[str, str]] = {}
    why: dict[str, str] = {}
    deadline = time.monotonic() + _IMPORT_TIMEOUT_S
    for group, proc in procs:
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            for name in group:
                why[name] = f"the import did not finish in {_IMPORT_TIMEOUT_S:g} s"
        for line in out.splitlines():
            try:
                answers.update(json.loads(line))
            except (ValueError, TypeError):
                pass  # a module's own output
        last = (err.strip().splitlines() or ["no output"])[-1]
        for name in group:
            why.setdefault(name, f"exit {proc.returncode}: {last}")
    versions = {n: answers[n]["version"] for n in names if "version" in answers.get(n, {})}
    failed = [(n, answers.get(n, {}).get("error") or why[n]) for n in names if n not in versions]
    return versions, failed


class NodeProbe:
    """Checks one node. `run` returns a JSON-able dict whose `errors` list is empty on success."""

    def node_ip(self) -> str:
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"

    def input_paths(self, cfg: GRPOConfig, node_rank: int) -> dict[str, Path]:
        """Configured input -> the path this node reads it from (the same path on shared storage)."""
        paths: list[str | None] = [path for _, path in components.model_paths(cfg)]
        paths += [cfg.actor.tokenizer.tokenizer_model]
        paths += [cfg.inference.tokenizer.tokenizer_model]
        paths += cfg.data.train_data_paths
        paths += cfg.data.val_data_paths if cfg.validates else []
        return {p: Path(p) for p in dict.fromkeys(paths) if p}

    def run(
        self,
        cfg: GRPOConfig | Mapping[str, Any],
        node_rank: int,
        gpu_ids: list[str] | None = None,
    ) -> dict[str, Any]:
        """`gpu_ids`: Ray's ids of the GPUs to check, held by the run's components (the probe
        holds none: preflight.Beside); None: the GPUs Ray gave this probe."""
        cfg = _as_typed(cfg)
        pre = cfg.cluster.preflight
        who = f"preflight node {node_rank}"
        bytecode = for_this_process()  # where the node keeps no bytecode, the compile cache does
        bytecode.use(cfg.compile_cache_root, who)
        r: dict[str, Any] = {"node_rank": node_rank, "hostname": socket.gethostname()}
        r["pid"] = os.getpid()
        r.update(ip=self.node_ip(), node_id=None, ray_gpu_ids=[], python_prefix=sys.prefix)
        r.update(python_version=sys.version.split()[0], accelerator=cfg.cluster.accelerator)
        errors: list[str] = []

        def fail(check: str, seen: object, todo: str = "") -> None:
            todo = f"; {todo}" if todo else ""
            errors.append(f"node {node_rank} ({r['hostname']}): {check}: {seen}{todo}")

        if ray.is_initialized():
            context = ray.get_runtime_context()
            r["node_id"] = context.get_node_id()
            r["ray_gpu_ids"] = [str(g) for g in context.get_accelerator_ids().get("GPU", [])]
        if gpu_ids is not None:
            r["ray_gpu_ids"], r["gpus_held_by"] = [str(g) for g in gpu_ids], "components"
            if cfg.cluster.accelerator == "cuda":
                _see_only(r["ray_gpu_ids"], node_rank)
        seconds: dict[str, float] = {}  # each check's share of the preflight (start-up record)
        clock = time.perf_counter()

        def lap(check: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            seconds[check] = round(now - clock, 3)
            clock = now

        def verify_manifests() -> tuple[dict[str, str], list[str], float]:
            start, found, problems = time.perf_counter(), {}, []
            remembered = Path(pre.hash_cache_dir).expanduser() if pre.hash_cache_dir else None
            for label, path in self.input_paths(cfg, node_rank).items():
                try:
                    found[label] = verify_input(path, remembered)
                except PreflightError as exc:  # it names the input and says what to do
                    problems.append(f"node {node_rank} ({r['hostname']}): {exc}")
            return found, problems, time.perf_counter() - start

        def import_modules() -> tuple[dict[str, str], list[tuple[str, str]], float]:
            start = time.perf_counter()
            versions, failed = import_in_subprocesses(pre.required_modules)
            return versions, failed, time.perf_counter() - start

        # The checks that wait (hashing gigabytes of inputs, nvidia-smi, the heavy imports in
        # their own processes) run in threads beside the GPU check, which initialises CUDA
        # here; their errors keep the order of the checks.
        cuda = cfg.cluster.accelerator == "cuda"
        with ThreadPoolExecutor(3, thread_name_prefix="preflight") as pool:
            hashing = pool.submit(verify_manifests)
            importing = pool.submit(import_modules)
            drivers = pool.submit(_driver_versions) if cuda else None
            if cuda:  # the GPU check's torch, from the bytecode cache unless an entry is bad
                bytecode.guarded(lambda: importlib.import_module("torch"), who)
            self._check_gpus(cfg, r, fail, drivers)
            lap("gpus")
            ib = os.environ.get("NCCL_IB_DISABLE")
            r["nccl_ib_disable"] = ib
            if pre.require_nccl_ib_disable and ib != "1":
                fail("NCCL_IB_DISABLE", repr(ib), "export NCCL_IB_DISABLE=1 in this node's env")
            want = pre.expected_python_prefix
            if want and os.path.realpath(sys.prefix) != os.path.realpath(want):
                fail("python prefix", sys.prefix, f"run this node's Ray from the env at {want}")
            self._check_code(pre.code_path, pre.code_commit, r, fail)
            lap("env_and_code")
            manifest_errors_at = len(errors)
            for model in dict.fromkeys(path for _, path in components.model_paths(cfg)):
                problem = _not_a_causal_lm(Path(model))
                if problem:
                    fail(f"model {model}", problem, "point *.model.model_path at a causal LM")
            lap("model_configs")
            r["modules"], failed, imported_s = importing.result()
            for name, why in failed:
                fail(f"import {name}", why, "install it in the env")
            lap("imports_wait")
            r["manifests"], problems, hashed_s = hashing.result()
        errors[manifest_errors_at:manifest_errors_at] = problems
        seconds["imports"] = round(imported_s, 3)  # alongside the checks above
        seconds["manifests"] = round(hashed_s, 3)
        lap("manifests_wait")
        r["seconds"] = seconds
        r["errors"] = errors
        r["bytecode_cache"] = bytecode.take()
        return r

    def _check_gpus(
        self, cfg: GRPOConfig, r: dict[str, Any], fail: Callable, drivers: Future | None = None
    ) -> None:
        """`drivers`: _driver_versions() running in a thread (called here when None)."""
        r.update(gpu_count=0, gpu_names=[], compute_capabilities=[], driver_version=None)
        r["gpu_memory"] = []
        r["cuda_available"] = False
        if cfg.cluster.accelerator != "cuda":
            r["gpu_note"] = "no GPU (cluster.accelerator=cpu): GPU checks skipped"
            return
        import torch

        r["cuda_available"] = torch.cuda.is_available()
        if not r["cuda_available"]:
            fail("CUDA available", False, "check the NVIDIA driver and CUDA_VISIBLE_DEVICES")
            return
        count = torch.cuda.device_count()
        r["gpu_count"] = count
        r["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(count)]
        caps = [torch.cuda.get_device_capability(i) for i in range(count)]
        r["compute_capabilities"] = [f"{a}.{b}" for a, b in caps]
        # What each GPU has free now, for the memory plan (this probe's own context included,
        # so the plan is checked against slightly less than the components will find).
        r["gpu_memory"] = [
            dict(zip(("free_bytes", "total_bytes"), torch.cuda.mem_get_info(i), strict=True))
            for i in range(count)
        ]
        for memory, ray_id in zip(r["gpu_memory"], r["ray_gpu_ids"], strict=False):
            memory["ray_gpu_id"] = ray_id  # which GPU the memory plan reads it for
        pre, want = cfg.cluster.preflight, cfg.cluster.num_gpus_per_node
        if r.get("gpus_held_by") == "components":  # the GPUs Ray gave the run's components
            if count != len(r["ray_gpu_ids"]):
                ids = ",".join(r["ray_gpu_ids"])
                fail(
                    "GPU count",
                    f"CUDA sees {count} of the GPUs Ray gave the run ({ids})",
                    "the node's Ray GPU count disagrees with its GPUs: start Ray with --num-gpus "
                    "matching CUDA_VISIBLE_DEVICES",
                )
        elif count != want:
            fail("GPU count", count, f"cluster.num_gpus_per_node is {want}: fix it or the node")
        model = pre.expected_gpu_model
        if model and any(model not in name for name in r["gpu_names"]):
            fail("GPU model", r["gpu_names"], f"cluster.preflight.expected_gpu_model is '{model}'")
        cap = pre.expected_compute_capability
        if cap and any(c != cap for c in r["compute_capabilities"]):
            fail("compute capability", r["compute_capabilities"], f"expected {cap} (GPU image?)")
        # nvidia-smi lists every GPU of the node, not only ours
        per_gpu = drivers.result() if drivers is not None else _driver_versions()
        versions, r["node_gpu_count"] = sorted(set(per_gpu)), len(per_gpu)
        r["driver_version"] = versions[0] if len(versions) == 1 else None
        if len(versions) != 1:
            fail("NVIDIA driver version", versions or "none found", "one driver per node needed")

    def _check_code(self, path: str | None, commit: str | None, r: dict, fail: Callable) -> None:
        if commit and not path:
            fail("code commit", commit, "set cluster.preflight.code_path to the checkout")
        if not path:
            return
        code, head = _command(["git", "-C", path, "rev-parse", "HEAD"])
        r["code_commit"] = head if code == 0 else None
        if code != 0:
            fail(f"code checkout {path}", head, "check out the pinned code at that path")
            return
        if commit and not head.startswith(commit):
            fail(f"code commit of {path}", head, f"check out {commit}")
        code, status = _command(["git", "-C", path, "status", "--porcelain"])
        r["code_clean"] = code == 0 and not status
        if not r["code_clean"]:
            fail(f"code tree {path}", status[:200] or "git status failed", "reset local edits")

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((self.node_ip(), 0))
            return int(sock.getsockname()[1])

    def all_reduce(
        self, init_method: str, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> float:
        """Join a process group of all probes, all-reduce (rank + 1), leave; returns the sum.

        Over gloo the group is made from its own store and left to the garbage collector,
        outside torch.distributed's process-wide state: a CPU cluster's probe runs in Ray's
        pooled worker, where a join that failed before (a peer that never came) would
        otherwise leave a group counter that no peer shares and every later join would wait
        for its timeout. NCCL's probes are processes of their own (preflight._Probes)."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
            group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            value = torch.tensor([rank + 1.0])
            group.allreduce([value]).wait()  # type: ignore[attr-defined]
            return float(value.item())
        dist.init_process_group(
            backend, init_method=init_method, timeout=timeout, world_size=world_size, rank=rank
        )
        try:
            value = torch.tensor([rank + 1.0], device="cuda:0")
            dist.all_reduce(value)
            return float(value.item())
        finally:
            dist.destroy_process_group()


def _see_only(gpu_ids: list[str], node_rank: int) -> None:
    """Make CUDA in this process see only `gpu_ids` (Ray's ids, as Ray would set them for a
    process holding them). CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises."""
    import torch

    if torch.cuda.is_initialized():
        raise PreflightError(
            f"node {node_rank}: the preflight probe initialised CUDA before it was told which "
            "GPUs to check (a library bug); report it with this node's worker log"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)


def _not_a_causal_lm(model_dir: Path) -> str | None:
    """Why config.json does not describe a causal LM (…ForCausalLM), or None."""
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"config.json unreadable ({exc})"
    archs = config.get("architectures") or []
    if archs and not any(str(a).endswith("ForCausalLM") for a in archs):
        return f"architectures {archs} is not a causal LM"
    return None
