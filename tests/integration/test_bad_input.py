"""Bad input: each gets one clear error that names the key, value or file, and changes nothing.

Errors in the request (RUN_ID, step counts, keys, placement, the cluster's shape, no cluster)
are raised by `run_grpo_two_worker` before anything is created: the output root is listed before
and after. Errors found on the nodes (input files, data lines, the model) fail the run; its run
directory then holds its own logs, config, preflight.json and failure.json, and nothing else,
and the inputs are left as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf
from ray.util.placement_group import placement_group
from support import KEPT, ONE_RANK

from rlinf_twoworker import (
    ClusterError,
    ConfigError,
    PlacementError,
    PreflightError,
    run_grpo_two_worker,
)
from rlinf_twoworker.api.demo import DATA_NAME, demo_config, make_inputs
from rlinf_twoworker.cluster.connect import NAMESPACE, ray_name
from rlinf_twoworker.cluster.placement import wait_removed
from rlinf_twoworker.config import load_config
from rlinf_twoworker.run import kept
from rlinf_twoworker.storage.data import DataError, load_jsonl
from rlinf_twoworker.storage.manifest import write_manifest

TIMEOUT = 300
FAILED_RUN_FILES = {
    "driver.log",
    "log/main.log",
    "hydra/.hydra/config.yaml",
    "hydra/.hydra/overrides.yaml",
    "preflight.json",
    "failure.json",
    "lineage.json",
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_inputs(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def inputs(pristine, tmp_path):
    """A private copy of the demo inputs that a test may break."""
    root = tmp_path / "inputs"
    shutil.copytree(pristine.root, root)
    return type(pristine)(root, root / "model", root / "data" / DATA_NAME)


def listing(root: Path) -> dict[str, str]:
    """Every file under root with its SHA256 (empty when root does not exist)."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def run_files(run_dir: Path) -> set[str]:
    return {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}


def run_error(cfg, **kwargs) -> BaseException:
    """Start a run that must fail; its error, once its placement group is gone."""
    handle = run_grpo_two_worker(cfg, **kwargs)
    with pytest.raises(Exception) as failed:
        handle.result(timeout=TIMEOUT)
    pg = ray_name(handle.output_dir, "pg")
    groups = ray.util.placement_group_table().values()
    assert all(g["state"] == "REMOVED" for g in groups if g["name"] == pg)
    return failed.value


def preflight_error(inputs, tmp_path, run_id: str) -> BaseException:
    """A run that fails before its models load and keeps its processes (KEPT): its error, once
    it has given them back idle for the next run. A run that finds such processes (the test
    before's) starts in them."""
    idle_before = kept._kept_groups()
    error = run_error(demo_config(inputs, tmp_path / "out", run_id, [*ONE_RANK, *KEPT]))
    (group,) = kept._kept_groups()
    lock = ray.get_actor(kept.host_name(group[0], *kept.LOCK), namespace=NAMESPACE)
    assert ray.get(lock.claimed_by.remote(), timeout=30) is None  # idle, for the next run
    if [name for _, name in idle_before] == [group[1]]:  # the same group: it was taken
        log = (tmp_path / "out" / run_id / "log" / "main.log").read_text()
        assert "with 3 kept processes" in log
    return error


def assert_failed_cleanly(run_dir: Path, inputs, before: dict[str, str], error) -> None:
    assert run_files(run_dir) == FAILED_RUN_FILES, run_files(run_dir)
    assert listing(inputs.root) == before  # the inputs are read, never written
    failure = json.loads((run_dir / "failure.json").read_text())
    assert failure["type"] == type(error).__name__ and failure["error"] == str(error)
    assert f"RUN_FAILED error={type(error).__name__}" in (run_dir / "driver.log").read_text()


# ---- the request: rejected before anything is created ---------------------------------------


@pytest.mark.parametrize("run_id", ["../x", "/abs/path", "", "a b", "x/y", ".hidden", "-x"])
def test_invalid_run_id_is_rejected_and_creates_nothing(pristine, tmp_path, run_id):
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"runner\.experiment_name.*must match"):
        demo_config(pristine, out, run_id)
    cfg = demo_config(pristine, out, "valid")
    cfg.runner.experiment_name = run_id  # the library call validates again
    with pytest.raises(ConfigError, match=r"runner\.experiment_name.*must match"):
        run_grpo_two_worker(cfg)
    assert not out.exists() and not (tmp_path / "x").exists()
    assert sorted(os.listdir(tmp_path)) == []


def test_existing_run_directory_is_never_reused(pristine, tmp_path):
    existing = tmp_path / "taken"
    existing.mkdir()
    (existing / "result.txt").write_text("an earlier run's result\n")
    before = listing(tmp_path)
    with pytest.raises(ConfigError, match=r"taken already exists; runs are never reused"):
        run_grpo_two_worker(demo_config(pristine, tmp_path, "taken"))
    assert listing(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["taken"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("runner.max_steps=0", r"'runner\.max_steps' = 0: must be >= 1"),
        ("runner.max_steps=-3", r"'runner\.max_steps' = -3: must be >= 1"),
        ("runner.max_steps=abc", r"'runner\.max_steps' = 'abc': .*could not be converted"),
        ("runner.max_steps=1.5", r"'runner\.max_steps' = 1\.5: .*could not be converted"),
        ("runner.max_steps=", r"'runner\.max_steps' = '': .*could not be converted"),
        ("runner.save_interval=0", r"'runner\.save_interval' = 0: must be -1 or >= 1"),
        ("runner.keep_last_checkpoints=-1", r"'runner\.keep_last_checkpoints' = -1"),
        (
            "runner.checkpoint_write_threads=0",
            r"'runner\.checkpoint_write_threads' = 0: must be >= 1",
        ),
        ("data.rollout_batch_size=0", r"'data\.rollout_batch_size' = 0: must be >= 1"),
    ],
)
def test_bad_step_or_count_is_rejected(pristine, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        demo_config(pristine, tmp_path / "out", "steps", [override])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("runner.max_stepz=3", r"'runner\.max_stepz' = 3: unknown config key"),
        ("nosuch.key=1", r"'nosuch\.key' = 1: unknown config key"),
        ("+runner.extra=1", r"'runner\.extra' = 1: unknown config key"),
        ("runner.max_steps", r"an override must look like key=value"),
    ],
)
def test_unknown_config_key_is_rejected(pristine, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        demo_config(pristine, tmp_path / "out", "keys", [override])
    assert not (tmp_path / "out").exists()


def test_unknown_key_in_a_config_file_names_the_key_and_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("runner:\n  max_steps: 3\n  bogus_key: 1\n")
    with pytest.raises(ConfigError, match=rf"runner\.bogus_key \(in {path}\).*unknown config key"):
        load_config(path)
    assert sorted(os.listdir(tmp_path)) == ["run.yaml"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["cluster.component_placement.actor='2-4'"],
            r"component_placement\.actor.*rank 4 is outside the cluster's 4 resource ranks",
        ),
        (
            ["cluster.component_placement.inference=7"],
            r"component_placement\.inference.*rank 7 is outside",
        ),
        (["cluster.num_nodes=1"], r"component_placement\.\w+.*is outside the cluster's 2"),
        (["cluster.component_placement.actor='1,3'"], r"actor ranks must be contiguous"),
        (["cluster.component_placement.reward=null"], r"every component must be placed"),
    ],
)
def test_placement_outside_the_cluster_is_rejected(pristine, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        demo_config(pristine, tmp_path / "out", "placed", overrides)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.num_nodes=3"], r"Ray finds 2 alive node\(s\) but cluster\.num_nodes=3"),
        (
            ["cluster.num_gpus_per_node=3"],
            r"2 nodes with 3 GPUs each are needed; the alive nodes have GPUs \[2, 2\]",
        ),
    ],
)
def test_too_few_nodes_or_gpus_is_a_cluster_error(
    cluster_2x2, pristine, tmp_path, overrides, message
):
    cfg = demo_config(pristine, tmp_path / "out", "small", overrides)
    with pytest.raises(ClusterError, match=message):
        run_grpo_two_worker(cfg)
    assert not (tmp_path / "out").exists()


def test_gpus_held_by_another_job_fail_placement_with_a_diagnostic(cluster_2x2, pristine, tmp_path):
    """Enough GPUs exist but the head's are taken: the run fails after placement_s, saying
    what it asked for and what each node has free, instead of waiting forever."""
    blocker = placement_group([{"GPU": 2, "local_node_0": 0.01}], name="holds-the-head")
    try:
        ray.get(blocker.ready(), timeout=60)
        cfg = demo_config(pristine, tmp_path / "out", "no-room", ["runner.timeouts.placement_s=3"])
        handle = run_grpo_two_worker(cfg)
        with pytest.raises(PlacementError) as failed:
            handle.result(timeout=TIMEOUT)
    finally:
        wait_removed(blocker)
    message = str(failed.value)
    assert f"'{ray_name(tmp_path / 'out' / 'no-room', 'pg')}' not scheduled within 3 s" in message
    assert "STRICT_SPREAD needs 2 nodes with 2 free GPU(s)" in message
    assert "0/2 GPU free" in message and "2/2 GPU free" in message
    with pytest.raises(ray.exceptions.RayTaskError, match="PlacementError"):
        ray.get(handle.preflight, timeout=30)
    run_dir = tmp_path / "out" / "no-room"
    assert run_files(run_dir) == FAILED_RUN_FILES - {"preflight.json"}


UNCONNECTED_DRIVER = """
import sys
from rlinf_twoworker import ClusterError, run_grpo_two_worker
from rlinf_twoworker.config import load_config

try:
    run_grpo_two_worker(load_config(sys.argv[1]), ray_address=sys.argv[2])
except ClusterError as exc:
    print("ClusterError:", exc)
    sys.exit(3)
sys.exit(0)
"""


def test_no_reachable_ray_cluster_is_a_cluster_error(pristine, tmp_path):
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "out"
    cfg = demo_config(pristine, out, "nowhere")
    path = tmp_path / "config.yaml"
    OmegaConf.save(cfg, path, resolve=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run(
        [sys.executable, "-c", UNCONNECTED_DRIVER, str(path), f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 3, done.stdout + done.stderr[-3000:]
    assert f"no Ray cluster reachable at 127.0.0.1:{port}" in done.stdout
    assert not out.exists()


# ---- the inputs: the preflight names the file, the run fails, nothing else is written --------


def test_missing_model_file_fails_preflight_naming_it(cluster_2x2, inputs, tmp_path):
    (inputs.model_path / "model.safetensors").unlink()
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "no-weights")
    assert isinstance(error, PreflightError)
    assert f"{inputs.model_path / 'model.safetensors'} (listed in" in str(error)
    assert "is missing or not a regular file" in str(error)
    # one readable sentence per node: "preflight failed (2 problems): node 0 (host): input ..."
    assert re.match(r"preflight failed \(\d problems?\): node \d \(", str(error)), str(error)
    assert ":;" not in str(error) and "\n" not in str(error)
    assert str(error).count(f"{inputs.model_path / 'model.safetensors'} (listed in") == 2
    assert_failed_cleanly(tmp_path / "out" / "no-weights", inputs, before, error)


def test_empty_data_file_fails_preflight_naming_it(cluster_2x2, inputs, tmp_path):
    inputs.data_path.write_bytes(b"")
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "empty-data")
    assert isinstance(error, PreflightError)
    assert f"{inputs.data_path} (listed in" in str(error) and "is empty (0 bytes)" in str(error)
    assert_failed_cleanly(tmp_path / "out" / "empty-data", inputs, before, error)


def test_unreadable_manifest_fails_preflight_naming_it(cluster_2x2, inputs, tmp_path):
    """Unreadable whoever reads it (root reads files whatever their mode): not UTF-8."""
    manifest = inputs.model_path / "SHA256SUMS"
    manifest.write_bytes(b"\xff\xfe\x00 not a manifest")
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "bad-manifest")
    assert isinstance(error, PreflightError)
    assert f"manifest {manifest} cannot be read" in str(error)
    assert_failed_cleanly(tmp_path / "out" / "bad-manifest", inputs, before, error)


def test_file_differing_from_its_manifest_fails_preflight_naming_it(cluster_2x2, inputs, tmp_path):
    config = inputs.model_path / "config.json"
    config.write_text(config.read_text() + " ")
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "changed-model")
    assert isinstance(error, PreflightError)
    assert f"{config} (listed in" in str(error) and "but the manifest says" in str(error)
    assert str(error).count(f"{config} (listed in") == 2  # each node reports it
    assert_failed_cleanly(tmp_path / "out" / "changed-model", inputs, before, error)


def write_with_bad_line(inputs, line_number: int) -> None:
    lines = inputs.data_path.read_text().splitlines(keepends=True)
    lines[line_number - 1] = '{"prompt": "cut off here\n'
    inputs.data_path.write_text("".join(lines))
    write_manifest(inputs.data_path.parent, [DATA_NAME])


def test_malformed_data_line_fails_the_run_naming_file_and_line(cluster_2x2, inputs, tmp_path):
    write_with_bad_line(inputs, 5)
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "bad-line")
    assert isinstance(error, DataError)
    assert f"malformed line {inputs.data_path}:5: invalid JSON" in str(error)
    assert "data.skip_malformed_lines=true" in str(error)
    assert_failed_cleanly(tmp_path / "out" / "bad-line", inputs, before, error)


def test_skip_malformed_lines_drops_only_the_bad_lines(inputs):
    total = len(inputs.data_path.read_text().splitlines())
    write_with_bad_line(inputs, 5)
    with pytest.raises(DataError, match=rf"{DATA_NAME}:5: invalid JSON"):
        load_jsonl([str(inputs.data_path)])
    samples = load_jsonl([str(inputs.data_path)], skip_malformed=True)
    assert len(samples) == total - 1


def test_model_that_is_not_a_causal_lm_fails_in_preflight_naming_the_model(
    cluster_2x2, inputs, tmp_path
):
    config = inputs.model_path / "config.json"
    fields = json.loads(config.read_text())
    config.write_text(json.dumps({**fields, "architectures": ["BertModel"]}))
    write_manifest(inputs.model_path)
    before = listing(inputs.root)
    error = preflight_error(inputs, tmp_path, "not-causal")
    # Caught by every node's probe, before any component loads a model.
    assert isinstance(error, PreflightError), error
    assert f"model {inputs.model_path}: architectures ['BertModel'] is not a causal LM" in str(
        error
    )
    assert "node 0" in str(error) and "node 1" in str(error)
    assert_failed_cleanly(tmp_path / "out" / "not-causal", inputs, before, error)


def test_a_hand_built_config_with_a_refused_rlinf_value_fails_before_anything(tmp_path):
    """A GRPOConfig built in Python goes through the same RLinf-key rules as a loaded one."""
    from rlinf_twoworker.config import ActorConfig, GRPOConfig, RunnerConfig

    cfg = GRPOConfig(
        actor=ActorConfig(training_backend="megatron"),
        runner=RunnerConfig(output_dir=str(tmp_path / "out")),
    )
    with pytest.raises(ConfigError, match="actor.training_backend"):
        run_grpo_two_worker(cfg)
    assert not (tmp_path / "out").exists()
