"""The GPU benchmark's printed tables, from a results file the H200 run wrote (no GPU needed):
each figure lands in its row and column, and the warm-up is named by component."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = BENCH / "results" / "h200-s13-call2-startup-table.json"


@pytest.fixture(scope="module")
def bench_gpu():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_gpu

        yield bench_gpu
    finally:
        sys.path.remove(str(BENCH))


def rows(table: str) -> dict[str, list[str]]:
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = cells[1:]
    return out


def test_step1_table_names_each_warm_up_by_its_component(bench_gpu):
    results = json.loads(RESULTS.read_text())
    warm = results["startup"]["warm"]["startup_phases_s"]
    table = rows(bench_gpu.step1_table(results))
    assert set(table) == {"cold", "warm", "warm_preloaded"}
    cell = table["warm"][5]
    # The file's own figures, each after its component's name (not in name-sorted order only).
    assert cell == (
        f"actor:0 {warm['warm_up/actor:0']:.1f} / inference:0 {warm['warm_up/inference:0']:.1f}"
    )
    assert warm["warm_up/actor:0"] != warm["warm_up/inference:0"]  # the test can tell them apart


def test_time_to_result_table_rows_targets_and_trl(bench_gpu):
    results = json.loads(RESULTS.read_text())
    startup = results["startup"]
    table = rows(bench_gpu.time_to_result_table(results))
    cold = table["call to step 1, cold cache"]
    assert cold[0] == f"{startup['cold']['call_to_step1_s']:.1f}"
    assert cold[1] == "<= 60"
    assert cold[2] == f"{results['trl']['process_to_step1_s']:.1f}"
    assert cold[3] == f"{results['trl_no_ckpt']['process_to_step1_s']:.1f}"
    preloaded = table["call to step 1, warm cache, preloaded cluster (up 30 s before the call)"]
    assert preloaded[:2] == [f"{startup['warm_preloaded']['call_to_step1_s']:.1f}", "<= 25"]
    job = table["2-step job to verification, warm, cluster started with the call"]
    assert job[:2] == [f"{startup['warm']['job_to_verification_s']:.1f}", "<= 35"]
    assert job[2] == f"{results['trl']['process_to_step2_s']:.1f}"
    assert table["later step, defaults"][:2] == [f"{startup['warm']['step2_s']:.1f}", "<= 3"]
    # A run the file does not have gets no row (the preloading cluster called at its start).
    assert not [label for label in table if "preloading cluster" in label]
