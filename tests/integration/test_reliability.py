"""Fault injection on a real 2-node Ray cluster: component processes killed with SIGKILL, a node
removed, a crash in the middle of a checkpoint, the Driver killed or interrupted. Every run must
fail within runner.timeouts.failure_detection_s with an error naming the component, its rank and
its node, leave its completed checkpoints untouched, and release its actors and placement group.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group, placement_group_table
from support import ONE_RANK

import rlinf_twoworker
from rlinf_twoworker import ComponentError, RunCancelledError, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.cluster.connect import NAMESPACE, ray_name
from rlinf_twoworker.cluster.placement import wait_removed
from rlinf_twoworker.cluster.probe import NodeProbe
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.rundir import complete_checkpoint_steps
from rlinf_twoworker.storage.verify import verify_run
from rlinf_twoworker.workers.actor import ActorWorker
from rlinf_twoworker.workers.rollout import RolloutWorker

# Classes injected into a run travel by value: the workers cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT = 300
MARKERS = Path(tempfile.mkdtemp(prefix="rlinf-reliability-"))
# Every process of the session's cluster inherits this (the cluster starts after collection);
# no file of a run directory may ever contain it.
SECRET_NAME, SECRET = "RLINF_RELIABILITY_API_TOKEN", f"tok-{os.getpid()}-never-logged"
os.environ.setdefault(SECRET_NAME, SECRET)
ONE_NODE = [
    "cluster.num_nodes=1",
    "cluster.num_gpus_per_node=2",
    "cluster.component_placement={rollout:0,inference:0,reward:0,actor:0}",  # one rank
]


@pytest.fixture(scope="module")
def inputs(demo_inputs):
    return demo_inputs


# ---- injected components ---------------------------------------------------------------------


def marker(run_id: str, what: str) -> Path:
    return MARKERS / f"{run_id}.{what}"


def this_run() -> str:
    """The RUN_ID of the run whose component process this is: its Ray actor's name leads with
    it (`<run_id>-<8 hex>:<component>:<rank>`, cluster/connect.ray_name). A component's
    settings hold only what its work reads, not the run's name."""
    name = ray.get_runtime_context().get_actor_name()
    return name.split(":")[0][: -len("-12345678")]


class StallingActor(ActorWorker):
    """From the second step's update on, the ranks in `stall_ranks` leave a marker and sleep
    instead of training; a rank that does not stall enters the update's collectives and waits
    there. Counted in minibatches: a pipelined step calls train_step once a minibatch."""

    stall_ranks: tuple[int, ...] = (0, 1)

    def train_step(self, shards):
        self.minibatches = getattr(self, "minibatches", 0) + len(shards)
        run_id = this_run()
        if self.minibatches > self.settings.algorithm.n_minibatches:
            marker(run_id, f"actor{self.rank}.entered").touch()
            if self.rank in self.stall_ranks:
                marker(run_id, f"actor{self.rank}.stalled").touch()
                time.sleep(3600)
        return super().train_step(shards)


class StallingRankOne(StallingActor):
    stall_ranks = (1,)


class CrashInCheckpoint(ActorWorker):
    """Actor rank 1 is killed (SIGKILL) half-way through writing its shard of the second
    checkpoint, while rank 0 waits for it in DCP's collective."""

    def save_checkpoint(self, path):
        self.saves = getattr(self, "saves", 0) + 1
        if self.saves == 2 and self.rank == 1:
            Path(path).mkdir(parents=True, exist_ok=True)
            with open(Path(path) / "__1_0.distcp", "wb") as handle:
                handle.write(b"half a shard")
                handle.flush()
                os.fsync(handle.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return super().save_checkpoint(path)


class OutOfMemoryActor(ActorWorker):
    """The actor (one rank) asks the allocator for more memory than the machine has in the
    second step's update (a real allocation failure, as when another process took the GPU's
    memory). Counted in minibatches: a pipelined step calls train_step once a minibatch."""

    def train_step(self, shards):
        self.minibatches = getattr(self, "minibatches", 0) + len(shards)
        if self.minibatches > self.settings.algorithm.n_minibatches:
            import torch

            torch.empty(2**48, dtype=torch.uint8)
        return super().train_step(shards)


class GatedRollout(RolloutWorker):
    """Holds the third rollout until the test opens the gate (a marker file)."""

    def generate(self, *args, **kwargs):
        self.calls = getattr(self, "calls", 0) + 1
        gate = marker(this_run(), "gate")
        deadline = time.monotonic() + TIMEOUT
        while self.calls == 3 and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        return super().generate(*args, **kwargs)


class Launcher:
    """Starts a run from a process on another node: that run's Driver node is that node."""

    def start(self, cfg, classes):
        self.handle = run_grpo_two_worker(cfg, component_classes=classes)
        return self.handle


# ---- helpers ---------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen within {timeout:g} s")
        time.sleep(0.2)


def wait_markers(handle, *paths: Path, timeout: float = TIMEOUT) -> None:
    def seen() -> bool:
        if handle.done():
            handle.result(timeout=10)  # raises the run's own error
            raise AssertionError("the run ended before the injected fault")
        return all(p.exists() for p in paths)

    wait_until(seen, timeout, f"markers {[p.name for p in paths]}")


def cause_of(ref, timeout: float) -> BaseException:
    """The run's own error that a pending future raises."""
    try:
        ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as exc:
        return exc.cause
    raise AssertionError("the future resolved instead of raising")


def of_run(name: str, run: str) -> bool:
    """Whether a Ray name is of a run with this RUN_ID, or of the one run whose
    `<run_id>-<8 hex>` this is (ray_name: `<run_id>-<8 hex>:...`)."""
    head = name.split(":", 1)[0]
    return head == run or head.rpartition("-")[0] == run


def run_actors(run_id: str) -> list[str]:
    names = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in names if a["namespace"] == NAMESPACE and of_run(a["name"], run_id)]


def live_groups(run_id: str | None = None) -> list[dict]:
    groups = ray.util.placement_group_table().values()
    return [
        g
        for g in groups
        if g["state"] != "REMOVED" and (run_id is None or of_run(g["name"], run_id))
    ]


def assert_released(run_id: str, timeout: float = 30, driver_gone: bool = False) -> None:
    """Within `timeout`: no component actor of the run alive and its placement group removed.
    The controller outlives its run while the Driver holds the handle (it answers the handle's
    futures, holding no resources); once the Driver is gone it must be gone too."""

    def left() -> list[str]:
        return [n for n in run_actors(run_id) if driver_gone or ":controller:" not in n]

    wait_until(
        lambda: not left() and not live_groups(run_id),
        timeout,
        f"release of run {run_id} (actors {left()}, groups {live_groups(run_id)})",
    )


def digests(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def row(handle, component: str, rank: int) -> dict:
    return next(r for r in handle.topology() if (r["component"], r["rank"]) == (component, rank))


def bound_of(handle) -> float:
    return handle._typed.runner.timeouts.failure_detection_s


def assert_failure_recorded(run_dir: Path, component: str, rank: int) -> None:
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["state"] == "failed" and failure["type"] == "ComponentError", failure
    assert (failure["component"], failure["rank"]) == (component, rank), failure
    line = f"RUN_FAILED error=ComponentError: component {component} rank {rank} on node"
    for log in ("log/main.log", "driver.log"):
        assert line in (run_dir / log).read_text(), log


# ---- failure detection -----------------------------------------------------------------------


def test_killed_rank_fails_the_run_while_its_peer_waits_in_a_collective(
    cluster_2x2, inputs, tmp_path
):
    run_id = "kill-rank"
    cfg = demo_config(inputs, tmp_path, run_id, ["runner.max_steps=3", "runner.save_interval=1"])
    handle = run_grpo_two_worker(cfg, component_classes={"actor": StallingRankOne})
    first = ray.get(handle.checkpoint(1), timeout=TIMEOUT)
    before = digests(Path(first.directory))
    wait_markers(handle, marker(run_id, "actor0.entered"), marker(run_id, "actor1.stalled"))
    pending = [handle.step(3), handle.checkpoint(3), handle.step(2)]
    victim = row(handle, "actor", 1)

    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=bound_of(handle))
    assert time.monotonic() - killed_at < bound_of(handle)

    error = failed.value
    assert (error.component, error.rank) == ("actor", 1), error
    assert victim["node_id"][:8] in error.node and victim["node_ip"] in error.node
    assert f"pid {victim['pid']}" in error.cause and "died" in error.cause
    for ref in pending:
        assert str(cause_of(ref, 30)) == str(error)
    run_dir = tmp_path / run_id
    assert_failure_recorded(run_dir, "actor", 1)
    assert_released(run_id)
    assert digests(Path(first.directory)) == before  # the completed checkpoint is untouched
    assert complete_checkpoint_steps(run_dir) == [1]


def test_watchdog_fails_the_run_when_a_component_dies_with_no_call_in_flight(
    cluster_2x2, inputs, tmp_path
):
    """The reward actor dies while both actor ranks are busy in their update: no call to the
    reward is in flight, and without the watchdog the run would wait for step_s (an hour)."""
    run_id = "kill-reward"
    cfg = demo_config(
        inputs,
        tmp_path,
        run_id,
        [*ONE_RANK, "runner.max_steps=3", "runner.timeouts.failure_detection_s=20"],
    )
    handle = run_grpo_two_worker(cfg, component_classes={"actor": StallingActor})
    wait_markers(handle, marker(run_id, "actor0.stalled"))
    victim = row(handle, "reward", 0)

    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=bound_of(handle))
    assert time.monotonic() - killed_at < bound_of(handle)

    error = failed.value
    assert (error.component, error.rank) == ("reward", 0), error
    assert victim["node_id"][:8] in error.node and f"pid {victim['pid']}" in error.cause
    assert str(cause_of(handle.step(2), 30)) == str(error)
    assert_failure_recorded(tmp_path / run_id, "reward", 0)
    assert_released(run_id)


def test_controller_dying_fails_the_run_and_the_handle_releases_its_group(
    cluster_2x2, inputs, tmp_path
):
    """The controller process killed: its components die with it (owned by it), its futures
    raise, and handle.result() names it, removes the placement group and records the failure."""
    run_id = "kill-controller"
    cfg = demo_config(
        inputs, tmp_path, run_id, [*ONE_RANK, "runner.max_steps=50", "runner.save_interval=50"]
    )
    handle = run_grpo_two_worker(cfg)
    ray.get(handle.step(1), timeout=TIMEOUT)
    pending = handle.step(50)
    pid = handle.status()["controller_pid"]

    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=bound_of(handle))
    assert time.monotonic() - killed_at < bound_of(handle)

    error = failed.value
    assert (error.component, error.rank) == ("controller", 0) and f"pid {pid}" in error.cause
    assert ray.get_runtime_context().get_node_id()[:8] in error.node
    with pytest.raises(ray.exceptions.RayActorError, match=f"{run_id}-[0-9a-f]{{8}}:controller:0"):
        ray.get(pending, timeout=30)
    assert_failure_recorded(tmp_path / run_id, "controller", 0)
    assert_released(run_id, driver_gone=True)


# ---- durable checkpoints ---------------------------------------------------------------------


def test_crash_mid_checkpoint_leaves_only_the_staging_dir_which_resume_ignores(
    cluster_2x2, inputs, tmp_path
):
    run_id = "crash-ckpt"
    cfg = demo_config(inputs, tmp_path, run_id, ["runner.max_steps=3", "runner.save_interval=1"])
    handle = run_grpo_two_worker(cfg, component_classes={"actor": CrashInCheckpoint})
    first = ray.get(handle.checkpoint(1), timeout=TIMEOUT)
    before = digests(Path(first.directory))
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=TIMEOUT)
    assert (failed.value.component, failed.value.rank) == ("actor", 1), failed.value
    assert "died" in failed.value.cause and "checkpoint 2" in failed.value.cause

    run_dir = tmp_path / run_id
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        ".global_step_2.incomplete",
        "global_step_1",
    ]
    staging = checkpoints / ".global_step_2.incomplete"
    dcp_dir = staging / "actor" / "dcp_checkpoint"
    assert (dcp_dir / "__1_0.distcp").read_bytes() == b"half a shard"
    assert not (dcp_dir / ".metadata").exists() and not (staging / "data" / "data.pt").exists()
    assert digests(Path(first.directory)) == before
    assert complete_checkpoint_steps(run_dir) == [1]
    assert ckpt.last_complete(run_dir) == checkpoints / "global_step_1"
    for source in (str(run_dir), "auto"):
        resumer = demo_config(inputs, tmp_path, "resumer", [f"runner.resume_dir={source}"])
        found = ckpt.resume_source(to_typed(resumer), tmp_path / "resumer")
        assert found == checkpoints / "global_step_1", source
    assert_released(run_id)


@pytest.fixture
def small_storage(tmp_path):
    """A real 640 KiB file system (tmpfs): room for a run's logs, not for its checkpoint."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_storage_is_named_and_the_incomplete_checkpoint_removed(
    cluster_2x2, inputs, tmp_path, small_storage
):
    run_id = "full"
    cfg = demo_config(inputs, small_storage, run_id, [*ONE_RANK, "runner.max_steps=1"])
    handle = run_grpo_two_worker(cfg)
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=TIMEOUT)
    error = failed.value
    assert error.component == "actor", error
    assert "checkpoint write to" in error.cause and "the storage under it is full" in error.cause
    assert "point runner.output_dir at larger storage" in error.cause
    checkpoints = small_storage / run_id / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []
    assert_failure_recorded(small_storage / run_id, "actor", error.rank)
    assert_released(run_id)


def test_out_of_memory_names_the_step_and_the_plans_estimate_and_keeps_checkpoints(
    cluster_2x2, inputs, tmp_path
):
    run_id = "oom"
    cfg = demo_config(
        inputs, tmp_path, run_id, [*ONE_RANK, "runner.max_steps=3", "runner.save_interval=1"]
    )
    handle = run_grpo_two_worker(cfg, component_classes={"actor": OutOfMemoryActor})
    first = ray.get(handle.checkpoint(1), timeout=TIMEOUT)
    before = digests(Path(first.directory))
    with pytest.raises(ComponentError) as failed:
        handle.result(timeout=TIMEOUT)
    error = failed.value
    assert (error.component, error.rank) == ("actor", 0), error
    assert error.node and "step 2 actor update" in error.cause
    assert "out of memory at step 2: the memory plan estimated actor:0" in error.cause
    assert "optimizer" in error.cause and "runner.resume_dir=auto" in error.cause
    checkpoints = tmp_path / run_id / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["global_step_1"]
    assert digests(Path(first.directory)) == before
    failure = json.loads((tmp_path / run_id / "failure.json").read_text())
    assert "the memory plan estimated actor:0" in json.dumps(failure)
    assert_released(run_id)


def test_keep_last_checkpoints_and_a_run_writes_only_its_own_directory(
    cluster_2x2, inputs, tmp_path
):
    """Also: status() answers at once while a checkpoint is written (the first one takes
    seconds here: SlowSavingActor)."""
    run_id = "keep-last"
    cfg = demo_config(
        inputs,
        tmp_path,
        run_id,
        ["runner.max_steps=3", "runner.save_interval=1", "runner.keep_last_checkpoints=2"],
    )
    handle = run_grpo_two_worker(cfg, component_classes={"actor": SlowSavingActor})
    assert _answers_fast(handle, "checkpoint", deadline_s=240)["steps_done"] == 1
    first = ray.get(handle.checkpoint(1), timeout=TIMEOUT)
    assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= {
        Path(name).name for name in first.files
    } and "data/data.pt" in first.files
    component_pid = row(handle, "actor", 0)["pid"]
    component_env = Path(f"/proc/{component_pid}/environ").read_bytes().split(b"\0")
    assert f"{SECRET_NAME}={SECRET}".encode() in component_env  # the secret is there to leak
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors

    run_dir = tmp_path / run_id
    assert complete_checkpoint_steps(run_dir) == [2, 3]
    # Only the run directory and the output root's lock file were created; no file holds the
    # secret from the environment.
    assert sorted(os.listdir(tmp_path)) == [f".{run_id}.lock", run_id]
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path

    # Pruning never deletes the only complete checkpoint: a newer directory whose shard is
    # missing is not complete, so it neither counts nor gets deleted.
    damaged = run_dir / "checkpoints" / "global_step_4"
    shutil.copytree(run_dir / "checkpoints" / "global_step_3", damaged)
    (damaged / "actor" / "dcp_checkpoint" / "__1_0.distcp").unlink()
    assert ckpt.prune(run_dir, 1) == [2]
    assert ckpt.prune(run_dir, 1) == []
    assert ckpt.complete_steps(run_dir) == [3] and damaged.is_dir()


# ---- safety ----------------------------------------------------------------------------------


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def test_the_library_runs_no_shell_command_built_from_input():
    """Every subprocess call passes an argv list, never shell=True; no os.system or popen."""
    package = Path(rlinf_twoworker.__file__).parent
    calls = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = _dotted(node.func)
            where = f"{path.name}:{node.lineno} {name}"
            assert name not in ("os.system", "os.popen", "subprocess.getoutput"), where
            if name.startswith("subprocess.") or name in ("Popen", "run", "check_output"):
                shell = [k for k in node.keywords if k.arg == "shell"]
                assert not shell or getattr(shell[0].value, "value", True) is False, where
                if name.startswith("subprocess."):
                    first = node.args[0] if node.args else None
                    assert isinstance(first, (ast.List, ast.Name)), f"{where}: argv not a list"
                    calls.append(where)
    assert calls  # the probe's git and nvidia-smi calls were found and checked


# ---- cancellation and clean-up ---------------------------------------------------------------


def save_config(cfg, path: Path) -> Path:
    OmegaConf.save(cfg, path, resolve=True)
    return path


DRIVER = """
import os, sys
import ray
from rlinf_twoworker import run_grpo_two_worker
from rlinf_twoworker.config import load_config

handle = run_grpo_two_worker(load_config(sys.argv[1]), ray_address=sys.argv[2])
ray.get(handle.step(1), timeout=300)
print("STEP_1_DONE", flush=True)
os._exit(7)  # the Driver dies without cancelling anything
"""


def test_driver_exiting_abruptly_kills_the_run_and_frees_the_cluster(cluster_2x2, inputs, tmp_path):
    run_id = "driver-exit"
    out = tmp_path / "out"
    cfg = demo_config(
        inputs, out, run_id, [*ONE_RANK, "runner.max_steps=50", "runner.save_interval=50"]
    )
    path = save_config(cfg, tmp_path / "config.yaml")
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(path), cluster_2x2.address],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 7 and "STEP_1_DONE" in done.stdout, done.stderr[-3000:]
    assert_released(run_id, timeout=30, driver_gone=True)
    # Nobody could record why the run ended: the postflight says so, and how to continue.
    report = verify_run(out / run_id, 50, 2, log=lambda _: None, write=False)
    ending = next(e for e in report.errors if "RLINF_PYTHON_EXIT_CODE" in e)
    assert "no failure.json either" in ending and "killed" in ending
    assert f"runner.resume_dir={out / run_id}" in ending


def test_ctrl_c_on_the_cli_driver_cancels_the_run_and_frees_the_cluster(
    cluster_2x2, inputs, tmp_path
):
    run_id = "ctrl-c"
    out = tmp_path / "out"
    cfg = demo_config(
        inputs,
        out,
        run_id,
        [*ONE_RANK, "runner.max_steps=200", "runner.max_epochs=4", "runner.save_interval=200"],
    )
    path = save_config(cfg, tmp_path / "config.yaml")
    env = {k: v for k, v in os.environ.items() if k not in ("WORK_ROOT", "TARGET_STEPS")}
    env["RUN_ID"] = run_id  # the Driver command's interface (the config names the same run)
    log = tmp_path / "driver.out"
    argv = [sys.executable, "-m", "rlinf_twoworker.api.cli", "run", "--config", str(path)]
    # The Driver as started from a terminal, whose Ctrl-C it answers. A pytest started as a
    # background job of a script (`pytest ... &`) has SIGINT ignored, as have its xdist workers,
    # a child inherits that, and a Driver that ignores SIGINT is right to (the platform stops it
    # with SIGTERM). A handler of this process's own is reset to the default in the child.
    held_here = signal.signal(signal.SIGINT, signal.default_int_handler)
    with open(log, "w") as sink:
        try:
            proc = subprocess.Popen(
                [*argv, "--address", cluster_2x2.address],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
            )
        finally:
            signal.signal(signal.SIGINT, held_here)
        try:
            # Step 1 in the run's own log, not in the Driver's echo of it: the echo comes every
            # half second of a Driver that may be starved of CPU, by when a short run of
            # 0.1 s steps can be over.
            main_log = out / run_id / "log" / "main.log"
            wait_until(
                lambda: (
                    (main_log.is_file() and "STEP 1/200" in main_log.read_text())
                    or proc.poll() is not None
                ),
                TIMEOUT,
                "step 1 in the run's main.log",
            )
            assert proc.poll() is None, log.read_text()[-3000:]
            # How the Driver holds SIGINT as it is sent (blocked, ignored, caught), for the
            # message of a Driver that does not stop.
            held = [
                line.strip()
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
            ]
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 130, f"the Driver's signal masks when signalled: {held}\n{text[-3000:]}"
    assert "STARTUP_EXIT_CODE=130" in text
    # The cancellation is what was asked for: no traceback, no "Unhandled error" from Ray.
    assert "Traceback" not in text and "Unhandled error" not in text, text[-3000:]
    # Output that is not a terminal is a log: no colour codes, no redrawn progress bars, and
    # nothing of Ray's after the last line.
    assert "\x1b[" not in text and "Loading weights" not in text, text[-3000:]
    assert text.rstrip("\n").splitlines()[-1] == "STARTUP_EXIT_CODE=130", text[-3000:]
    assert json.loads((out / run_id / "failure.json").read_text())["state"] == "cancelled"
    assert_released(run_id, timeout=30, driver_gone=True)


def test_two_runs_side_by_side_with_one_run_id_do_not_interfere(cluster_2x2, inputs, tmp_path):
    """One RUN_ID under two output roots, two runs at once, each in its own one-node group: run
    A (Driver on the head) is cancelled while run B (Driver on the worker node) is held at its
    third step; B then finishes and verifies. Each run's actors and group carry its own run
    directory's hash, so neither refuses the other's names, and A's cancel releases only A's."""
    placement = {"rollout": 0, "inference": 0, "reward": 0, "actor": 0}
    root_a, root_b = tmp_path / "root-a", tmp_path / "root-b"
    cfg_a = demo_config(
        inputs, root_a, "twin", [*ONE_NODE, "runner.max_steps=500", "runner.save_interval=500"]
    )
    cfg_b = demo_config(
        inputs, root_b, "twin", [*ONE_NODE, "runner.max_steps=4", "runner.save_interval=4"]
    )
    run_a, run_b = ray_name(root_a / "twin"), ray_name(root_b / "twin")  # `twin-<8 hex>`
    assert run_a != run_b and of_run(run_a, "twin") and of_run(run_b, "twin")
    worker_node = next(
        n["NodeID"] for n in ray.nodes() if n["Alive"] and "local_node_1" in n["Resources"]
    )
    launcher = ray.remote(Launcher).options(num_cpus=0, resources={"local_node_1": 0.01}).remote()
    handle_b = ray.get(launcher.start.remote(cfg_b, {"rollout": GatedRollout}), timeout=120)
    handle_a = run_grpo_two_worker(cfg_a)
    try:
        ray.get([handle_a.step(1), handle_b.step(2)], timeout=TIMEOUT)
        head = ray.get_runtime_context().get_node_id()
        assert {r["node_id"] for r in handle_a.topology()} == {head}
        assert {r["node_id"] for r in handle_b.topology()} == {worker_node}
        names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        for run in (run_a, run_b):
            assert f"{run}:controller:0" in names and f"{run}:actor:0" in names, names
        groups = {g["name"] for g in live_groups("twin")}
        assert {f"{run_a}:pg", f"{run_b}:pg"} <= groups, groups

        handle_a.cancel()
        cancelled_at = time.time()
        with pytest.raises(RunCancelledError):
            handle_a.result(timeout=60)
        assert_released(run_a)
        assert run_actors(run_b) and live_groups(run_b)  # B's names untouched by A's release
        assert placement_group_table(handle_b.placement_group)["state"] == "CREATED"
        assert handle_b.status()["state"] == "running" and not handle_b.done()
        marker("twin", "gate").touch()

        report = handle_b.result(timeout=TIMEOUT)
        assert report.passed, report.errors
        assert ray.get(handle_b.step(3), timeout=30).finished_at > cancelled_at
        again = verify_run(
            root_b / "twin", 4, expected_nodes=1, write=False, expected_placement=placement
        )
        assert again.passed, again.errors
        assert_released(run_b)
    finally:
        for handle in (handle_a, handle_b):
            if not handle.done():
                handle.cancel()
        ray.kill(launcher)


# ---- a node lost (runs last: it grows and shrinks the session's cluster) -----------------------


def test_removed_node_fails_the_run_within_the_detection_bound(cluster_2x2, inputs, tmp_path):
    """A third node joins; the second node's GPUs are held, so the run's actors land on the new
    node; that node is then killed (all its processes, no graceful drain)."""
    node_id = cluster_2x2.add_node()
    blocker = placement_group([{"GPU": 2, "local_node_1": 0.01}], name="blocker")
    removed = False
    try:
        ray.get(blocker.ready(), timeout=60)
        run_id = "lose-node"
        cfg = demo_config(inputs, tmp_path, run_id, ["runner.max_steps=3"])
        handle = run_grpo_two_worker(cfg, component_classes={"actor": StallingActor})
        wait_markers(handle, marker(run_id, "actor0.stalled"), marker(run_id, "actor1.stalled"))
        assert {r["node_id"] for r in handle.topology() if r["component"] == "actor"} == {node_id}

        removed_at = time.monotonic()
        cluster_2x2.remove_node(node_id, graceful=False)
        removed = True
        with pytest.raises(ComponentError) as failed:
            handle.result(timeout=bound_of(handle))
        assert time.monotonic() - removed_at < bound_of(handle)
        assert failed.value.component == "actor" and node_id[:8] in failed.value.node
        assert json.loads((tmp_path / run_id / "failure.json").read_text())["component"] == "actor"
        assert_released(run_id)
    finally:
        wait_removed(blocker)
        if not removed:
            cluster_2x2.remove_node(node_id)


class SlowProbe(NodeProbe):
    """A node probe that takes its time (a slow shared file system, say)."""

    def run(self, cfg, node_rank, gpu_ids=None):  # type: ignore[no-untyped-def]
        time.sleep(8)
        return super().run(cfg, node_rank, gpu_ids)


class SlowSavingActor(ActorWorker):
    """An actor rank whose first checkpoint write takes its time."""

    def save_checkpoint(self, path: str):  # type: ignore[no-untyped-def]
        self.saves = getattr(self, "saves", 0) + 1
        if self.saves == 1:
            time.sleep(6)
        return super().save_checkpoint(path)


def _answers_fast(handle, phase_prefix: str, deadline_s: float = 60) -> dict:
    """Wait until the run is in `phase_prefix`, then time status() there."""
    deadline = time.monotonic() + deadline_s
    while not handle.status()["phase"].startswith(phase_prefix):
        assert time.monotonic() < deadline, handle.status()
        time.sleep(0.1)
    started = time.monotonic()
    status = handle.status()
    assert status["phase"].startswith(phase_prefix), status
    assert time.monotonic() - started < 1.0
    return status


def test_status_and_cancel_answer_at_once_during_a_slow_preflight(cluster_2x2, inputs, tmp_path):
    """Every wait of the controller is awaited: while the probes work (each sleeps 8 s first),
    status() answers in under a second and cancel() stops the run at once. Timed once the
    components' processes have answered: right as the preflight begins, the controller itself
    creates those processes and the probes and starts importing torch in a thread, which on
    a loaded 2-core host held its event loop for 1-3 s (work, not a wait; measured in
    session 17)."""
    cfg = demo_config(inputs, tmp_path, "slow-preflight", ONE_RANK)
    handle = run_grpo_two_worker(cfg, component_classes={"probe": SlowProbe})
    wait_until(lambda: "component_start" in handle.startup(), 60, "component start")
    _answers_fast(handle, "preflight")
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 5.0
    with pytest.raises(RunCancelledError):
        handle.result(timeout=60)


class SlowFailingProbe(SlowProbe):
    """A slow node probe that then finds a problem on its node."""

    def run(self, cfg, node_rank, gpu_ids=None):  # type: ignore[no-untyped-def]
        result = super().run(cfg, node_rank, gpu_ids)
        result["errors"].append(f"node {node_rank}: a problem the test made up")
        return result


def test_components_start_beside_the_preflight_and_a_failed_one_releases_them(
    cluster_2x2, inputs, tmp_path
):
    """Every component's process starts and answers while the probes still work, holding
    the GPUs the probes then check; no model loads before the preflight has passed, and a
    failed preflight leaves no process and no placement group behind."""
    cfg = demo_config(inputs, tmp_path, "beside", [])
    handle = run_grpo_two_worker(cfg, component_classes={"probe": SlowFailingProbe})
    wait_until(lambda: "component_start" in handle.startup(), 120, "component start")
    status = handle.status()  # the probes' run() began after it and sleeps 8 s first
    assert status["phase"] == "preflight", status
    assert not [k for k in handle.startup() if k.startswith(("load/", "components"))]
    names = run_actors("beside")
    assert sorted(n.split(":", 1)[1] for n in names if ":controller:" not in n) == [
        "actor:0",
        "actor:1",
        "inference:0",
        "reward:0",
        "rollout:0",
    ]
    with pytest.raises(rlinf_twoworker.PreflightError, match="a problem the test made up"):
        handle.result(timeout=120)
    assert_released("beside")
    probed = json.loads((tmp_path / "beside" / "preflight.json").read_text())["nodes"]
    held = {row["node_rank"]: row["ray_gpu_ids"] for row in probed}
    assert held == {0: ["0", "1"], 1: ["0", "1"]}  # the components' GPUs, bundle by bundle
