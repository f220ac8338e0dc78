"""The postflight on real run directories: real logs, resolved config, TensorBoard event files and
a two-shard DCP checkpoint written by two gloo processes; then one defect at a time."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from omegaconf import OmegaConf

from rlinf_twoworker import components
from rlinf_twoworker.api.cli import build_parser, main
from rlinf_twoworker.api.demo import DemoInputs, demo_config
from rlinf_twoworker.config import GRPOConfig, to_typed
from rlinf_twoworker.config.placement import placement_record
from rlinf_twoworker.errors import VerificationError
from rlinf_twoworker.storage.rundir import PLACEMENT_JSON, write_placement
from rlinf_twoworker.storage.verify import (
    REQUIRED_SCALARS,
    VALIDATION_SCALARS,
    Expected,
    expected_at,
    expected_from_config,
    expected_from_record,
    require_passed,
    verify_run,
)

RUN_ID = "run-1"
STEPS = 2
STEP_LIMIT = f"Step limit given by max_steps={STEPS} reached. Stopping run"
FULL_STATE = {"embed.weight": torch.arange(32.0).reshape(8, 4), "norm.weight": torch.ones(4)}


def _save_shard(
    rank: int, world_size: int, init_file: str, checkpoint: str, threads: int = 1
) -> None:
    """One FSDP-like rank: its half of every tensor as a DTensor, saved with DCP over gloo
    into `threads` files a rank (as runner.checkpoint_write_threads does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,))
    model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in FULL_STATE.items()}
    writer = dcp.FileSystemWriter(checkpoint, thread_count=threads)
    dcp.save({"fsdp_checkpoint": {"model": model}}, storage_writer=writer)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def dcp_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    checkpoint = root / "dcp_checkpoint"
    mp.spawn(_save_shard, args=(2, str(root / "init"), str(checkpoint)), nprocs=2, join=True)
    return checkpoint


def _series() -> dict[str, list[float]]:
    """Steps 1 and 2 of every required scalar."""
    return {
        "rollout/reward_scores": [-5.0, 1.25],
        "actor/training/actor/final_loss": [0.1, -0.05],
        "actor/training/actor/grad_norm": [0.0, 0.3],  # 0: a step whose groups all tied, legal
        "actor/training/actor/lr": [2e-5, 2e-5],
    }


def write_scalars(run_dir: Path, series: dict[str, list[float]]) -> None:
    # Imported here, not at the top, so that _save_shard's spawned processes start faster.
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    writer = SummaryWriter(str(run_dir / "tensorboard"))
    for tag, values in series.items():
        for step, value in enumerate(values, start=1):
            writer.add_scalar(tag, value, step)
    writer.close()


def write_config(run_dir: Path, overrides: Sequence[str] = (), **edits: Any) -> None:
    """The resolved config as the run saves it, then `edits` ('a__b' = 'a.b') on the YAML."""
    inputs = DemoInputs(run_dir, run_dir / "model", run_dir / "data" / "demo-math.jsonl")
    cfg = OmegaConf.to_container(demo_config(inputs, run_dir.parent, run_dir.name, overrides))
    for dotted, value in edits.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = run_dir / "hydra" / ".hydra" / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(cfg), path)


def _write_logs(run_dir: Path) -> None:
    (run_dir / "log").mkdir(parents=True, exist_ok=True)
    (run_dir / "log" / "main.log").write_text(
        "2025-01-01 00:00:00 step 1 done\n2025-01-01 00:00:09 step 2 done\n"
        f"2025-01-01 00:00:10 {STEP_LIMIT}\n"
    )
    (run_dir / "driver.log").write_text(
        "WORKER_TOPOLOGY=rank=0 role=Ray Head host=head gpu_count=2 gpu=cpu\n"
        "WORKER_TOPOLOGY=rank=1 role=Ray Worker host=worker gpu_count=2 gpu=cpu\n"
        "RLINF_PREFLIGHT_STATUS=passed\n"
        f"{STEP_LIMIT}\nRLINF_PYTHON_EXIT_CODE=0\n"
    )


@pytest.fixture
def run_dir(tmp_path: Path, dcp_template: Path) -> Path:
    """A complete, passing run directory <tmp>/runs/run-1."""
    run = tmp_path / "runs" / RUN_ID
    run.mkdir(parents=True)
    _write_logs(run)
    write_config(run)
    write_scalars(run, _series())
    checkpoint = run / "checkpoints" / f"global_step_{STEPS}"
    shutil.copytree(dcp_template, checkpoint / "actor" / "dcp_checkpoint")
    (checkpoint / "data").mkdir()
    torch.save({"epoch": 0, "consumed": 16, "seed": 1234}, checkpoint / "data" / "data.pt")
    nodes = [{"node_rank": i, "hostname": h, "gpu_count": 2} for i, h in enumerate("ab")]
    (run / "preflight.json").write_text(json.dumps({"passed": True, "nodes": nodes}))
    write_placement_record(run)
    return run


def write_placement_record(run_dir: Path) -> None:
    """placement.json as the run writes it for the demo's placement: each process on the
    first resource rank of its placement (nodes "a" and "b")."""
    inputs = DemoInputs(run_dir, run_dir / "model", run_dir / "data" / "demo-math.jsonl")
    cfg = to_typed(demo_config(inputs, run_dir.parent, run_dir.name))
    placed = placement_record(cfg.cluster, cfg.placement, components.in_run(cfg))
    processes = [
        {
            "component": s.component,
            "rank": s.rank,
            "resource_rank": s.resource_rank,
            "bundle": s.bundle,
            "node_ip": "ab"[s.bundle],
            "pid": 100 + i,
        }
        for i, s in enumerate(cfg.placement.slots)
    ]
    write_placement(run_dir, placed, processes)


def test_the_placement_is_read_from_the_runs_record_which_must_hold_every_process(
    run_dir: Path,
) -> None:
    record = json.loads((run_dir / PLACEMENT_JSON).read_text())
    # What the run recorded is what the report says, whatever the config would resolve to.
    record["components"]["inference"]["nodes"] = [0]
    record["components"]["inference"]["resource_ranks"] = [0]
    for process in record["processes"]:
        if process["component"] == "inference":
            process["resource_rank"] = 0
    (run_dir / PLACEMENT_JSON).write_text(json.dumps(record))
    report, _ = _verify(run_dir)
    assert report.passed, report.errors
    assert report.placement["inference"]["resource_ranks"] == [0]
    # A process outside its component's placement: the record is not this run's.
    record["processes"][-1]["resource_rank"] = 7
    (run_dir / PLACEMENT_JSON).write_text(json.dumps(record))
    report, _ = _verify(run_dir)
    assert not report.passed
    assert [e for e in report.errors if "ran on resource rank 7, outside" in e], report.errors
    # A damaged record is named, not a crash of the postflight.
    (run_dir / PLACEMENT_JSON).write_text(json.dumps({"components": {}, "processes": [3]}))
    report, _ = _verify(run_dir)
    assert [e for e in report.errors if "placement.json cannot be read (TypeError" in e]
    # No record: the run never started its components (or the file is gone).
    (run_dir / PLACEMENT_JSON).unlink()
    report, _ = _verify(run_dir)
    assert not report.passed
    assert [e for e in report.errors if "placement.json cannot be read" in e], report.errors


def test_a_shard_written_as_several_files_a_rank_counts_once_and_each_file_is_checked(
    run_dir: Path, tmp_path: Path
) -> None:
    dcp_dir = run_dir / "checkpoints" / f"global_step_{STEPS}" / "actor" / "dcp_checkpoint"
    shutil.rmtree(dcp_dir)
    mp.spawn(_save_shard, args=(2, str(tmp_path / "init"), str(dcp_dir), 2), nprocs=2, join=True)
    names = sorted(p.name for p in dcp_dir.glob("*.distcp"))
    assert names == ["__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"]
    report, lines = _verify(run_dir)
    assert report.passed, report.errors
    assert report.actor_fsdp_shards == 2 and "ACTOR_FSDP_SHARDS=2" in lines
    # One rank's second file gone: that rank still has a file, but .metadata names the lost one.
    named = [n for n in names if n.startswith("__1_") and (dcp_dir / n).stat().st_size > 0]
    (dcp_dir / named[-1]).unlink()
    report, _ = _verify(run_dir)
    assert not report.passed
    assert [e for e in report.errors if f"{named[-1]} named in .metadata is missing" in e]


def _verify(run: Path, **kwargs: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    report = verify_run(run, STEPS, 2, log=lines.append, **kwargs)
    return report, lines


def test_complete_run_passes(run_dir: Path) -> None:
    report, lines = _verify(run_dir)
    assert report.errors == []
    assert report.passed
    require_passed(report)
    assert report.actor_fsdp_shards == 2
    assert set(report.checkpoint_files) >= {
        "actor/dcp_checkpoint/.metadata",
        "actor/dcp_checkpoint/__0_0.distcp",
        "actor/dcp_checkpoint/__1_0.distcp",
        "data/data.pt",
    }
    lr = report.metrics["actor/training/actor/lr"]
    assert (lr["step"], lr["steps"], lr["value"]) == (2, [1, 2], pytest.approx(2e-5))
    assert report.placement["actor"] == {"spec": "2-3", "resource_ranks": [2, 3], "nodes": [1]}
    assert [w["hostname"] for w in report.workers] == ["a", "b"]
    for tag in REQUIRED_SCALARS:
        assert any(line.startswith(f"GRPO_METRIC={tag} step=2 value=") for line in lines)
    assert "ACTOR_FSDP_SHARDS=2" in lines
    assert f"CHECKPOINT_DIR={run_dir.resolve()}/checkpoints/global_step_2" in lines
    assert lines[-1] == "RLINF_VERIFICATION_STATUS=passed"
    written = json.loads((run_dir / "verification.json").read_text())
    assert written == json.loads(json.dumps(report.to_dict()))
    assert written["target_steps"] == STEPS


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_checkpoint_shards_form_one_loadable_checkpoint(run_dir: Path) -> None:
    state = {"fsdp_checkpoint": {"model": {k: torch.zeros_like(v) for k, v in FULL_STATE.items()}}}
    checkpoint = run_dir / "checkpoints" / "global_step_2" / "actor" / "dcp_checkpoint"
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    for key, tensor in FULL_STATE.items():
        assert torch.equal(state["fsdp_checkpoint"]["model"][key], tensor)


def test_write_false_leaves_the_directory_alone(run_dir: Path) -> None:
    report, _ = _verify(run_dir, write=False)
    assert report.passed
    assert not (run_dir / "verification.json").exists()


def _append(relative: str, line: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        with open(run / relative, "a") as handle:
            handle.write(line + "\n")

    return edit


def _drop_lines(relative: str, text: str) -> Callable[[Path], None]:
    def edit(run: Path) -> None:
        path = run / relative
        kept = [ln for ln in path.read_text().splitlines() if text not in ln]
        path.write_text("".join(f"{ln}\n" for ln in kept))

    return edit


def _remove(relative: str, truncate: bool = False) -> Callable[[Path], None]:
    """Delete (or empty) a file or folder of the step-2 checkpoint."""

    def edit(run: Path) -> None:
        path = run / "checkpoints" / "global_step_2" / relative
        if truncate:
            path.write_bytes(b"")
        elif path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()

    return edit


def _scalars(**changes: list[float] | None) -> Callable[[Path], None]:
    tags = {tag.rsplit("/", 1)[-1]: tag for tag in REQUIRED_SCALARS}

    def edit(run: Path) -> None:
        series = _series()
        for short, values in changes.items():
            if values is None:
                del series[tags[short]]
            else:
                series[tags[short]] = values
        write_scalars(run, series)

    return edit


def _config(**edits: Any) -> Callable[[Path], None]:
    return lambda run: write_config(run, **edits)


def _both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit_all(run: Path) -> None:
        for edit in edits:
            edit(run)

    return edit_all


FAILURES = {
    "traceback": (
        _append("driver.log", "Traceback (most recent call last):"),
        ["driver.log line 6", "Traceback (most recent call last)"],
    ),
    "hydra-error": (
        _append("log/main.log", "Error executing job with overrides: []"),
        ["main.log line 4"],
    ),
    "ray-task-error": (
        _append("log/main.log", "ray.exceptions.RayTaskError(ValueError)"),
        ["RayTaskError("],
    ),
    "actor-died": (
        _append("driver.log", "ray.exceptions.ActorDiedError: dead"),
        ["ActorDiedError"],
    ),
    "oom": (
        _append("log/main.log", "torch.OutOfMemoryError: CUDA out of memory."),
        ["CUDA out of memory"],
    ),
    "preflight-failed": (
        _append("driver.log", "RLINF_PREFLIGHT_STATUS=failed error=x"),
        ["RLINF_PREFLIGHT_STATUS=failed"],
    ),
    "no-exit-code": (
        _drop_lines("driver.log", "RLINF_PYTHON_EXIT_CODE"),
        ["RLINF_PYTHON_EXIT_CODE=0", "there is none"],
    ),
    "exit-code-1": (_append("driver.log", "RLINF_PYTHON_EXIT_CODE=1"), ["the last one says '1'"]),
    "no-step-limit": (
        _both(_drop_lines("driver.log", "Step limit"), _drop_lines("log/main.log", "Step limit")),
        [STEP_LIMIT],
    ),
    "no-main-log": (lambda run: (run / "log" / "main.log").unlink(), ["main.log cannot be read"]),
    "actor-as-int-list": (
        _config(cluster__component_placement__actor=[2, 3]),
        ["component_placement", "[2, 3]"],
    ),
    "actor-as-int": (
        _config(cluster__component_placement__actor=2),
        ["component_placement", "'actor': 2"],
    ),
    "rollout-as-string": (_config(cluster__component_placement__rollout="0"), ["'rollout': '0'"]),
    "num-nodes": (_config(cluster__num_nodes=1), ["cluster.num_nodes is 1", "2"]),
    "max-steps": (_config(runner__max_steps=3), ["runner.max_steps is 3"]),
    "output-dir": (_config(runner__output_dir="/elsewhere"), ["runner.output_dir is '/elsewhere'"]),
    "experiment-name": (
        _config(runner__experiment_name="run-2"),
        ["runner.experiment_name is 'run-2'"],
    ),
    "no-config": (lambda run: shutil.rmtree(run / "hydra"), ["config.yaml cannot be loaded"]),
    "nan-loss": (_scalars(final_loss=[0.1, math.nan]), ["final_loss", "not finite at step 2"]),
    "inf-reward": (
        _scalars(reward_scores=[math.inf, 0.0]),
        ["reward_scores", "not finite at step 1"],
    ),
    "zero-lr": (_scalars(lr=[2e-5, 0.0]), ["actor/training/actor/lr", "not > 0"]),
    "missing-tag": (_scalars(grad_norm=None), ["no scalar 'actor/training/actor/grad_norm'"]),
    "no-events": (lambda run: shutil.rmtree(run / "tensorboard"), ["events.out.tfevents"]),
    "no-metadata": (_remove("actor/dcp_checkpoint/.metadata"), [".metadata is missing or empty"]),
    "one-shard": (
        _remove("actor/dcp_checkpoint/__1_0.distcp"),
        ["shard files of 1 rank(s)", "__1_0.distcp named in .metadata is missing"],
    ),
    "empty-shard": (
        _remove("actor/dcp_checkpoint/__1_0.distcp", truncate=True),
        ["shard files of 1 rank(s)", "__1_0.distcp has 0 bytes"],
    ),
    "no-data-pt": (_remove("data/data.pt"), ["data.pt is missing or empty"]),
    "no-checkpoint": (_remove(""), ["global_step_2 is missing"]),
    "preflight-json-failed": (
        lambda run: (run / "preflight.json").write_text('{"passed": false, "errors": ["gpu"]}'),
        ["preflight.json says the preflight failed"],
    ),
    "no-preflight-json": (
        lambda run: (run / "preflight.json").unlink(),
        ["preflight.json is missing", "does not count"],
    ),
    "no-preflight-status": (
        _drop_lines("driver.log", "RLINF_PREFLIGHT_STATUS"),
        ["driver.log has no line RLINF_PREFLIGHT_STATUS=passed"],
    ),
    "tag-stops-early": (
        _scalars(grad_norm=[0.0]),
        ["'actor/training/actor/grad_norm'", "last logged at step 1, not at the target step 2"],
    ),
}


@pytest.mark.parametrize("name", list(FAILURES))
def test_each_defect_fails_and_is_named(run_dir: Path, name: str) -> None:
    edit, expected = FAILURES[name]
    edit(run_dir)
    report, lines = _verify(run_dir)
    assert not report.passed
    assert len(report.errors) == 1, report.errors
    for text in expected:
        assert text in report.errors[0]
    assert (
        lines[-1] == f"RLINF_VERIFICATION_STATUS=failed error={' '.join(report.errors[0].split())}"
    )
    assert json.loads((run_dir / "verification.json").read_text())["passed"] is False
    with pytest.raises(VerificationError, match="1 error"):
        require_passed(report)


def test_nan_is_written_as_a_string(run_dir: Path) -> None:
    _scalars(final_loss=[0.1, math.nan])(run_dir)
    report, lines = _verify(run_dir)
    assert "GRPO_METRIC=actor/training/actor/final_loss step=2 value=nan" in lines
    written = json.loads((run_dir / "verification.json").read_text(), parse_constant=pytest.fail)
    assert written["metrics"]["actor/training/actor/final_loss"]["value"] == "nan"


def test_other_placement_can_be_expected(run_dir: Path) -> None:
    placement = {"rollout": 0, "inference": 1, "actor": [2, 3], "reward": 0}
    write_config(run_dir, cluster__component_placement=placement)
    assert _verify(run_dir, expected_placement=placement)[0].passed
    assert not _verify(run_dir)[0].passed


def test_missing_run_dir_fails_without_writing(tmp_path: Path) -> None:
    report, lines = _verify(tmp_path / "runs" / "nope")
    assert not report.passed
    assert "does not exist" in report.errors[0]
    assert lines[-1].startswith("RLINF_VERIFICATION_STATUS=failed error=run directory")
    assert not (tmp_path / "runs").exists()


def test_several_defects_are_all_listed(run_dir: Path) -> None:
    _append("driver.log", "Traceback (most recent call last):")(run_dir)
    _remove("data/data.pt")(run_dir)
    report, _ = _verify(run_dir)
    assert len(report.errors) == 2
    with pytest.raises(VerificationError) as info:
        require_passed(report)
    assert "2 error(s)" in str(info.value)
    assert "Traceback" in str(info.value) and "data.pt" in str(info.value)


def test_verify_command_reads_the_run_record(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`rlinf-twoworker verify RUN_DIR` takes steps, nodes, placement, run id and output root
    from hydra/.hydra/config.yaml: a 1-node colocated run passes with no flag at all."""
    colocated = {"rollout": 0, "inference": 0, "actor": "0-1", "reward": 0}
    write_config(run_dir, cluster__num_nodes=1, cluster__component_placement=colocated)
    assert main(["verify", str(run_dir)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "RLINF_VERIFICATION_STATUS=passed"
    assert json.loads((run_dir / "verification.json").read_text())["expected_nodes"] == 1
    assert verify_run(run_dir, STEPS, 2, log=lambda _: None, write=False).passed is False


def test_verify_command_flags_replace_the_record(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", str(run_dir), "--expected-nodes", "1"]) == 1
    assert "cluster.num_nodes is 2 but the run must have 1" in capsys.readouterr().out
    wrong = '{rollout:0,inference:1,actor:"0-1",reward:0}'
    assert main(["verify", str(run_dir), "--expected-placement", wrong]) == 1
    assert main(["verify", str(run_dir), "--expected-placement", "[1,2]"]) == 2
    assert "is not a map" in capsys.readouterr().out
    # --target-steps moves the step-limit line and the step every metric must end at.
    assert main(["verify", str(run_dir), "--target-steps", "3"]) == 1
    out = capsys.readouterr().out
    assert "max_steps=3 reached" in out and "not at the target step 3" in out


def test_a_what_if_verify_leaves_the_runs_record_unchanged(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify RUN_DIR writes verification.json when it checks the run against its own record;
    with a flag that asks about other values (--target-steps 3 on a 2-step run) it prints its
    verdict and leaves the record as the run left it, so readback still takes the run."""
    assert main(["verify", str(run_dir)]) == 0
    record = (run_dir / "verification.json").read_bytes()
    assert json.loads(record)["passed"] is True
    capsys.readouterr()
    assert main(["verify", str(run_dir), "--target-steps", "3"]) == 1
    out = capsys.readouterr().out
    assert "verification.json left unchanged" in out and "not at the target step 3" in out
    assert (run_dir / "verification.json").read_bytes() == record
    # Flags that repeat the record's own values are its own question: written again.
    assert main(["verify", str(run_dir), "--target-steps", str(STEPS)]) == 0
    assert "left unchanged" not in capsys.readouterr().out


def test_verify_command_keeps_output_dir_as_an_alias(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", "--output-dir", str(run_dir)]) == 0
    assert "--output-dir is deprecated" in capsys.readouterr().err
    assert main(["verify", str(run_dir), "--output-dir", str(run_dir.parent)]) == 2


def test_verify_command_takes_the_checkpoint_schedule_from_the_record(run_dir: Path) -> None:
    """A run recorded with runner.save_interval=-1 saves no checkpoint, and passes without one."""
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["verify", str(run_dir)]) == 1
    write_config(run_dir, ["runner.save_interval=-1"])
    assert main(["verify", str(run_dir)]) == 0
    written = json.loads((run_dir / "verification.json").read_text())
    assert written["checkpoint_step"] is None and "no checkpoint expected" in written["notes"][0]


def test_verify_command_without_a_record_says_to_pass_the_flags(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shutil.rmtree(run_dir / "hydra")
    assert main(["verify", str(run_dir)]) == 2
    out = capsys.readouterr().out
    assert out.startswith("RLINF_VERIFICATION_STATUS=failed error=the run's record")
    assert "config.yaml cannot be read" in out and "--target-steps and --expected-nodes" in out
    # With the flags the postflight runs, and finds the missing record among its errors.
    assert main(["verify", str(run_dir), "--target-steps", "2", "--expected-nodes", "2"]) == 1
    assert "config.yaml cannot be loaded" in capsys.readouterr().out


def test_help_describes_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    description = build_parser().description or ""
    commands = ("run", "demo", "preflight", "verify", "readback", "export-hf", "report")
    assert all(f"{name}," in description or f"{name}." in description for name in commands)
    assert description.endswith("report.")
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert description in shown and "Exit codes: 0 success" in shown


def _expected(run: Path, **changes: Any) -> Expected:
    values: dict[str, Any] = dict(
        run_id=RUN_ID,
        output_root=run.parent,
        target_steps=STEPS,
        expected_nodes=2,
        checkpoint_step=STEPS,
    )
    return Expected(**{**values, **changes})


def test_postflight_checks_the_request_not_the_record(run_dir: Path) -> None:
    lines: list[str] = []
    assert verify_run(run_dir, expected=_expected(run_dir), log=lines.append).passed
    assert lines[-1] == "RLINF_VERIFICATION_STATUS=passed"
    report = verify_run(run_dir, expected=_expected(run_dir, run_id="run-2"), write=False)
    assert len(report.errors) == 2
    assert "runner.experiment_name is 'run-1' but the run must have 'run-2'" in report.errors[0]
    assert f"run directory {run_dir} is not " in report.errors[1]
    assert "run id 'run-2'" in report.errors[1]
    elsewhere = run_dir.parent.parent / "other-root"
    report = verify_run(run_dir, expected=_expected(run_dir, output_root=elsewhere), write=False)
    assert len(report.errors) == 2
    assert f"must have been written under {elsewhere}" in report.errors[0]
    assert f"output root {elsewhere}" in report.errors[1]


def test_no_checkpoint_expected_passes_without_one_and_says_so(run_dir: Path) -> None:
    shutil.rmtree(run_dir / "checkpoints")
    assert not verify_run(run_dir, expected=_expected(run_dir), log=lambda _: None).passed
    lines: list[str] = []
    report = verify_run(
        run_dir, expected=_expected(run_dir, checkpoint_step=None), log=lines.append
    )
    assert report.passed, report.errors
    assert report.checkpoint_step is None and report.checkpoint_dir is None
    assert "no checkpoint expected" in report.notes[0]
    assert any(ln.startswith("RLINF_VERIFICATION_NOTE=no checkpoint expected") for ln in lines)


def test_added_tags_are_required_up_to_the_target_step(run_dir: Path) -> None:
    expected = _expected(run_dir, required_tags=REQUIRED_SCALARS + VALIDATION_SCALARS)
    report = verify_run(run_dir, expected=expected, write=False)
    assert len(report.errors) == 2
    assert "no scalar 'val/reward_scores'" in report.errors[0]
    assert "no scalar 'val/correct_fraction'" in report.errors[1]
    series = {**_series(), "val/reward_scores": [1.0, 2.0], "val/correct_fraction": [0.5]}
    write_scalars(run_dir, series)
    report = verify_run(run_dir, expected=expected, write=False)
    assert len(report.errors) == 1
    assert (
        "'val/correct_fraction'" in report.errors[0] and "last logged at step 1" in report.errors[0]
    )
    write_scalars(run_dir, {**series, "val/correct_fraction": [0.5, 0.75]})
    assert verify_run(run_dir, expected=expected, write=False).passed


def test_a_run_that_its_epochs_ended_early_is_checked_at_its_last_step(run_dir: Path) -> None:
    """runner.max_epochs ended the run at step 2 of runner.max_steps=5: the logs, the metrics and
    the checkpoint stop at step 2, the record keeps max_steps=5."""
    write_config(run_dir, ["runner.max_steps=5"])
    assert not verify_run(run_dir, STEPS, 2, log=lambda _: None, write=False).passed
    expected = _expected(run_dir, max_steps=5)
    assert verify_run(run_dir, expected=expected, log=lambda _: None, write=False).passed
    assert main(["verify", str(run_dir)]) == 1
    assert main(["verify", str(run_dir), "--target-steps", "2"]) == 0


def test_verify_run_takes_expected_or_the_old_arguments_not_both(run_dir: Path) -> None:
    with pytest.raises(TypeError, match="not both"):
        verify_run(run_dir, STEPS, expected=_expected(run_dir))
    with pytest.raises(TypeError, match="needs expected="):
        verify_run(run_dir)


def test_expected_refuses_values_that_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Expected.checkpoint_step = 3: must be None"):
        _expected(tmp_path / RUN_ID, checkpoint_step=3)
    with pytest.raises(ValueError, match="Expected.target_steps = 0"):
        _expected(tmp_path / RUN_ID, target_steps=0, checkpoint_step=None)


def test_expected_from_config_is_the_request(tmp_path: Path) -> None:
    cfg = GRPOConfig()
    cfg.runner.experiment_name, cfg.runner.output_dir = "asked", str(tmp_path / "root")
    cfg.runner.max_steps, cfg.runner.save_interval, cfg.cluster.num_nodes = 3, 1, 2
    placement = {"rollout": 0, "inference": 1, "actor": [2, 3], "reward": 0}
    expected = expected_from_config(cfg, placement)
    assert expected == Expected(
        run_id="asked",
        output_root=tmp_path / "root",
        target_steps=3,
        expected_nodes=2,
        checkpoint_step=3,
        max_steps=3,
        placement=placement,
        required_tags=REQUIRED_SCALARS,
    )
    # runner.max_epochs ended the run at step 2: the record still says max_steps=3.
    ended_early = expected_from_config(cfg, placement, last_step=2)
    assert (ended_early.target_steps, ended_early.max_steps, ended_early.checkpoint_step) == (
        2,
        3,
        2,
    )
    assert expected_from_config(cfg).placement == cfg.cluster.component_placement
    cfg.runner.save_interval = -1  # RLinf: never save
    assert expected_from_config(cfg, placement).checkpoint_step is None
    cfg.data.val_data_paths = [str(tmp_path / "val.jsonl")]  # type: ignore[attr-defined]
    cfg.runner.val_check_interval = 0  # type: ignore[attr-defined]
    assert expected_from_config(cfg, placement).required_tags == REQUIRED_SCALARS
    cfg.runner.val_check_interval = 1  # type: ignore[attr-defined]
    tags = expected_from_config(cfg, placement).required_tags
    assert tags == REQUIRED_SCALARS + VALIDATION_SCALARS


def test_expected_from_record_reads_the_run_and_takes_replacements(run_dir: Path) -> None:
    assert expected_from_record(run_dir) == expected_at(run_dir, STEPS, 2)
    replaced = expected_from_record(run_dir, target_steps=4, expected_nodes=1)
    assert (replaced.target_steps, replaced.checkpoint_step, replaced.expected_nodes) == (4, 4, 1)
    assert replaced.max_steps == STEPS  # the record's runner.max_steps
    with pytest.raises(VerificationError, match="run directory .* does not exist"):
        expected_from_record(run_dir.parent / "nope")


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (None, "no failure.json either"),
        (
            '{"state": "failed", "type": "ComponentError", "error": "rank 1 died"}',
            "records the run failed: ComponentError: rank 1 died",
        ),
        ("{not json", "failure.json cannot be read"),
    ],
)
def test_a_run_without_exit_status_says_why_it_ended(
    tmp_path: Path, failure: str | None, says: str
) -> None:
    run = tmp_path / "stopped"
    run.mkdir()
    (run / "driver.log").write_text("STEP 1/2 reward=0\n")
    if failure is not None:
        (run / "failure.json").write_text(failure)
    report = verify_run(run, 2, 2, log=lambda _: None, write=False)
    ending = next(e for e in report.errors if "RLINF_PYTHON_EXIT_CODE" in e)
    assert says in ending


def test_tensorboard_is_read_where_runner_logger_log_path_put_it(run_dir: Path) -> None:
    """RLinf's runner.logger.log_path decides where tensorboard/ goes; the postflight follows
    the run's record there (and misses it without the record's word)."""
    elsewhere = run_dir.parent / "logs-elsewhere"
    shutil.move(str(run_dir / "tensorboard"), str(elsewhere / "tensorboard"))
    report, _ = _verify(run_dir)
    assert any("holds no events.out.tfevents" in e for e in report.errors)
    write_config(run_dir, [f"runner.logger.log_path={elsewhere}"])
    report, _ = _verify(run_dir)
    assert report.errors == [] and report.passed
