"""`export-rlinf`: a finished run's checkpoint in the form RLinf's FSDP actor loads, checked
against what RLinf's loader asserts (its `Checkpoint` Stateful and strategy `load_checkpoint`
at the pinned commit: `<resume_dir>/actor/dcp_checkpoint/*.distcp`, one DCP load of
{"fsdp_checkpoint": {model, optimizers, lr_schedulers: [state], fsdp_version, rng}}, with
DCP's default planner, which refuses any key of that state the checkpoint lacks)."""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlinf_twoworker.storage.export_rlinf import _rng_state, _scheduler_state
from rlinf_twoworker.storage.readback import load_dcp, model_state

DCP = Path("actor/dcp_checkpoint")
SOURCE = Path("checkpoints/global_step_2") / DCP
NO_RAY = "import sys; sys.modules['ray'] = None; from rlinf_twoworker.api.cli import main; "


def cli(*args: str, umask: int = 0o022) -> subprocess.CompletedProcess:
    """The command in a fresh process with no Ray, no GPU and the given umask."""
    script = NO_RAY + f"import os; os.umask({umask}); sys.exit(main({list(args)!r}))"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )


def _rlinf_constant(step: int) -> float:  # RLinf's "constant" schedule is a plain function
    return 1.0


class RlinfCheckpoint:
    """RLinf's FSDP `Checkpoint` as its loader uses it (checkpoint_format "dcp"), on a GPU
    worker: the state it asks DCP to fill, then what its load_state_dict asserts and sets."""

    def __init__(self, model: Any, optimizer: Any, scheduler: Any, fsdp_version: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.fsdp_version = fsdp_version
        self.opts = StateDictOptions(full_state_dict=False, cpu_offload=True)
        self.rng: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.opts)
        return {
            "model": model_sd,
            "optimizers": optim_sd,
            "lr_schedulers": [self.scheduler.state_dict()],
            "fsdp_version": self.fsdp_version,
            "rng": {
                "cpu": torch.get_rng_state(),
                "numpy": np.random.get_state(),
                "random": random.getstate(),
                "cuda": torch.zeros(16, dtype=torch.uint8),  # a CUDA generator's state size
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        assert "fsdp_version" in state, "Checkpoint is missing FSDP version info."
        if state["fsdp_version"] != self.fsdp_version:
            raise ValueError(f"FSDP version mismatch: {state['fsdp_version']}")
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizers"],
            options=self.opts,
        )
        for scheduler, saved in zip([self.scheduler], state["lr_schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        assert {"cpu", "numpy", "random"} <= set(state["rng"])
        self.rng = state["rng"]


def rlinf_resume(resume_dir: Path, model_path: Path, fsdp_version: str = "fsdp") -> Any:
    """What RLinf's actor does with runner.resume_dir: build its model, AdamW and schedule,
    then load `resume_dir/actor` as its strategy's load_checkpoint does."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    dcp_dir = resume_dir / DCP
    assert list(dcp_dir.glob("*.distcp")), f"no *.distcp under {dcp_dir}"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": params, "lr": 1e-6, "betas": (0.9, 0.999)}],
        eps=1e-8,
        weight_decay=0.01,
        fused=False,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _rlinf_constant)
    checkpoint = RlinfCheckpoint(model, optimizer, scheduler, fsdp_version)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"fsdp_checkpoint": checkpoint}, checkpoint_id=str(dcp_dir))
    return checkpoint


def modes(root: Path) -> set[tuple[bool, int]]:
    return {(p.is_dir(), stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


@pytest.mark.slow
def test_rlinf_resumes_from_the_export_with_the_checkpoint_values(
    finished_run, finished_inputs, tmp_path
):
    out = tmp_path / "checkpoints"
    done = cli("export-rlinf", str(finished_run), "--out", str(out), umask=0o027)
    assert done.returncode == 0, done.stdout + done.stderr
    exported = out / "global_step_2"
    assert done.stdout.splitlines()[-1] == "EXPORT_STATUS=passed"
    assert f"EXPORT_RESUME=runner.resume_dir={exported}" in done.stdout.splitlines()
    assert modes(exported) == {(True, 0o750), (False, 0o640)}  # the umask's, for every file
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no staging left

    source = finished_run / SOURCE
    loaded = rlinf_resume(exported, finished_inputs.model_path)
    weights = model_state(source)
    got = loaded.model.state_dict()
    assert set(got) == set(weights)
    initial = load_file(str(finished_inputs.model_path / "model.safetensors"))
    assert any(not torch.equal(initial[k], weights[k].to(initial[k].dtype)) for k in initial)
    for name, value in weights.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name
    saved = load_dcp(source)
    names = {id(p): n for n, p in loaded.model.named_parameters()}
    moments = [k for k in saved if k.endswith(".exp_avg")]
    assert len(loaded.optimizer.state) == len(moments) == len(names)
    for param, state in loaded.optimizer.state.items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            expected = saved[f"fsdp_checkpoint.optimizers.state.{names[id(param)]}.{key}"]
            assert torch.equal(state[key], expected.to(state[key].dtype)), (names[id(param)], key)
    group = loaded.optimizer.param_groups[0]
    assert group["lr"] == saved["fsdp_checkpoint.optimizers.param_groups.0.lr"]
    assert group["betas"] == saved["fsdp_checkpoint.optimizers.param_groups.0.betas"]
    assert group["fused"] is False  # RLinf's sharded AdamW is unfused
    assert loaded.scheduler.last_epoch == saved["fsdp_checkpoint.lr_schedulers.last_epoch"]
    assert loaded.scheduler._step_count == saved["fsdp_checkpoint.lr_schedulers._step_count"]
    assert torch.equal(loaded.rng["cpu"], saved["fsdp_checkpoint.rng.rank_0"])
    assert loaded.rng["cuda"].numel() == 16

    # What the export is for: RLinf's loader refuses the library's own checkpoint, and an
    # export for the other FSDP version.
    with pytest.raises(BaseException, match="Missing key in checkpoint state_dict"):
        rlinf_resume(finished_run / "checkpoints/global_step_2", finished_inputs.model_path)
    with pytest.raises(ValueError, match="FSDP version mismatch"):
        rlinf_resume(exported, finished_inputs.model_path, fsdp_version="fsdp2")


@pytest.mark.slow
def test_export_rlinf_defaults_and_refusals(finished_run, tmp_path):
    copy = shutil.copytree(finished_run, tmp_path / "run")
    done = cli("export-rlinf", str(copy), "--fsdp-version", "fsdp2")
    assert done.returncode == 0, done.stdout + done.stderr
    exported = copy / "rlinf/checkpoints/global_step_2"
    assert "EXPORT_FSDP_VERSION=fsdp2 lr_scheduler=constant" in done.stdout
    assert (exported / DCP / ".metadata").is_file()

    again = cli("export-rlinf", str(copy), "--step", "2")
    assert again.returncode == 1 and "already exists" in again.stdout, again.stdout
    assert "remove it or choose another --out" in again.stdout

    (copy / SOURCE / "__1_0.distcp").unlink()
    damaged = cli("export-rlinf", str(copy), "--out", str(tmp_path / "new"))
    status = [line for line in damaged.stdout.splitlines() if line.startswith("EXPORT_STATUS")]
    assert damaged.returncode == 1 and len(status) == 1 and "__1_0.distcp" in status[0]
    assert not (tmp_path / "new").exists()

    missing = cli("export-rlinf", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and "does not exist" in missing.stdout


def test_small_items_take_rlinf_forms():
    """The forms RLinf's code gives: a LambdaLR of a plain function ("constant") saves
    lr_lambdas [None], of transformers' partial ("cosine") [{}]; get_rng_state() on a GPU
    holds cpu, numpy, random and cuda (16 bytes: seed and offset)."""
    saved = {
        "base_lrs": [1e-3],
        "last_epoch": 8,
        "_step_count": 9,
        "_get_lr_called_within_step": False,
        "_last_lr": [1e-3],
    }
    constant = _scheduler_state(saved, "constant")
    assert constant["lr_lambdas"] == [None] and constant["last_epoch"] == 8
    assert _scheduler_state(saved, "cosine")["lr_lambdas"] == [{}]
    cpu = torch.get_rng_state()
    rng = _rng_state(cpu, 777)
    assert set(rng) == {"cpu", "numpy", "random", "cuda"}
    assert torch.equal(rng["cpu"], cpu) and rng["cuda"].dtype == torch.uint8
    assert rng["cuda"][:8].view(torch.int64).item() == 777 and rng["cuda"].numel() == 16
    assert rng["numpy"][0] == "MT19937" and rng["random"] == random.Random(777).getstate()
