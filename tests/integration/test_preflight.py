"""Manifests, the per-node probe, cross-node comparison, and the preflight on a 2-node cluster."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from omegaconf import OmegaConf

from rlinf_twoworker.cluster.placement import bundle_node_ids, create_placement_group, wait_removed
from rlinf_twoworker.cluster.preflight import compare_nodes, run_preflight
from rlinf_twoworker.cluster.probe import NodeProbe
from rlinf_twoworker.config import GRPOConfig, load_config, to_typed
from rlinf_twoworker.errors import PreflightError
from rlinf_twoworker.storage.manifest import (
    MANIFEST_NAME,
    manifest_dir_for,
    verify_input,
    verify_manifest,
    write_manifest,
)


def make_inputs(root: Path, seed: bytes = b"a") -> tuple[Path, Path]:
    """A tiny model directory and a jsonl data file, each covered by a SHA256SUMS."""
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "model.safetensors").write_bytes(hashlib.sha256(seed).digest() * 64)
    write_manifest(model)
    data_dir = root / "data"
    data_dir.mkdir()
    data = data_dir / "boba.jsonl"
    data.write_text('{"prompt": "1+1?", "solutions": ["\\\\boxed{2}"]}\n')
    write_manifest(data_dir)
    return model, data


def make_cfg(model: Path, data: Path, *extra: str) -> GRPOConfig:
    overrides = [
        "cluster.accelerator=cpu",
        f"actor.model.model_path={model}",
        f"rollout.model.model_path={model}",
        f"inference.model.model_path={model}",
        f"data.train_data_paths=[{data}]",
        "cluster.preflight.required_modules=[torch]",
        "runner.timeouts.preflight_s=90",
        "runner.timeouts.collective_s=30",
        *extra,
    ]
    return to_typed(load_config(overrides=overrides))


@pytest.fixture
def inputs(tmp_path: Path) -> tuple[Path, Path]:
    return make_inputs(tmp_path / "inputs")


@pytest.fixture
def pg(cluster_2x2):
    cfg = GRPOConfig()
    cfg.cluster.accelerator = "cpu"
    group = create_placement_group(cfg.cluster, "test-preflight", timeout_s=60)
    try:
        yield group
    finally:
        assert wait_removed(group, timeout_s=30)
        states = [g["state"] for g in ray.util.placement_group_table().values()]
        assert all(state == "REMOVED" for state in states), states


# ---- manifest -----------------------------------------------------------------------------


def test_manifest_matches_sha256sum_and_verifies(inputs):
    model, data = inputs
    manifest = model / MANIFEST_NAME
    expected = subprocess.run(
        ["sha256sum", "config.json", "model.safetensors"],
        cwd=model,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert manifest.read_text() == expected
    digest = verify_manifest(model)
    assert digest == hashlib.sha256(manifest.read_bytes()).hexdigest()
    assert verify_input(data) == verify_manifest(data.parent)
    assert manifest_dir_for(model) == model and manifest_dir_for(data) == data.parent


def test_manifest_reports_empty_file(inputs):
    model, _ = inputs
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(PreflightError, match=r"model\.safetensors.*empty"):
        verify_manifest(model)


def test_manifest_reports_digest_mismatch(inputs):
    model, _ = inputs
    (model / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(PreflightError, match=r"config\.json.*has SHA256 .* but the manifest"):
        verify_manifest(model)


def test_manifest_rejects_missing_malformed_and_unlisted(tmp_path, inputs):
    with pytest.raises(PreflightError, match="SHA256SUMS is missing"):
        verify_manifest(tmp_path)
    model, data = inputs
    (model / MANIFEST_NAME).write_text("abc  config.json\n")
    with pytest.raises(PreflightError, match="line 1 is not"):
        verify_manifest(model)
    (model / MANIFEST_NAME).write_text(f"{'0' * 64}  ../escape\n")
    with pytest.raises(PreflightError, match="outside its directory"):
        verify_manifest(model)
    (data.parent / "other.jsonl").write_text("{}\n")
    write_manifest(data.parent, ["other.jsonl"])
    with pytest.raises(PreflightError, match="boba.jsonl is not listed"):
        verify_input(data)


def test_remembered_digests_skip_unchanged_files_and_never_a_changed_one(
    tmp_path, inputs, monkeypatch
):
    """cluster.preflight.hash_cache_dir: a second verification reads no file; a file changed
    in place with its size and mtime put back is still hashed again and caught; an entry that
    cannot be used is ignored and rewritten."""
    from rlinf_twoworker.storage import manifest

    model, _ = inputs
    cache = tmp_path / "sha256"
    hashed: list[str] = []
    real = manifest.sha256_file

    def counting(path):
        hashed.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(manifest, "sha256_file", counting)
    first = verify_manifest(model, cache)
    listed = {name for _, name in manifest.read_manifest(model)}
    assert listed <= set(hashed) and len(list(cache.glob("*.json"))) == len(listed)
    hashed.clear()
    assert verify_manifest(model, cache) == first
    assert hashed == [MANIFEST_NAME]  # only the manifest's own digest, which is never cached
    weights = model / "model.safetensors"
    stat = weights.stat()
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF  # same size, and the mtime put back below
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(PreflightError, match=r"model\.safetensors.*has SHA256 .* but the manifest"):
        verify_manifest(model, cache)
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))  # the original bytes again: verifies, from a fresh hash
    for entry in cache.glob("*.json"):
        entry.write_text("{not json")
    hashed.clear()
    assert verify_manifest(model, cache) == first
    assert listed <= set(hashed)  # every unusable entry ignored: hashed again
    assert all(json.loads(e.read_text())["sha256"] for e in cache.glob("*.json"))  # rewritten


# ---- NodeProbe, without Ray actors ----------------------------------------------------------


def test_probe_passes_on_cpu_and_accepts_a_dict(inputs):
    model, data = inputs
    cfg = make_cfg(model, data)
    result = NodeProbe().run(OmegaConf.to_container(OmegaConf.structured(cfg)), node_rank=0)
    assert result["errors"] == []
    assert set(result["manifests"]) == {str(model), str(data)}
    assert result["gpu_count"] == 0 and "no GPU" in result["gpu_note"]
    assert result["modules"]["torch"]


def test_probe_requires_nccl_ib_disable(inputs, monkeypatch):
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    result = NodeProbe().run(make_cfg(*inputs), node_rank=1)
    assert len(result["errors"]) == 1
    assert result["errors"][0].startswith(f"node 1 ({result['hostname']}): NCCL_IB_DISABLE: None")
    assert "export NCCL_IB_DISABLE=1" in result["errors"][0]


def test_probe_reports_bad_input_module_and_prefix(inputs):
    model, data = inputs
    data.write_text('{"prompt": "changed"}\n')
    cfg = make_cfg(
        model,
        data,
        "cluster.preflight.required_modules=[no_such_module_xyz]",
        "cluster.preflight.expected_python_prefix=/opt/other-env",
    )
    errors = NodeProbe().run(cfg, node_rank=0)["errors"]
    assert any(f"{data} (listed in" in e and "has SHA256" in e for e in errors), errors
    assert any("import no_such_module_xyz" in e and "ModuleNotFoundError" in e for e in errors)
    assert any("python prefix" in e and "/opt/other-env" in e for e in errors)


def test_probe_checks_code_commit_and_clean_tree(tmp_path, inputs):
    repo = tmp_path / "code"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True, timeout=30)
    (repo / "main.py").write_text("print('hi')\n")
    subprocess.run([*git, "add", "main.py"], check=True, timeout=30)
    subprocess.run([*git, "commit", "-qm", "c"], check=True, timeout=30)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
    extra = [f"cluster.preflight.code_path={repo}", f"cluster.preflight.code_commit={head}"]
    result = NodeProbe().run(make_cfg(*inputs, *extra), node_rank=0)
    assert result["errors"] == [] and result["code_commit"] == head
    (repo / "main.py").write_text("print('edited')\n")
    errors = NodeProbe().run(make_cfg(*inputs, *extra), node_rank=0)["errors"]
    assert len(errors) == 1 and f"code tree {repo}" in errors[0] and "main.py" in errors[0]


def test_compare_nodes_finds_different_manifests_and_drivers():
    same = {"node_rank": 0, "hostname": "a", "manifests": {"/m": "1"}, "driver_version": "550"}
    assert compare_nodes([same, dict(same, node_rank=1, hostname="b")]) == []
    other = dict(same, node_rank=1, hostname="b", manifests={"/m": "2"}, driver_version="560")
    errors = compare_nodes([same, other])
    assert len(errors) == 2
    assert "input /m" in errors[0] and "node 0 (a)" in errors[0] and "node 1 (b)" in errors[0]
    assert "driver versions differ" in errors[1] and "560" in errors[1]


# ---- run_preflight on the 2-node cluster ----------------------------------------------------


def group_gpus_free(pg) -> float:
    return ray.available_resources().get(f"GPU_group_{pg.id.hex()}", 0.0)


def test_preflight_passes_on_two_nodes(tmp_path, inputs, pg):
    lines: list[str] = []
    report = run_preflight(make_cfg(*inputs), pg, tmp_path / "run", log=lines.append)
    assert report.passed and report.errors == []
    nodes = report.nodes
    assert [n["node_rank"] for n in nodes] == [0, 1]
    assert [n["ray_node_id"] for n in nodes] == bundle_node_ids(pg)
    assert nodes[0]["node_id"] == ray.get_runtime_context().get_node_id() != nodes[1]["node_id"]
    assert all(n["ip"] == "127.0.0.1" and len(n["ray_gpu_ids"]) == 2 for n in nodes)
    assert nodes[0]["manifests"] == nodes[1]["manifests"]
    assert report.collective["results"] == [3.0, 3.0] and report.collective["backend"] == "gloo"
    assert report.collective["init_method"].startswith("tcp://127.0.0.1:")
    saved = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert saved["passed"] and saved["nodes"][1]["hostname"] == nodes[1]["hostname"]
    # A line a person reads: counts and GiB, no placement-group or node:<ip> entries.
    resources = lines[0].removeprefix("RAY_CLUSTER_RESOURCES=")
    assert resources.startswith("CPU=") and " GPU=4 " in resources, lines[0]
    assert "_group_" not in resources and "node:" not in resources
    assert "memory=" in resources and resources.count("GiB") == 2
    host0, host1 = nodes[0]["hostname"], nodes[1]["hostname"]
    assert lines[1:] == [
        f"WORKER_TOPOLOGY=rank=0 role=Ray Head host={host0} gpu_count=0 gpu=none",
        f"WORKER_TOPOLOGY=rank=1 role=Ray Worker host={host1} gpu_count=0 gpu=none",
        "NVIDIA_DRIVER_VERSION_NODE_0=none",
        "NVIDIA_DRIVER_VERSION_NODE_1=none",
        "RLINF_PREFLIGHT_STATUS=passed",
    ]
    deadline = time.monotonic() + 30
    while group_gpus_free(pg) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert group_gpus_free(pg) == 4, "the probes still hold the bundles' GPUs"


def test_preflight_fails_on_empty_file(tmp_path, inputs, pg):
    model, data = inputs
    (model / "model.safetensors").write_bytes(b"")
    lines: list[str] = []
    cfg = make_cfg(model, data, "cluster.preflight.check_collective=false")
    with pytest.raises(PreflightError) as info:
        run_preflight(cfg, pg, tmp_path / "run", log=lines.append)
    message = str(info.value)
    for rank in (0, 1):
        assert f"node {rank} (" in message
    assert f"{model / 'model.safetensors'}" in message and "is empty" in message
    assert lines[-1].startswith("RLINF_PREFLIGHT_STATUS=failed error=node 0 (")
    saved = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert not saved["passed"] and saved["collective"] is None


def test_preflight_fails_when_nodes_see_different_manifests(tmp_path, inputs, pg):
    # Defined here so that Ray pickles it by value (the test module is not importable on workers).
    class NodeOneSeesAnotherCopy(NodeProbe):
        """Node 1 reads the model from another (self-consistent) copy, as a stale mount would."""

        def input_paths(self, cfg: GRPOConfig, node_rank: int) -> dict[str, Path]:
            paths = super().input_paths(cfg, node_rank)
            model = cfg.actor.model.model_path
            if node_rank == 1:
                paths[model] = Path(model).parent / "stale" / "model"
            return paths

    model, data = inputs
    make_inputs(model.parent / "stale", seed=b"old")
    cfg = make_cfg(model, data, "cluster.preflight.check_collective=false")
    with pytest.raises(PreflightError, match="digests differ between nodes") as info:
        run_preflight(cfg, pg, None, log=lambda _: None, probe_cls=NodeOneSeesAnotherCopy)
    assert f"input {model}:" in str(info.value) and "node 1 (" in str(info.value)


def test_preflight_collective_stall_fails_fast(inputs, pg):
    class RankOneNeverJoins(NodeProbe):
        def all_reduce(self, init_method, rank, world_size, backend, timeout_s):  # noqa: ANN001
            if rank == 1:
                return 0.0
            return super().all_reduce(init_method, rank, world_size, backend, timeout_s)

    cfg = make_cfg(*inputs, "runner.timeouts.collective_s=3")
    start = time.monotonic()
    with pytest.raises(PreflightError, match="cross-node all-reduce") as info:
        run_preflight(cfg, pg, None, log=lambda _: None, probe_cls=RankOneNeverJoins)
    assert time.monotonic() - start < 30
    assert "127.0.0.1" in str(info.value) and "node 1" in str(info.value)
    # On a CPU cluster the probes run in the nodes' pooled Ray workers, where the join that
    # timed out just now happened: the next preflight's collective still meets its peer
    # (it would wait out collective_s and fail if the failed join had left state behind).
    again = run_preflight(make_cfg(*inputs), pg, None, log=lambda _: None)
    assert again.passed and again.collective["results"] == [3.0, 3.0], again.errors
    assert all(isinstance(n["pid"], int) for n in again.nodes)


@pytest.mark.gpu
def test_probe_on_cuda_reads_gpus_driver_and_runs_nccl(inputs):
    import torch

    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    capability = "{}.{}".format(*torch.cuda.get_device_capability(0))
    cfg = make_cfg(*inputs, "cluster.accelerator=cuda")
    cfg.cluster.num_gpus_per_node = count  # the probe checks this node only
    cfg.cluster.preflight.expected_gpu_model = name.split()[-1]
    cfg.cluster.preflight.expected_compute_capability = capability
    probe = NodeProbe()
    result = probe.run(cfg, node_rank=0)
    assert result["errors"] == [] and result["cuda_available"]
    assert result["gpu_count"] == count and result["gpu_names"][0] == name
    assert result["compute_capabilities"] == [capability] * count
    assert result["driver_version"] and result["driver_version"][0].isdigit()
    assert result["node_gpu_count"] >= count
    cfg.cluster.preflight.expected_gpu_model = "NoSuchGPU"
    cfg.cluster.preflight.expected_compute_capability = "1.0"
    cfg.cluster.num_gpus_per_node = count + 1
    errors = probe.run(cfg, node_rank=0)["errors"]
    assert [e.split(": ")[1] for e in errors] == ["GPU count", "GPU model", "compute capability"]
    init_method = f"tcp://127.0.0.1:{probe.free_port()}"
    assert probe.all_reduce(init_method, 0, 1, "nccl", timeout_s=60) == 1.0


def test_probe_told_the_components_gpus_reports_them_and_leaves_cpu_runs_alone(inputs, monkeypatch):
    """Beside a run's components the probe holds no GPU: it is told theirs (Ray's ids) and
    reports them; on a CPU run it leaves CUDA_VISIBLE_DEVICES as it found it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "untouched")
    result = NodeProbe().run(make_cfg(*inputs), node_rank=0, gpu_ids=["1", "0"])
    assert result["errors"] == []
    assert (result["ray_gpu_ids"], result["gpus_held_by"]) == (["1", "0"], "components")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "untouched"


PROBE_GIVEN_GPUS = """
import json, sys
from rlinf_twoworker.cluster.probe import NodeProbe
from rlinf_twoworker.config import GRPOConfig, to_typed
from omegaconf import OmegaConf
cfg = to_typed(OmegaConf.merge(OmegaConf.structured(GRPOConfig), json.loads(sys.argv[1])))
result = NodeProbe().run(cfg, 0, gpu_ids=sys.argv[2].split(","))
print(json.dumps({k: result[k] for k in ("errors", "gpu_count", "gpu_memory", "ray_gpu_ids")}))
"""


@pytest.mark.gpu
def test_probe_on_cuda_checks_the_gpus_it_is_told(inputs):
    """In a fresh process (CUDA reads CUDA_VISIBLE_DEVICES once): the probe sees exactly the
    GPUs named, labels each GPU's free memory with its Ray id (the memory plan reads them by
    id), and a named GPU CUDA does not have is a GPU-count error naming the ids."""
    cfg = make_cfg(*inputs, "cluster.accelerator=cuda")
    as_json = json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))

    def probe(ids: str) -> dict:
        argv = [sys.executable, "-c", PROBE_GIVEN_GPUS, as_json, ids]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    seen = probe("0")
    assert seen["errors"] == [] and seen["gpu_count"] == 1, seen
    assert [g["ray_gpu_id"] for g in seen["gpu_memory"]] == ["0"]
    assert 0 < seen["gpu_memory"][0]["free_bytes"] <= seen["gpu_memory"][0]["total_bytes"]
    missing = probe("0,999")
    assert [e.split(": ")[1] for e in missing["errors"]] == ["GPU count"], missing
    assert "CUDA sees 1 of the GPUs Ray gave the run (0,999)" in missing["errors"][0]


@pytest.mark.parametrize("cores", [2, 16])
def test_required_modules_are_imported_here_or_in_processes_by_the_cores(monkeypatch, cores):
    """Under 4 cores the probe imports in its own process; with more, in processes of their
    own, one per module where there are 4 cores each; either way a failure names the module."""
    from rlinf_twoworker.cluster import probe

    monkeypatch.setattr(probe.os, "cpu_count", lambda: cores)
    for name in ("colorsys", "wave"):  # not imported here yet, whichever test ran before
        monkeypatch.delitem(sys.modules, name, raising=False)
    versions, failed = probe.import_in_subprocesses(["colorsys", "no_such_module_xyz", "wave"])
    assert set(versions) == {"colorsys", "wave"} and versions["wave"]
    assert failed == [
        ("no_such_module_xyz", "ModuleNotFoundError: No module named 'no_such_module_xyz'")
    ]
    # Imported in their own processes on the larger host, here on the small one.
    assert ("wave" in sys.modules) == (cores < 4)


def test_modules_this_process_imported_already_are_not_imported_again(monkeypatch):
    """A worker that preloaded the library answers for what it imported without a process;
    the rest still goes to processes of their own on a large host."""
    from rlinf_twoworker.cluster import probe

    monkeypatch.setattr(probe.os, "cpu_count", lambda: 16)
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    started: list[list[str]] = []
    popen = subprocess.Popen

    def spy(argv, **kwargs):
        started.append(argv[3:])
        return popen(argv, **kwargs)

    monkeypatch.setattr(probe.subprocess, "Popen", spy)
    versions, failed = probe.import_in_subprocesses(["json", "omegaconf", "colorsys"])
    assert set(versions) == {"json", "omegaconf", "colorsys"} and failed == []
    assert started == [["colorsys"]]
    started.clear()
    assert probe.import_in_subprocesses(["json", "omegaconf"])[1] == [] and started == []
