"""Files on shared storage are read as data, never run: a planted pickle in a checkpoint's
`.metadata` or in a non-tensor item is refused without running, `resume_dir=auto` takes only
a run of this run's lineage, and the compile and bytecode caches are used only from a directory
no one else can write. Real DCP checkpoints (model, AdamW and LR schedule states), written
and read by PyTorch's own checkpointing; no cluster."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict

from rlinf_twoworker.api.demo import DemoInputs, demo_config, make_inputs
from rlinf_twoworker.config import GRPOConfig, to_typed
from rlinf_twoworker.engines.compile_cache import MAGIC, CompileCache
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.storage import checkpoints as ckpt
from rlinf_twoworker.storage.lineage import LINEAGE_JSON, write_lineage
from rlinf_twoworker.storage.private_dir import keep_compile_cache_private, private_dir_problem
from rlinf_twoworker.storage.readback import load_dcp
from rlinf_twoworker.storage.safe_dcp import UnsafeCheckpointError

DCP = Path("actor") / "dcp_checkpoint"


class Payload:
    """What an attacker plants: unpickling it runs a shell command that leaves a marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def save_checkpoint(checkpoint: Path, extra: dict | None = None) -> dict:
    """A complete checkpoint in the actor's layout: model, AdamW after one step, LambdaLR, RNG;
    `extra` adds items to the saved state. Returns the flat state that was saved."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda _: 1.0)
    model_sd, optim_sd = get_state_dict(model, optim)
    inner = {"model": model_sd, "optimizers": optim_sd, "lr_schedulers": sched.state_dict()}
    state = {
        "fsdp_checkpoint": {**inner, "rng": {"rank_0": torch.get_rng_state()}, **(extra or {})}
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(checkpoint / DCP), no_dist=True)
    (checkpoint / "data").mkdir(parents=True)
    torch.save({"sampler": {"epoch": 0, "consumed": 8}}, checkpoint / "data" / "data.pt")
    return state


@pytest.fixture(scope="module")
def inputs(demo_inputs) -> DemoInputs:
    return demo_inputs


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    checkpoint = tmp_path_factory.mktemp("template") / "global_step_2"
    save_checkpoint(checkpoint)
    return checkpoint


def planted_metadata(dcp_dir: Path, marker: Path) -> None:
    (dcp_dir / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def test_a_real_checkpoint_reads_back_whole_through_the_safe_reader(tmp_path, template):
    assert not ckpt.checkpoint_problems(template)
    metadata = ckpt.read_metadata(template / DCP)
    assert metadata.state_dict_metadata.keys() == (
        FileSystemReader(str(template / DCP)).read_metadata().state_dict_metadata.keys()
    )
    state = load_dcp(template / DCP)
    betas = state["fsdp_checkpoint.optimizers.param_groups.0.betas"]
    assert tuple(betas) == (0.9, 0.95)  # a non-tensor item, loaded as plain data
    assert state["fsdp_checkpoint.lr_schedulers.last_epoch"] == 0
    exp_avg = state["fsdp_checkpoint.optimizers.state.weight.exp_avg"]
    assert exp_avg.shape == (3, 4) and exp_avg.abs().sum() > 0


def test_a_planted_metadata_pickle_never_runs(tmp_path, template):
    marker = tmp_path / "ran"
    run = tmp_path / "runs" / "planted"
    checkpoint = shutil.copytree(template, run / "checkpoints" / "global_step_2")
    planted_metadata(checkpoint / DCP, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system") as refused:
        ckpt.read_metadata(checkpoint / DCP)
    assert str(checkpoint / DCP / ".metadata") in str(refused.value)
    problems = ckpt.checkpoint_problems(checkpoint)
    assert len(problems) == 1 and "not written by PyTorch's checkpointing" in problems[0]
    assert ckpt.complete_steps(run) == [] and ckpt.last_complete(run) is None
    with pytest.raises(ckpt.CheckpointReadError):
        load_dcp(checkpoint / DCP)
    assert not marker.exists()


def test_a_shard_named_outside_its_directory_is_refused(tmp_path, template):
    checkpoint = shutil.copytree(template, tmp_path / "global_step_2")
    metadata = FileSystemReader(str(checkpoint / DCP)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/passwd"
    (checkpoint / DCP / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="not a file of its own directory"):
        ckpt.read_metadata(checkpoint / DCP)


def test_a_planted_non_tensor_item_is_refused_without_running(tmp_path):
    marker = tmp_path / "ran"
    checkpoint = tmp_path / "global_step_2"
    save_checkpoint(checkpoint, extra={"note": Payload(marker)})
    assert not marker.exists()  # saving pickles it; nothing ran
    with pytest.raises(ckpt.CheckpointReadError, match="fsdp_checkpoint.note"):
        load_dcp(checkpoint / DCP)
    assert not marker.exists()


# ---- resume_dir=auto takes only a run of this lineage -----------------------------------------


def config(inputs: DemoInputs, root: Path, run_id: str, *overrides: str) -> GRPOConfig:
    return to_typed(demo_config(inputs, root, run_id, ["runner.resume_dir=auto", *overrides]))


def earlier_run(template: Path, root: Path, name: str, cfg: GRPOConfig, mtime: float) -> Path:
    """A run directory of `cfg`'s lineage with a complete checkpoint finished at `mtime`."""
    checkpoint = shutil.copytree(template, root / name / "checkpoints" / "global_step_2")
    os.utime(checkpoint / DCP / ".metadata", (mtime, mtime))
    write_lineage(root / name, cfg)
    return checkpoint


def test_auto_takes_only_a_run_of_the_same_lineage(tmp_path, inputs, template):
    root = tmp_path / "runs"
    mine = config(inputs, root, "next")
    older = earlier_run(template, root, "grpo-a", mine, 1_000)
    # Newer, but of another lineage: other training settings, another data set, none recorded.
    earlier_run(template, root, "grpo-lr", config(inputs, root, "x", "actor.optim.lr=1e-3"), 2_000)
    other_data = make_inputs(tmp_path / "other", task="digit7")
    earlier_run(template, root, "grpo-data", config(other_data, root, "x"), 3_000)
    unknown = earlier_run(template, root, "grpo-old", mine, 4_000)
    (unknown.parent.parent / LINEAGE_JSON).unlink()
    # Step limits, output places and how fast it runs may differ within a lineage (what an
    # out-of-memory error tells the user to change before resuming).
    longer = config(
        inputs,
        root,
        "x",
        "runner.max_steps=9",
        "runner.save_interval=3",
        "runner.micro_batch_tokens=512",
        "actor.activation_checkpointing=true",
        "rollout.max_batch_size=4",
    )
    assert ckpt.resume_source(longer, root / "next") == older
    assert ckpt.resume_source(mine, root / "next") == older


def test_auto_names_each_run_it_refused_and_what_differs(tmp_path, inputs, template):
    root = tmp_path / "runs"
    earlier_run(template, root, "grpo-lr", config(inputs, root, "x", "actor.optim.lr=1e-3"), 1)
    mine = config(inputs, root, "next")
    with pytest.raises(TwoWorkerError) as refused:
        ckpt.resume_source(mine, root / "next")
    said = str(refused.value)
    assert "run grpo-lr" in said and "actor.optim.lr (0.001 there, 2e-05 here)" in said
    assert "give the run directory to resume from explicitly" in said
    # Named explicitly, the run is taken: the user chose it.
    explicit = config(inputs, root, "next", f"runner.resume_dir={root / 'grpo-lr'}")
    assert ckpt.resume_source(explicit, root / "next") == root / "grpo-lr/checkpoints/global_step_2"


def test_auto_keeps_to_the_prefix_or_the_list_the_user_gave(tmp_path, inputs, template):
    root = tmp_path / "runs"
    mine = config(inputs, root, "next")
    a = earlier_run(template, root, "exp-a-1", mine, 1_000)
    b = earlier_run(template, root, "exp-b-1", mine, 2_000)
    assert ckpt.resume_source(mine, root / "next") == b
    assert ckpt.resume_source(config(inputs, root, "n", "runner.resume_prefix=exp-a"), root) == a
    listed = config(inputs, root, "n", "runner.resume_runs=[exp-a-1]")
    assert ckpt.resume_source(listed, root / "n") == a
    with pytest.raises(TwoWorkerError, match="starting with 'exp-c'"):
        ckpt.resume_source(config(inputs, root, "n", "runner.resume_prefix=exp-c"), root / "n")


def test_auto_never_opens_a_planted_checkpoint_of_another_lineage_or_its_own(
    tmp_path, inputs, template
):
    root, marker = tmp_path / "runs", tmp_path / "ran"
    mine = config(inputs, root, "next")
    good = earlier_run(template, root, "grpo-a", mine, 1_000)
    for name, cfg in (("grpo-z", mine), ("grpo-y", config(inputs, root, "x", "data.seed=5"))):
        planted = earlier_run(template, root, name, cfg, 5_000)
        planted_metadata(planted / DCP, marker)
    assert ckpt.resume_source(mine, root / "next") == good
    assert not marker.exists()
    assert json.loads((root / "grpo-a" / LINEAGE_JSON).read_text())["model_digest"]


# ---- the compile and bytecode caches: only from a directory no one else can write ----------


def test_a_cache_directory_is_private_or_refused(tmp_path):
    fresh = tmp_path / "made" / "cache"
    assert private_dir_problem(fresh) is None
    assert fresh.stat().st_mode & 0o777 == 0o700
    readable = tmp_path / "readable"
    readable.mkdir(mode=0o755)
    os.chmod(readable, 0o755)
    assert private_dir_problem(readable) is None  # the user's, written by no one else
    assert readable.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert "writable by others" in (private_dir_problem(shared) or "")
    os.chmod(shared, 0o775)
    assert "writable by others" in (private_dir_problem(shared) or "")
    link = tmp_path / "link"
    link.symlink_to(fresh)
    assert "symbolic link" in (private_dir_problem(link) or "")
    if os.geteuid() == 0:  # only root can give a directory away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "belongs to user id 65534" in (private_dir_problem(theirs) or "")


def planted_entry(root: Path, key: str) -> Path:
    """A compile-cache entry with a valid header and checksum around bytes that are not
    torch's artifacts: read, it is reported corrupt and moved aside."""
    payload = b"planted"
    entry = root / key / "actor.bin"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    return entry


def test_the_compile_cache_skips_a_directory_others_can_write(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    os.chmod(shared, 0o777)
    entry = planted_entry(shared, "qwen2-0")
    skipped = CompileCache(shared, "actor", "qwen2-0").load()
    assert skipped.state == "skipped" and "writable by others" in skipped.detail
    assert entry.is_file() and not entry.with_name("actor.bin.corrupt").exists()  # unread
    private.mkdir(mode=0o700)
    entry = planted_entry(private, "qwen2-0")
    read = CompileCache(private, "actor", "qwen2-0").load()  # the same entry, where it counts
    assert read.state == "corrupt" and entry.with_name("actor.bin.corrupt").exists()


def test_a_run_turns_a_shared_cache_off_with_one_warning(tmp_path, inputs):
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    os.chmod(shared, 0o777)
    cfg = demo_config(inputs, tmp_path, "r", [f"runner.compile_cache_dir={shared}"])
    typed, said = to_typed(cfg), []
    keep_compile_cache_private(cfg, typed, said.append)
    assert typed.compile_cache_root is None and cfg.runner.compile_cache_dir is None
    assert len(said) == 1 and str(shared) in said[0] and "writable by others" in said[0]
    private = demo_config(inputs, tmp_path, "r", [f"runner.compile_cache_dir={tmp_path / 'own'}"])
    typed, said = to_typed(private), []
    keep_compile_cache_private(private, typed, said.append)  # absent: nothing made yet
    assert typed.compile_cache_root == tmp_path / "own" and said == []
    assert not (tmp_path / "own").exists()  # a run that compiles nothing leaves no cache
