"""`readback` and `export-hf` on a finished run, read from storage without Ray, and both failing
clearly on a damaged checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.storage.readback import model_state

DCP = Path("checkpoints/global_step_2/actor/dcp_checkpoint")
# The commands must work where Ray cannot even be imported (a login node, a laptop).
NO_RAY = "import sys; sys.modules['ray'] = None; from rlinf_twoworker.api.cli import main; "


@pytest.fixture
def inputs(finished_inputs):
    return finished_inputs


@pytest.fixture
def run_dir(finished_run) -> Path:
    """conftest's finished run (one for the session: test_export_rlinf reads it too)."""
    return finished_run


def cli(*args: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """The command in a fresh process that has no Ray and sees no GPU (under `umask`)."""
    script = NO_RAY + f"sys.exit(main({list(args)!r}))"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        preexec_fn=None if umask is None else (lambda: os.umask(umask)),
    )


def lines_with(prefix: str, text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
def test_readback_lists_shards_and_counts_parameters(run_dir, inputs):
    done = cli("readback", str(run_dir))
    assert done.returncode == 0, done.stdout + done.stderr
    shards = dict(line.split(" size=") for line in lines_with("READBACK_SHARD=", done.stdout))
    on_disk = {
        f"READBACK_SHARD=actor/dcp_checkpoint/{p.name}": str(p.stat().st_size)
        for p in (run_dir / DCP).glob("*.distcp")
    }
    # two ranks, each shard in runner.checkpoint_write_threads files
    threads = GRPOConfig().runner.checkpoint_write_threads
    assert shards == on_disk and len(shards) == 2 * threads
    initial = load_file(str(inputs.model_path / "model.safetensors"))
    expected = sum(t.numel() for t in initial.values())
    assert lines_with("READBACK_PARAMETERS=", done.stdout) == [f"READBACK_PARAMETERS={expected}"]
    assert done.stdout.splitlines()[-1] == "READBACK_STATUS=passed"


@pytest.mark.slow
def test_export_hf_loads_in_transformers_with_the_checkpoint_weights(run_dir, inputs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    done = cli("export-hf", str(run_dir), "--step", "2", "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out)
    trained = model_state(run_dir / DCP)
    loaded = model.state_dict()
    assert set(loaded) == set(trained)
    assert all(torch.equal(loaded[k], trained[k]) for k in trained)
    initial = load_file(str(inputs.model_path / "model.safetensors"))
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    text = "What is 2+3?"
    source_tokenizer = AutoTokenizer.from_pretrained(inputs.model_path)
    assert (
        AutoTokenizer.from_pretrained(out)(text)["input_ids"] == source_tokenizer(text)["input_ids"]
    )
    info = json.loads((out / "export_info.json").read_text())
    assert info["step"] == 2 and info["checkpoint"].endswith("global_step_2")
    again = cli("export-hf", str(run_dir), "--step", "2", "--out", str(out))
    assert again.returncode == 1 and "already exists" in again.stdout


def damaged_copy(run_dir: Path, target: Path, damage: str) -> Path:
    copy = shutil.copytree(run_dir, target / "damaged")
    dcp = copy / DCP
    if damage == "deleted shard":
        (dcp / "__1_0.distcp").unlink()
    elif damage == "truncated metadata":
        metadata = dcp / ".metadata"
        os.truncate(metadata, metadata.stat().st_size // 2)
    elif damage == "truncated shard":
        os.truncate(dcp / "__0_0.distcp", 1000)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(
    ("damage", "named"),
    [
        ("deleted shard", "__1_0.distcp"),
        ("truncated metadata", ".metadata"),
        ("truncated shard", "__0_0.distcp"),
    ],
)
def test_damaged_checkpoint_fails_readback_and_export_naming_the_file(
    run_dir, tmp_path, damage, named
):
    copy = damaged_copy(run_dir, tmp_path, damage)
    done = cli("readback", str(copy))
    assert done.returncode == 1
    status = lines_with("READBACK_STATUS=failed error=", done.stdout)
    assert len(status) == 1 and named in status[0] and str(copy) in status[0], done.stdout
    exported = cli("export-hf", str(copy), "--step", "2", "--out", str(tmp_path / "hf"))
    assert exported.returncode == 1
    status = lines_with("EXPORT_STATUS=failed error=", exported.stdout)
    assert len(status) == 1 and named in status[0], exported.stdout
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_readback_refuses_a_run_without_a_passed_postflight(run_dir, tmp_path):
    copy = shutil.copytree(run_dir, tmp_path / "unverified")
    (copy / "verification.json").unlink()
    done = cli("readback", str(copy))
    assert done.returncode == 1 and "verification.json is missing" in done.stdout


class Planted:
    """What an attacker leaves on shared storage: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_a_planted_pickle_runs_in_no_command(run_dir, tmp_path):
    """A copy of the finished run whose .metadata is a crafted pickle: every command that reads
    the run refuses it, naming the file, and the payload never runs."""
    import pickle

    marker = tmp_path / "payload-ran"
    copy = shutil.copytree(run_dir, tmp_path / "planted")
    (copy / DCP / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    read = cli("readback", str(copy))  # refused (the copy is not the verified directory)
    assert read.returncode == 1 and lines_with("READBACK_STATUS=failed", read.stdout), read.stdout
    exported = cli("export-hf", str(copy), "--step", "2", "--out", str(tmp_path / "hf"))
    assert exported.returncode == 1 and not (tmp_path / "hf").exists()
    reported = cli("report", str(copy), "--no-plot")
    assert reported.returncode == 0, reported.stdout + reported.stderr  # reads no checkpoint
    # Last: verify rewrites verification.json (as failed), which readback would refuse first.
    verified = cli("verify", str(copy))
    assert verified.returncode != 0 and ".metadata" in verified.stdout + verified.stderr
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(("umask", "mode"), [(0o077, 0o600), (0o022, 0o644)])
def test_export_hf_file_modes_follow_the_users_umask(run_dir, tmp_path, umask, mode):
    """The weights (safetensors writes 0600) and the copied tokenizer and config files (their
    source may be 0644) get what any new file gets under the user's umask."""
    out = tmp_path / "hf"
    done = cli("export-hf", str(run_dir), "--out", str(out), umask=umask)
    assert done.returncode == 0, done.stdout + done.stderr
    files = [p for p in out.iterdir() if p.is_file()]
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {p.name for p in files}
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {
        p.name: oct(mode) for p in files
    }
