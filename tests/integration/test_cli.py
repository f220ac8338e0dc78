"""`rlinf-twoworker run`, `preflight` and `report` as the platform runs them: subprocesses on a
real 2-node Ray cluster, connecting through RAY_ADDRESS like a Driver on the Ray Head."""

from __future__ import annotations

import os
import pty
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from support import ONE_RANK

from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.api.report import one_line, progress_line
from rlinf_twoworker.api.request import RequestError, env_overrides, resolve_request
from rlinf_twoworker.config import to_yaml
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.storage.verify import verify_run

CLI = [sys.executable, "-m", "rlinf_twoworker.api.cli"]
RUNS = Path("runs") / "two-worker-grpo-pipeline"
STATUS_PREFIXES = (
    "RAY_CLUSTER_RESOURCES=",
    "WORKER_TOPOLOGY=rank=0 role=Ray Head",
    "WORKER_TOPOLOGY=rank=1 role=Ray Worker",
    "NVIDIA_DRIVER_VERSION_NODE_0=",
    "NVIDIA_DRIVER_VERSION_NODE_1=",
    "RLINF_PREFLIGHT_STATUS=passed",
    "RLINF_PYTHON_EXIT_CODE=0",
    "RLINF_VERIFICATION_STATUS=passed",
)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    """The demo's config as a YAML file, as a platform user would keep it."""
    root = tmp_path_factory.mktemp("cli-config")
    cfg = demo_config(make_inputs(root / "inputs", task="digit7"), root / "unused", "template")
    path = root / "demo.yaml"
    path.write_text(to_yaml(cfg))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def driver_env(address: str, work_root: Path, **values: str) -> dict[str, str]:
    env = dict(os.environ, RAY_ADDRESS=address, WORK_ROOT=str(work_root), TARGET_STEPS="2")
    env["RUN_ID"] = "cli-run"
    env.update(values)
    return env


def run_in_terminal(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run with stdout and stderr on a pseudo-terminal, as in an interactive shell."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), b"".join(chunks).decode(
            errors="replace"
        )
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def cli_run(cluster_2x2, config_file, tmp_path_factory) -> tuple[int, str, Path]:
    """One `run` in a terminal: (exit code, what the terminal showed, the run directory)."""
    work_root = tmp_path_factory.mktemp("work-root")
    env = driver_env(cluster_2x2.address, work_root)
    code, shown = run_in_terminal([*CLI, "run", "--config", str(config_file)], env, 500)
    return code, shown, work_root / RUNS / "cli-run"


@pytest.mark.slow
def test_run_writes_every_status_line_and_passes_postflight(cli_run):
    code, shown, run_dir = cli_run
    assert code == 0, shown[-3000:]
    lines = (run_dir / "driver.log").read_text().splitlines()
    for prefix in STATUS_PREFIXES:
        assert any(line.startswith(prefix) for line in lines), (prefix, lines)
    assert lines[-1] == "STARTUP_EXIT_CODE=0"
    assert lines[0] == f"RUN_DIR={run_dir}"
    assert lines.index("RLINF_PREFLIGHT_STATUS=passed") < lines.index("RLINF_PYTHON_EXIT_CODE=0")
    assert verify_run(run_dir, 2, 2, write=False).passed
    # The Driver showed every driver.log line, and a progress line under them on the terminal.
    terminal = shown.replace("\r\n", "\n")
    assert all(line in terminal for line in lines)
    # A progress line with a finished step's reward: during step 2 or, when step 2 is shorter
    # than the display's poll, during the checkpoint or the postflight after it.
    assert re.search(r"\r\x1b\[K[12]/2 steps done \| [^|\r]+ \| reward -?[0-9]", shown), shown
    verify = subprocess.run(  # the run's own record says what it must show
        [*CLI, "verify", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0 and "RLINF_VERIFICATION_STATUS=passed" in verify.stdout


@pytest.mark.slow
def test_report_prints_a_table_and_writes_a_plot(cli_run, tmp_path):
    _, _, run_dir = cli_run
    out = tmp_path / "report.png"
    done = subprocess.run(
        [*CLI, "report", str(run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()
    assert rows[0].split() == ["step", "reward", "loss", "grad_norm", "lr", "step_s"]
    assert [r.split()[0] for r in rows[1:3]] == ["1", "2"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.slow
def test_run_failing_after_preflight_exits_non_zero_and_fails_postflight(
    cluster_2x2, config_file, tmp_path
):
    done = subprocess.run(
        [*CLI, "run", "--config", str(config_file), *ONE_RANK, "runner.timeouts.step_s=0.001"],
        env=driver_env(cluster_2x2.address, tmp_path, RUN_ID="cli-fails"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 1, done.stderr
    run_dir = tmp_path / RUNS / "cli-fails"
    lines = (run_dir / "driver.log").read_text().splitlines()
    assert "RLINF_PREFLIGHT_STATUS=passed" in lines
    errors = [line for line in lines if line.startswith("RLINF_ERROR=")]
    assert len(errors) == 1 and "did not finish within 0.001 s" in errors[0], lines
    assert lines[-2:] == ["RLINF_PYTHON_EXIT_CODE=1", "STARTUP_EXIT_CODE=1"]
    assert not verify_run(run_dir, 2, 2, write=False).passed


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"RUN_ID": "bad/id"}, "RUN_ID='bad/id' is invalid"),
        ({"RUN_ID": ""}, "RUN_ID='' is invalid"),
        ({"TARGET_STEPS": "0"}, "TARGET_STEPS='0' is invalid"),
        ({"TARGET_STEPS": "1"}, "TARGET_STEPS='1' is invalid: it must be an integer >= 2"),
        ({"TARGET_STEPS": "two"}, "TARGET_STEPS='two' is invalid"),
        ({"RUN_ID": "taken"}, "already exists"),
    ],
)
def test_bad_request_fails_fast_without_a_cluster_and_touches_nothing(
    config_file, tmp_path, values, expected
):
    (tmp_path / RUNS / "taken").mkdir(parents=True)
    (tmp_path / RUNS / "taken" / "driver.log").write_text("an earlier run\n")
    before = snapshot(tmp_path)
    nowhere = f"127.0.0.1:{free_port()}"  # validation must not need the cluster
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "run", "--config", str(config_file)],
        env=driver_env(nowhere, tmp_path, **values),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - started < 20
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("RLINF_ERROR=")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert done.stdout.splitlines()[-1] == "STARTUP_EXIT_CODE=2"
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "argv",
    [["demo", "--steps", "1"], ["verify", "no-such-run", "--target-steps", "1"]],
)
def test_every_command_takes_one_minimum_step_count(tmp_path, argv):
    """run's TARGET_STEPS, demo's --steps and verify's --target-steps follow one rule
    (api.request.MIN_STEPS): 1 is refused by each, with the same reason, before anything runs."""
    from rlinf_twoworker.api.request import MIN_STEPS

    done = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    flag = argv[-2]
    assert f"{flag}='1' is invalid: it must be an integer >= {MIN_STEPS}" in done.stderr
    assert "RLinf never logs the final step's metrics" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--run-id", "../x"], "RequestError: --run-id '../x' is invalid: it must match"),
        (["--run-id", "taken"], "choose a new run id (RUN_ID of `rlinf-twoworker run`, --run-id"),
        (["runner.max_steps"], "override 'runner.max_steps' has no '=' (give runner.max_steps="),
        (
            ["runner.max_steps=abc"],
            "could not be converted to Integer; give a value of the key's type, like its "
            "default: runner.max_steps=2",
        ),
    ],
)
def test_demo_errors_name_what_the_user_typed(tmp_path, argv, expected):
    (tmp_path / "demo-runs" / "taken").mkdir(parents=True)
    before = snapshot(tmp_path)
    done = subprocess.run(
        [*CLI, "demo", *argv], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("RLINF_ERROR=")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert snapshot(tmp_path) == before


def test_request_check_lists_every_problem_in_the_tutorials_order(config_file, tmp_path):
    """A reused RUN_ID, a model path that is not there and an empty data file: one error
    naming all three, RUN_ID first, so one attempt shows everything to fix."""
    (tmp_path / RUNS / "taken").mkdir(parents=True)
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    env = {"RUN_ID": "taken", "WORK_ROOT": str(tmp_path), "TARGET_STEPS": "2"}
    overrides = [
        f"actor.model.model_path={tmp_path / 'no-model'}",
        f"data.train_data_paths=[{empty}]",
    ]
    with pytest.raises(RequestError) as info:
        resolve_request(str(config_file), overrides, env)
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert "run directory" in problems[0] and "already exists" in problems[0]
    assert problems[1].startswith(f"actor.model.model_path = '{tmp_path / 'no-model'}'")
    assert "the model directory does not exist" in problems[1]
    assert problems[2] == (
        f"data.train_data_paths: data file {empty} is empty; give the JSONL file with the prompts"
    )
    lines = str(info.value).splitlines()
    assert lines == ["the request has 3 problems:", *(f"  - {p}" for p in problems)]


def test_request_check_says_what_is_wrong_with_each_input(config_file, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "1+1", "solutions": ["2"]}\n')
    no_config, no_tokenizer = tmp_path / "no-config", tmp_path / "no-tokenizer"
    no_config.mkdir()
    no_tokenizer.mkdir()
    overrides = [
        f"rollout.model.model_path={data}",
        f"inference.model.model_path={no_config}",
        f"actor.tokenizer.tokenizer_model={no_tokenizer}",
        f"data.train_data_paths=[{tmp_path / 'gone.jsonl'},{no_config}]",
    ]
    with pytest.raises(RequestError) as info:
        resolve_request(str(config_file), overrides, {}, for_run=False)
    problems = info.value.problems
    assert len(problems) == 5, problems
    assert problems[0].startswith(f"rollout.model.model_path = '{data}' is a file, not a dir")
    assert problems[1].startswith("inference.model.model_path = ")
    assert "has no readable config.json" in problems[1]
    assert problems[2].startswith("actor.tokenizer.tokenizer_model = ")
    assert "holds no tokenizer (neither tokenizer_config.json nor tokenizer.json)" in problems[2]
    assert "gone.jsonl does not exist" in problems[3]
    assert f"{no_config} is not a file" in problems[4]


def _run_request(config_file: Path, tmp_path: Path, *overrides: str):
    """`rlinf-twoworker run` against no cluster (the request check must not need one): the
    finished process and its seconds."""
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "run", "--config", str(config_file), *overrides],
        env=driver_env(f"127.0.0.1:{free_port()}", tmp_path / "work"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, time.monotonic() - started


def test_bad_data_is_refused_by_the_request_check_naming_file_line_and_column(
    config_file, tmp_path
):
    """One line cut short among 200 (its SHA256SUMS correct): refused before Ray is touched,
    in seconds, at that line's own column; nothing written."""
    from rlinf_twoworker.storage.manifest import write_manifest

    good = '{"prompt": "What is 1+1?", "solutions": ["2"]}\n'
    bad = '{"prompt": "cut short", "solutions": ["2"]'
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text(good * 100 + bad + "\n" + good * 99)
    write_manifest(data.parent, ["train.jsonl"])
    done, seconds = _run_request(config_file, tmp_path, f"data.train_data_paths=[{data}]")
    assert seconds < 10, seconds
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("RLINF_ERROR=")]
    column = len(bad) + 1  # where the missing brace was due: on line 101, not column 1 of 102
    expected = (
        f"malformed line {data}:101: invalid JSON (Expecting ',' delimiter at column {column})"
    )
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert "data.skip_malformed_lines=true" in errors[0]
    assert not (tmp_path / "work").exists()


def test_a_data_file_without_its_manifest_is_named_once_by_the_request_check(config_file, tmp_path):
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "What is 1+1?", "solutions": ["2"]}\n')
    done, seconds = _run_request(config_file, tmp_path, f"data.train_data_paths=[{data}]")
    assert seconds < 10, seconds
    assert done.returncode == 2, done.stderr
    manifest = data.parent / "SHA256SUMS"
    assert done.stderr.count(f"manifest {manifest} is missing") == 1, done.stderr
    (data.parent / "SHA256SUMS").write_text(f"{'0' * 64}  other.jsonl\n")
    done, _ = _run_request(config_file, tmp_path, f"data.train_data_paths=[{data}]")
    assert done.returncode == 2 and f"input {data} is not listed in {manifest}" in done.stderr


def test_environment_problems_come_together_and_a_config_error_comes_alone(config_file):
    env = {"RUN_ID": "bad/id", "TARGET_STEPS": "1", "WORK_ROOT": "/no/such/root"}
    with pytest.raises(RequestError) as info:
        env_overrides(env, [], need_run_id=True)
    problems = info.value.problems
    assert [p.split("=", 1)[0] for p in problems] == ["RUN_ID", "TARGET_STEPS", "WORK_ROOT"]
    assert str(info.value).startswith("the request has 3 problems:\n  - RUN_ID='bad/id'")
    with pytest.raises(ConfigError, match="config key 'runner.max_steps' = 0"):
        resolve_request(str(config_file), ["runner.max_steps=0"], env)


def test_no_reachable_cluster_fails_fast_and_creates_nothing(config_file, tmp_path):
    started = time.monotonic()
    done = subprocess.run(
        [*CLI, "run", "--config", str(config_file)],
        env=driver_env(f"127.0.0.1:{free_port()}", tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert time.monotonic() - started < 30
    assert done.returncode == 3
    errors = [line for line in done.stderr.splitlines() if line.startswith("RLINF_ERROR=")]
    assert len(errors) == 1 and "no Ray cluster reachable" in errors[0], done.stderr
    # it tells a CLI user their own ways in, and the way to try without a cluster
    for hint in ("--address", "RAY_ADDRESS", "rlinf-twoworker demo"):
        assert hint in errors[0], errors[0]
    assert ".." not in errors[0].replace("...", "")
    assert done.stdout.splitlines()[-1] == "STARTUP_EXIT_CODE=3"
    assert list(tmp_path.iterdir()) == []


def test_demo_checks_the_request_before_writing_anything(tmp_path):
    """A typo in a demo override, or a reused run id, fails in seconds, before any input,
    cluster or run directory is made."""
    (tmp_path / "taken").mkdir()
    for args, says in (
        (["--run-id", "fresh", "runner.max_step=3"], "did you mean 'runner.max_steps'?"),
        (["--run-id", "taken"], "already exists"),
        (["--run-id", "fresh", "actor.model.model_path=/nowhere"], "'/nowhere': the model dir"),
    ):
        started = time.monotonic()
        done = subprocess.run(
            [*CLI, "demo", "--output-root", str(tmp_path), *args],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert time.monotonic() - started < 30
        assert done.returncode == 2, done.stderr
        assert says in done.stderr, done.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_cluster_with_fewer_nodes_than_asked_is_refused(cluster_2x2, config_file, tmp_path):
    done = subprocess.run(
        [*CLI, "run", "--config", str(config_file), "cluster.num_nodes=3"],
        env=driver_env(cluster_2x2.address, tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3
    assert "Ray finds 2 alive node(s) but cluster.num_nodes=3" in done.stderr
    assert list(tmp_path.iterdir()) == []


def live_placement_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def test_preflight_command_passes_and_fails_with_the_tutorial_lines(cluster_2x2, config_file):
    env = dict(os.environ, RAY_ADDRESS=cluster_2x2.address)
    passed = subprocess.run(
        [*CLI, "preflight", "--config", str(config_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert passed.returncode == 0, passed.stderr
    out = passed.stdout.splitlines()
    for prefix in STATUS_PREFIXES[:6]:
        assert any(line.startswith(prefix) for line in out), (prefix, out)
    assert out[-1] == "STARTUP_EXIT_CODE=0"
    failed = subprocess.run(
        [*CLI, "preflight", "--config", str(config_file)]
        + ["cluster.preflight.required_modules=[torch,no_such_module_here]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert failed.returncode == 1
    status = [line for line in failed.stdout.splitlines() if "RLINF_PREFLIGHT_STATUS" in line]
    assert status and "failed" in status[0] and "no_such_module_here" in status[0]
    assert failed.stdout.splitlines()[-1] == "STARTUP_EXIT_CODE=1"
    deadline = time.monotonic() + 30
    while live_placement_groups() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_placement_groups() == []


def test_an_error_on_one_line_reads_as_one_sentence():
    text = "the request has 2 problems:\n  - RUN_ID is bad\n  - the data is empty"
    assert one_line(text) == "the request has 2 problems: RUN_ID is bad; the data is empty"
    assert one_line("a\n\nb") == "a; b"


def test_progress_line_shows_step_reward_loss_and_time():
    status = {
        "state": "running",
        "phase": "step 3",
        "steps_done": 2,
        "step": 3,
        "total_steps": 10,
        "max_steps": 10,
        "metrics_step": 2,
        "elapsed_s": 83.2,
        "metrics": {
            "rollout/reward_scores": -4.375,
            "actor/training/actor/final_loss": 0.0121,
            "time/step": 0.45,
        },
    }
    assert progress_line(status) == (
        "2/10 steps done | step 3 | reward -4.375 | loss 0.0121 | step 0.45s | 1m23s"
    )


def test_every_command_says_what_it_does_and_each_argument_its_default():
    """Each subcommand has a description; each argument a help text; each option that has a
    default (or takes one from elsewhere) says so; the run directory is RUN_DIR everywhere;
    `run --help` names the Driver's environment; --version answers."""
    import argparse

    from rlinf_twoworker.api.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) >= {"run", "demo", "verify", "readback", "export-hf", "report"}
    for name, sub in commands.choices.items():
        assert sub.description, f"{name} has no description"
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            where = f"{name} {action.dest}"
            assert action.help, f"{where} has no help text"
            if action.option_strings and not action.required and action.nargs != 0:
                assert "default" in action.help, f"{where} does not say its default"
            if action.dest == "run_dir":
                assert action.metavar == "RUN_DIR", where
    run_help = commands.choices["run"].format_help()
    assert all(var in run_help for var in ("RUN_ID", "WORK_ROOT", "TARGET_STEPS"))
    done = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("rlinf-twoworker ")


def test_a_read_command_reports_its_error_on_stderr_and_its_status_on_stdout(tmp_path):
    done = subprocess.run(
        [*CLI, "readback", str(tmp_path / "no-such-run")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stdout.startswith("READBACK_STATUS=failed error="), done.stdout
    errors = [line for line in done.stderr.splitlines() if line.startswith("RLINF_ERROR=")]
    assert len(errors) == 1 and "no-such-run" in errors[0], done.stderr
