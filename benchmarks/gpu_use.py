"""GPU memory as nvidia-smi sees it, per process and for the whole GPU, sampled in a thread,
and the run's component processes found by pid (bench_scale.py, tests/integration/test_gpu_memory.py).

PyTorch's own peaks (the memory/<component>/<rank>/gpu_peak_* metrics) leave out what is not
in its allocator: the CUDA context, NCCL's and cuBLAS's workspaces, compiled kernels. nvidia-smi
counts all of it:

    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -i 0
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0

every 0.25 s; each pid keeps its peak, and so does the whole GPU. The component processes are
named from the run handle's `topology()` (each process's own os.getpid(), with its component
and rank) or, failing that, from Ray's actor list (the library names each component's actor
`<run_id>-<hash>:<component>:<rank>`, cluster/connect.py's ray_name). A pid nvidia-smi lists
that is none of them is named by what it is, looked up once while it lives: a component's
child ('actor:0 child <pid>'), another Ray process by its task ('ray::NodeProbe.run <pid>', the
preflight's probe, about 1.1 GiB during start-up on an H200), else 'pid <pid>' (another
container's process, say); the caller names its own pid ('driver').
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB_PER_GIB = 1024.0
APPS_QUERY = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
GPU_QUERY = ("--query-gpu=memory.used", "--format=csv,noheader,nounits")


def _number(text: str) -> float | None:
    """A number nvidia-smi printed, or None for '[N/A]', 'N/A', '[Not Supported]',
    '[Insufficient Permissions]' and the like."""
    text = text.strip().removesuffix("MiB").strip()
    try:
        return float(text)
    except ValueError:
        return None


def parse_apps(text: str | None) -> dict[int, float | None]:
    """`--query-compute-apps=pid,used_memory` output -> {pid: GiB, None where nvidia-smi gives
    no figure}. Empty output (no process), blank lines and lines without a pid are skipped; a
    pid listed twice (on two GPUs, without -i) is summed."""
    out: dict[int, float | None] = {}
    for line in (text or "").splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue  # a blank line, "No running processes found", a header
        pid, mib = int(cells[0]), _number(cells[1])
        gib = None if mib is None else mib / MIB_PER_GIB
        if pid in out and out[pid] is not None and gib is not None:
            out[pid] = out[pid] + gib  # type: ignore[operator]
        elif pid not in out or gib is not None:
            out[pid] = gib
    return out


def parse_used(text: str | None) -> float | None:
    """`--query-gpu=memory.used` output (one GPU, -i given) -> GiB, or None."""
    for line in (text or "").splitlines():
        mib = _number(line.split(",")[0]) if line.strip() else None
        if mib is not None:
            return mib / MIB_PER_GIB
    return None


def nvidia_smi(query: tuple[str, ...], gpu: int) -> str | None:
    """nvidia-smi's output for one GPU, or None when it fails or is not there."""
    try:
        done = subprocess.run(
            ["nvidia-smi", *query, "-i", str(gpu)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass
class Sample:
    at: float
    """time.time() of the sample (the clock of StepResult.finished_at)."""
    gpu_gib: float | None
    """The whole GPU's used memory."""
    apps: dict[int, float | None]
    """pid -> GiB (None: nvidia-smi lists the process without a figure)."""


Query = Callable[[tuple[str, ...], int], "str | None"]


def process_info(pid: int) -> tuple[list[int], str]:
    """A live process's ancestors (parent first) and command line, as far as this host's /proc
    shows them (psutil); ([], '') when it cannot (gone, another pid namespace)."""
    try:
        import psutil

        proc = psutil.Process(pid)
        return [p.pid for p in proc.parents()], " ".join(proc.cmdline())[:200]
    except Exception:
        return [], ""


@dataclass
class GpuUseSampler:
    """nvidia-smi every `interval_s` in a daemon thread while in the `with` block; `query`
    replaces nvidia-smi (tests give canned output)."""

    gpu: int = 0
    interval_s: float = 0.25
    query: Query = nvidia_smi
    describe: Callable[[int], tuple[list[int], str]] = process_info
    """pid -> (ancestors, command line), asked once for each pid nvidia-smi lists, while it
    lives: a component's child process (a compile worker, say) is named after its parent."""
    samples: list[Sample] = field(default_factory=list)
    ancestors: dict[int, list[int]] = field(default_factory=dict)
    commands: dict[int, str] = field(default_factory=dict)
    baseline_gib: float | None = None
    """The GPU's used memory when sampling began: what was there before the run."""
    failed: int = 0
    """Ticks where nvidia-smi gave no figure for the GPU."""
    started_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    def sample(self) -> Sample:
        apps = parse_apps(self.query(APPS_QUERY, self.gpu))
        used = parse_used(self.query(GPU_QUERY, self.gpu))
        taken = Sample(time.time(), used, apps)
        for pid in apps.keys() - self.commands.keys():
            self.ancestors[pid], self.commands[pid] = self.describe(pid)
        with self._lock:
            self.samples.append(taken)
            self.failed += used is None
        return taken

    def __enter__(self) -> GpuUseSampler:
        self._stop.clear()
        self.started_at = time.time()
        self.baseline_gib = self.sample().gpu_gib
        self._thread = threading.Thread(target=self._run, name="gpu-use", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        tick = time.monotonic()
        while True:
            tick += self.interval_s
            if self._stop.wait(max(0.0, tick - time.monotonic())):
                return
            try:
                self.sample()
            except Exception:  # a sampler must never take the measured run down
                self.failed += 1
            tick = max(tick, time.monotonic() - self.interval_s)  # no burst after a slow call

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def window(self, start: float | None = None, end: float | None = None) -> list[Sample]:
        with self._lock:
            taken = list(self.samples)
        return [
            s for s in taken if (start is None or s.at >= start) and (end is None or s.at <= end)
        ]

    def peak_by_pid(self, start: float | None = None, end: float | None = None) -> dict[int, float]:
        """Each pid's highest figure in the window (pids only ever listed as '[N/A]' left out:
        `unreported_pids`)."""
        peaks: dict[int, float] = {}
        for s in self.window(start, end):
            for pid, gib in s.apps.items():
                if gib is not None:
                    peaks[pid] = max(gib, peaks.get(pid, 0.0))
        return peaks

    def unreported_pids(self) -> list[int]:
        seen = {pid for s in self.window() for pid in s.apps}
        return sorted(seen - set(self.peak_by_pid()))

    def gpu_peak(self, start: float | None = None, end: float | None = None) -> float | None:
        used = [s.gpu_gib for s in self.window(start, end) if s.gpu_gib is not None]
        return max(used) if used else None

    def summary(self) -> dict[str, Any]:
        return {
            "samples": len(self.samples),
            "interval_s": self.interval_s,
            "nvidia_smi_failures": self.failed,
            "gpu_baseline_gib": self.baseline_gib,
            "gpu_peak_gib": self.gpu_peak(),
        }


@dataclass
class GpuUseSamplers:
    """One GpuUseSampler per GPU of a run on several, read as one: a process's peak is its
    highest on any GPU (a run's component uses one), the GPU peak is the highest GPU's, and
    `gpu_peaks` and the summary keep each GPU's own."""

    parts: list[GpuUseSampler]

    def __enter__(self) -> GpuUseSamplers:
        for part in self.parts:
            part.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for part in self.parts:
            part.__exit__(*exc)

    @property
    def started_at(self) -> float:
        return min(part.started_at for part in self.parts)

    @property
    def ancestors(self) -> dict[int, list[int]]:
        return {pid: a for part in self.parts for pid, a in part.ancestors.items()}

    @property
    def commands(self) -> dict[int, str]:
        return {pid: c for part in self.parts for pid, c in part.commands.items()}

    def peak_by_pid(self, start: float | None = None, end: float | None = None) -> dict[int, float]:
        peaks: dict[int, float] = {}
        for part in self.parts:
            for pid, gib in part.peak_by_pid(start, end).items():
                peaks[pid] = max(gib, peaks.get(pid, 0.0))
        return peaks

    def unreported_pids(self) -> list[int]:
        return sorted({pid for part in self.parts for pid in part.unreported_pids()})

    def gpu_peaks(
        self, start: float | None = None, end: float | None = None
    ) -> dict[int, float | None]:
        """Each GPU's used-memory peak in the window ({GPU index: GiB}; None: no figure)."""
        return {part.gpu: part.gpu_peak(start, end) for part in self.parts}

    def gpu_peak(self, start: float | None = None, end: float | None = None) -> float | None:
        peaks = [p for p in self.gpu_peaks(start, end).values() if p is not None]
        return max(peaks) if peaks else None

    def summary(self) -> dict[str, Any]:
        baselines = [p.baseline_gib for p in self.parts if p.baseline_gib is not None]
        return {
            "samples": sum(len(p.samples) for p in self.parts),
            "interval_s": self.parts[0].interval_s,
            "nvidia_smi_failures": sum(p.failed for p in self.parts),
            "gpu_baseline_gib": max(baselines) if baselines else None,
            "gpu_peak_gib": self.gpu_peak(),
            "gpu_baseline_gib_by_gpu": {p.gpu: p.baseline_gib for p in self.parts},
            "gpu_peak_gib_by_gpu": self.gpu_peaks(),
        }


def sampler_for(gpus: int, interval_s: float = 0.25) -> GpuUseSampler | GpuUseSamplers:
    """nvidia-smi sampling of GPUs 0..gpus-1: one sampler, or one per GPU read as one."""
    if gpus == 1:
        return GpuUseSampler(gpu=0, interval_s=interval_s)
    return GpuUseSamplers([GpuUseSampler(gpu=g, interval_s=interval_s) for g in range(gpus)])


def pids_from_topology(rows: Iterable[Mapping[str, Any]]) -> dict[int, str]:
    """RunHandle.topology()'s rows -> {pid: 'component:rank'}."""
    return {
        int(r["pid"]): f"{r['component']}:{r['rank']}" for r in rows if int(r.get("pid") or 0) > 0
    }


def pids_from_actors(actors: Iterable[Any], prefix: str) -> dict[int, str]:
    """Ray's actor list (ray.util.state.list_actors(detail=True): objects or dicts with name,
    pid, state) -> {pid: 'component:rank'} for the live actors named `<prefix>:<component>:
    <rank>`, `prefix` being cluster.connect.ray_name(run_dir); the controller is left out."""
    out: dict[int, str] = {}
    for actor in actors:
        get = actor.get if isinstance(actor, Mapping) else (lambda k, a=actor: getattr(a, k, None))
        name, pid, state = get("name") or "", get("pid") or 0, get("state")
        parts = name.split(":")
        if state not in (None, "ALIVE") or len(parts) != 3 or parts[0] != prefix:
            continue
        if parts[1] != "controller" and parts[2].isdigit() and int(pid) > 0:
            out[int(pid)] = f"{parts[1]}:{parts[2]}"
    return out


def component_pids(handle: Any, run_dir: Path) -> tuple[dict[int, str], str]:
    """{pid: 'component:rank'} of a started run's component processes and where it came from:
    the handle's topology, else Ray's actor list."""
    try:
        pids = pids_from_topology(handle.topology())
        if pids:
            return pids, "RunHandle.topology()"
    except Exception:
        pass
    from ray.util.state import list_actors

    from rlinf_twoworker.cluster.connect import ray_name

    actors = list_actors(filters=[("state", "=", "ALIVE")], detail=True, limit=10000)
    return pids_from_actors(actors, ray_name(run_dir)), "ray.util.state.list_actors"


def name_of(
    pid: int,
    names: Mapping[int, str],
    ancestors: Mapping[int, list[int]] | None = None,
    commands: Mapping[int, str] | None = None,
) -> str:
    """'component:rank' for a component's pid; '<component:rank> child <pid>' for a process
    a component started (its ancestors known); for another Ray process its task
    ('ray::NodeProbe.run <pid>': the preflight's probe); else 'pid <pid>'. Only components
    own children: every process of a LocalCluster descends from the Driver."""
    if pid in names:
        return names[pid]
    owners = [a for a in (ancestors or {}).get(pid, []) if ":" in names.get(a, "")]
    if owners:
        return f"{names[owners[0]]} child {pid}"
    command = ((commands or {}).get(pid) or "").split()
    if command and command[0].startswith("ray::"):
        return f"{command[0]} {pid}"
    return f"pid {pid}"


def by_name(
    peaks: Mapping[int, float],
    names: Mapping[int, str],
    ancestors: Mapping[int, list[int]] | None = None,
    commands: Mapping[int, str] | None = None,
) -> dict[str, float]:
    """{pid: GiB} -> {name_of(pid): GiB}."""
    return {
        name_of(pid, names, ancestors, commands): round(gib, 3)
        for pid, gib in sorted(peaks.items())
    }


def plan_estimates(run_dir: Path) -> dict[str, float]:
    """memory_plan.json's estimate of each GPU process ('component:rank' -> GiB, the CUDA
    context part included)."""
    import json

    plan = json.loads((Path(run_dir) / "memory_plan.json").read_text(encoding="utf-8"))
    return {
        f"{p['component']}:{p['rank']}": float(p["estimate_gib"])
        for gpu in plan.get("gpus", [])
        for p in gpu.get("processes", [])
    }


def plan_problems(
    peaks: Mapping[str, float], estimates: Mapping[str, float], tolerance: float = 0.10
) -> list[str]:
    """A line for each planned process whose nvidia-smi peak passes its estimate by more than
    `tolerance`, or that nvidia-smi never showed with a figure."""
    problems = []
    for name, estimate in sorted(estimates.items()):
        peak = peaks.get(name)
        if peak is None:
            problems.append(
                f"{name}: no nvidia-smi figure for this process (memory-plan estimate "
                f"{estimate:.2f} GiB); nvidia-smi listed {sorted(peaks) or 'no process'}"
            )
        elif peak > estimate * (1 + tolerance):
            problems.append(
                f"{name}: nvidia-smi peak {peak:.2f} GiB passes its memory-plan estimate "
                f"{estimate:.2f} GiB by {peak / estimate - 1:.0%} (more than {tolerance:.0%})"
            )
    return problems


def budget_problem(gpu_peak: float | None, baseline: float | None, budget_gib: float) -> str | None:
    """Why the run's share of the GPU (its nvidia-smi peak less what was in use before the
    run) passed `budget_gib`, or None."""
    if gpu_peak is None:
        return "the GPU: nvidia-smi gave no figure for its used memory"
    used = gpu_peak - (baseline or 0.0)
    if used > budget_gib:
        return (
            f"the GPU: nvidia-smi peak {gpu_peak:.2f} GiB less {baseline or 0.0:.2f} GiB in use "
            f"before the run = {used:.2f} GiB, over cluster.max_gpu_memory_gb={budget_gib:g}"
        )
    return None


def wait_released(
    gpu: int, target_gib: float, timeout_s: float = 60.0, query: Query = nvidia_smi
) -> float | None:
    """Wait (at most timeout_s) until the GPU's used memory is at most target_gib: a stopped
    cluster's processes hand theirs back a little after they are gone. The last figure."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = parse_used(query(GPU_QUERY, gpu))
        if used is None or used <= target_gib or time.monotonic() > deadline:
            return used
        time.sleep(1.0)


def grew(series: Mapping[int, float], after_step: int = 3) -> float:
    """How far a per-step figure ({step: GiB}) rose after `after_step`: its largest later value
    less its value at that step; 0.0 when it did not rise, or has no value there or later."""
    if after_step not in series:
        return 0.0
    later = [v for step, v in series.items() if step > after_step]
    return max(0.0, max(later) - series[after_step]) if later else 0.0
