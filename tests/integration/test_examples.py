"""Every script in examples/ runs, as a user would start it, and does what its docstring says."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from support import EXAMPLES, ONE_RANK

from rlinf_twoworker.results import STEP_STAGES

TIMEOUT = 600


def run_example(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_driver_starts_its_own_local_cluster_and_trains(tmp_path):
    done = run_example(
        "driver.py", "--local", "--output-root", str(tmp_path), *ONE_RANK, cwd=tmp_path
    )  # ONE_RANK: an override the example passes on; its subject is not the actor's ranks
    out = done.stdout.splitlines()
    assert any(line.startswith("step 1/2: reward ") for line in out), out
    assert any(line.startswith("step 2/2: reward ") for line in out), out
    assert "postflight: passed" in out
    runs = [p for p in tmp_path.iterdir() if p.name.startswith("driver-")]
    assert len(runs) == 1 and (runs[0] / "verification.json").is_file()


@pytest.mark.slow
def test_embed_example_feeds_step_futures_to_its_own_tasks(cluster_2x2, tmp_path):
    done = run_example(
        "embed_in_ray_program.py",
        "--demo",
        "--address",
        cluster_2x2.address,
        "--output-root",
        str(tmp_path),
        *ONE_RANK,  # an override the example passes on: its subject is not the actor's ranks
        cwd=tmp_path,
    )
    out = done.stdout.splitlines()
    summaries = [line for line in out if line.startswith("EMBED_SUMMARY ")]
    assert len(summaries) == 2 and "'step': 1" in summaries[0] and "'step': 2" in summaries[1]
    for line in summaries:  # the slowest of the step's stages, not a moment (time/at/...)
        summary = ast.literal_eval(line.removeprefix("EMBED_SUMMARY "))
        assert summary["slowest_stage"] in STEP_STAGES and 0 < summary["slowest_stage_share"] <= 1
    assert any(line.startswith("EMBED_TREND reward_change=") for line in out)
    shard_bytes = next(line for line in out if line.startswith("EMBED_CHECKPOINT shard_bytes="))
    assert int(shard_bytes.split("=")[1]) > 0
    assert "postflight: passed" in out


def _text(cell) -> str:
    """Everything a cell printed or displayed, as text (HTML included)."""
    parts = []
    for output in cell.get("outputs", []):
        parts.append(output.get("text", ""))
        data = output.get("data", {})
        parts += [data.get("text/html", ""), data.get("text/plain", "")]
    return "".join(p if isinstance(p, str) else "".join(p) for p in parts)


def test_the_notebook_runs_on_a_local_kernel(tmp_path):
    """examples/notebook.ipynb, executed cell by cell on a real Jupyter kernel (nbclient): a
    demo run watched step by step, its rewards plotted, its checkpoint awaited, its handle
    shown as HTML, and a second run cancelled."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(EXAMPLES / "notebook.ipynb", as_version=4)
    client = NotebookClient(
        notebook, timeout=TIMEOUT, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    )
    client.execute()
    code = [c for c in notebook.cells if c.cell_type == "code"]
    shown = _text(code[1])
    assert "<table><caption>RunHandle</caption>" in shown and "notebook-demo" in shown
    steps = [line for line in _text(code[2]).splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2", "step 3"]
    assert any("image/png" in o.get("data", {}) for o in code[3].outputs)  # the reward plot
    assert "global_step_3" in _text(code[4]) and ".distcp" in _text(code[4])
    final = _text(code[5])
    assert "succeeded" in final and "3 of 3" in final and "checkpoints</th><td" in final
    assert "cancelled" in _text(code[6])
    run_dir = tmp_path / "notebook-work/runs/notebook-demo"
    assert (run_dir / "verification.json").is_file()


@pytest.mark.slow
def test_the_readmes_python_example_runs_as_written(cluster_2x2, tmp_path, monkeypatch):
    """The README's first Python block, executed verbatim in a directory holding a grpo.yaml
    (the demo's model and data, runner.output_dir in it) on the session's 2x2 LocalCluster."""
    from omegaconf import OmegaConf

    from rlinf_twoworker.api.demo import demo_config, make_inputs

    readme = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8")
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert 'load_config("grpo.yaml"' in block and "handle.result()" in block
    inputs = make_inputs(tmp_path / "inputs")
    cfg = demo_config(inputs, tmp_path / "runs", "unused")
    OmegaConf.save(cfg, tmp_path / "grpo.yaml")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    report = scope["report"]
    assert report.passed, report.errors
    run_dir = tmp_path / "runs" / "my-run"
    assert (run_dir / "verification.json").is_file()
    assert (run_dir / "checkpoints" / "global_step_2").is_dir()
