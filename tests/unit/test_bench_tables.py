"""The GPU benchmark's printed tables, from a results file the H200 run wrote (no GPU needed):
each figure lands in its row and column, and the warm-up is named by component."""

from __future__ import annotations

import json
import sys
import time

import pytest
from support import BENCHMARKS

BENCH = BENCHMARKS
# The latest startup run with cold, warm and warm_preloaded runs and TRL both ways (session 15).
RESULTS = BENCH / "results" / "startup-cold+warm+warm_preloaded+trl+trl_no_ckpt-h200.json"


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


# -- the scale section (bench_scale.py, gpu_use.py): nvidia-smi parsing, figures, table ---------


@pytest.fixture(scope="module")
def scale():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_scale
        import gpu_use

        yield bench_scale, gpu_use
    finally:
        sys.path.remove(str(BENCH))


APPS = """\
4101, 44870
4102, 4301
4103, [N/A]

9999, 1024
No running processes found
garbage line
"""


def test_nvidia_smi_output_is_parsed_robustly(scale):
    _, gpu_use = scale
    apps = gpu_use.parse_apps(APPS)
    assert apps == {4101: 44870 / 1024, 4102: 4301 / 1024, 4103: None, 9999: 1.0}
    assert gpu_use.parse_apps("") == {} and gpu_use.parse_apps(None) == {}
    assert gpu_use.parse_apps("No running processes found\n") == {}
    assert gpu_use.parse_apps(" 7 , 512 MiB\n") == {7: 0.5}  # units and spaces tolerated
    assert gpu_use.parse_apps("7, 512\n7, 512\n") == {7: 1.0}  # one pid on two GPUs: summed
    assert gpu_use.parse_apps("7, [N/A]\n7, 512\n") == {7: 0.5}  # a figure beats none
    assert gpu_use.parse_used("81559\n") == 81559 / 1024
    assert gpu_use.parse_used("[N/A]\n") is None
    assert gpu_use.parse_used("") is None and gpu_use.parse_used(None) is None
    assert gpu_use.parse_used("\n 2048 \n") == 2.0


class CannedSmi:
    """nvidia-smi's two queries answered from a list of (apps text, gpu text), one pair a tick
    (the last repeated)."""

    def __init__(self, ticks):
        self.ticks, self.calls = ticks, []

    def __call__(self, query, gpu):
        self.calls.append((query, gpu))
        index = min(sum(1 for q, _ in self.calls if q == query) - 1, len(self.ticks) - 1)
        apps, used = self.ticks[index]
        return apps if "--query-compute-apps=pid,used_memory" in query else used


def test_sampler_keeps_each_pids_peak_and_the_gpus(scale):
    _, gpu_use = scale
    smi = CannedSmi(
        [
            ("", "1024\n"),  # before the run: 1 GiB in use (the Driver)
            ("4101, 2048\n4102, 1024\n", "4096\n"),
            ("4101, 8192\n4102, [N/A]\n4103, [N/A]\n", "10240\n"),
            ("4101, 4096\n4102, 3072\n", "None of this is a number\n"),
        ]
    )
    lineage = {  # 4103: the actor's child; 4102: a Ray worker of the Driver's (the probe)
        4103: ([4101, 77, 1], "python -m compile_worker"),
        4102: ([55, 77, 1], "ray::NodeProbe.run   "),
    }
    sampler = gpu_use.GpuUseSampler(
        gpu=3, interval_s=0.01, query=smi, describe=lambda pid: lineage.get(pid, ([], "?"))
    )
    with sampler:
        deadline = 200
        while len(sampler.samples) < 6 and deadline:
            import time

            time.sleep(0.01)
            deadline -= 1
    assert len(sampler.samples) >= 4
    assert {gpu for _, gpu in smi.calls} == {3}
    assert sampler.baseline_gib == 1.0
    assert sampler.peak_by_pid() == {4101: 8.0, 4102: 3.0}
    assert sampler.unreported_pids() == [4103]
    assert sampler.gpu_peak() == 10.0
    assert sampler.failed >= 1  # the tick whose GPU figure was not a number
    s = sampler.samples
    assert sampler.peak_by_pid(s[1].at, s[1].at) == {4101: 2.0, 4102: 1.0}  # a window
    names = gpu_use.pids_from_topology(
        [
            {"component": "actor", "rank": 0, "pid": 4101},
            {"component": "rollout", "rank": 0, "pid": 4102},
            {"component": "reward", "rank": 0, "pid": 0},  # unknown: left out
        ]
    )
    assert names == {4101: "actor:0", 4102: "rollout:0"}
    assert gpu_use.by_name({4101: 8.0, 9999: 1.0}, names) == {"actor:0": 8.0, "pid 9999": 1.0}
    assert sampler.commands[4103] == "python -m compile_worker"
    peaks = {4101: 8.0, 4102: 1.1, 4103: 1.1, 4104: 0.5}
    named = {4101: "actor:0", 77: "driver"}  # the Driver owns no child: all descend from it
    assert gpu_use.by_name(peaks, named, sampler.ancestors, sampler.commands) == {
        "actor:0": 8.0,
        "ray::NodeProbe.run 4102": 1.1,
        "actor:0 child 4103": 1.1,
        "pid 4104": 0.5,
    }


def test_pids_from_rays_actor_list(scale):
    _, gpu_use = scale

    class Actor:
        def __init__(self, name, pid, state="ALIVE"):
            self.name, self.pid, self.state = name, pid, state

    actors = [
        Actor("run-1a2b3c4d:actor:0", 11),
        {"name": "run-1a2b3c4d:inference:0", "pid": 12, "state": "ALIVE"},
        Actor("run-1a2b3c4d:controller:0", 13),  # not a component
        Actor("run-1a2b3c4d:rollout:0", 14, "DEAD"),
        Actor("other-00000000:actor:0", 15),  # another run
        Actor("", 16),
    ]
    assert gpu_use.pids_from_actors(actors, "run-1a2b3c4d") == {11: "actor:0", 12: "inference:0"}


def test_plan_and_budget_checks_name_the_process_and_both_numbers(scale, tmp_path):
    _, gpu_use = scale
    plan = {
        "gpus": [
            {
                "estimate_gib": 35.9,
                "processes": [
                    {"component": "actor", "rank": 0, "estimate_gib": 34.7},
                    {"component": "rollout", "rank": 0, "estimate_gib": 4.0},
                    {"component": "inference", "rank": 0, "estimate_gib": 4.5},
                ],
            }
        ]
    }
    (tmp_path / "memory_plan.json").write_text(json.dumps(plan))
    estimates = gpu_use.plan_estimates(tmp_path)
    assert estimates == {"actor:0": 34.7, "rollout:0": 4.0, "inference:0": 4.5}
    peaks = {"actor:0": 44.9, "rollout:0": 4.4, "driver": 0.5}  # rollout +10%: within
    problems = gpu_use.plan_problems(peaks, estimates, 0.10)
    assert len(problems) == 2
    assert problems[0].startswith("actor:0:") and "44.90" in problems[0] and "34.70" in problems[0]
    assert problems[1].startswith("inference:0:") and "no nvidia-smi figure" in problems[1]
    assert gpu_use.budget_problem(40.5, 0.6, 40) is None  # 39.9 GiB of the run's own
    over = gpu_use.budget_problem(52.3, 0.6, 40)
    assert "52.30" in over and "0.60" in over and "51.70" in over and "=40" in over
    assert "no figure" in gpu_use.budget_problem(None, 0.6, 40)


def test_growth_after_step_3(scale):
    bench_scale, gpu_use = scale
    assert gpu_use.grew({1: 9.0, 2: 5.0, 3: 5.0, 4: 5.1, 5: 5.05}) == pytest.approx(0.1)
    assert gpu_use.grew({1: 9.0, 2: 5.0, 3: 5.0, 4: 4.0}) == 0.0
    assert gpu_use.grew({1: 1.0, 2: 1.0, 3: 1.0}) == 0.0  # nothing after step 3
    steps = [
        {
            "step": n,
            "gpu_peak_gib": 50.0 + (n > 3) * 0.1,
            "gpu_peak_gib_by_process": {"actor:0": 44.0},
            "host_rss_gib": {"actor:0": 24.0 + n * (n > 3) * 0.2, "reward:0": 0.1},
        }
        for n in range(1, 7)
    ]
    e = bench_scale.endurance(steps)
    assert e["host_rss_grew"] and not e["gpu_grew"]
    assert e["host_rss_rise_gib"] == {"actor:0": pytest.approx(24.0 + 1.2 - 24.0), "reward:0": 0}
    assert e["gpu_rise_gib"] == {"actor:0": 0.0, "GPU": pytest.approx(0.1)}


def test_cold_cases_compile_on_empty_caches_of_their_own(scale, tmp_path):
    """--scale-cold: each case's Inductor, Triton and compile caches are its own and start
    empty (a stale one from an earlier call is cleared); without it every case shares them."""
    bench_scale, _ = scale
    shared = [bench_scale.case_caches(tmp_path, run, cold=False) for run in ("a", "b")]
    assert shared[0] == shared[1]
    stale = tmp_path / "cold" / "a" / "inductor" / "old.bin"
    stale.parent.mkdir(parents=True)
    stale.write_text("compiled before")
    cold = [bench_scale.case_caches(tmp_path, run, cold=True) for run in ("a", "b")]
    assert not stale.exists()
    assert set(cold[0]) == set(shared[0])
    for key in cold[0]:
        assert cold[0][key] != cold[1][key] != shared[0][key] != cold[0][key]
        assert tmp_path / "cold" in cold[0][key].parents


def test_cases_parse_and_load_as_configs(scale, tmp_path):
    bench_scale, _ = scale
    from rlinf_twoworker.config import load_config, to_typed

    assert bench_scale.parse_cases("all") == list(bench_scale.CASES)
    assert bench_scale.parse_cases("8x8@8192, memory40,8x8@8192") == ["8x8@8192", "memory40"]
    with pytest.raises(SystemExit, match="bogus"):
        bench_scale.parse_cases("32x8@2048,bogus")
    assert bench_scale.run_id_for("32x8@2048", 7) == "scale-32x8-2048-7"
    plumbing = [
        "cluster.num_nodes=1",
        "cluster.num_gpus_per_node=1",
        "cluster.component_placement={rollout:0,inference:0,actor:0,reward:0}",
        f"data.train_data_paths=[{tmp_path / 'data.jsonl'}]",
        "runner.experiment_name=" + bench_scale.run_id_for("8x8@8192", 7),
    ]
    shapes = {"32x8@2048": (256, 2048), "64x8@2048": (512, 2048), "8x8@8192": (64, 8192)}
    for name in bench_scale.CASES:
        typed = to_typed(load_config(overrides=[*plumbing, *bench_scale.case_overrides(name)]))
        rows = typed.data.rollout_batch_size * typed.algorithm.group_size
        if name in shapes:
            assert (rows, typed.runner.seq_length) == shapes[name]
            assert typed.max_new_tokens == typed.runner.seq_length - 256
            if bench_scale.reward_fn_supported():
                assert typed.reward.reward_fn == "bench_rewards:parity"
        else:  # the tutorial job: the library's defaults
            assert (rows, typed.runner.seq_length) == (16, 1024)
        assert typed.cluster.max_gpu_memory_gb == (40 if name == "memory40" else None)
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n" * 512)
    assert bench_scale._epochs_needed(data, 32, 3) == 1
    assert bench_scale._epochs_needed(data, 32, 30) == 2  # 16 steps an epoch
    assert bench_scale._epochs_needed(data, 64, 8) == 1


def test_parity_reward_splits_answers(scale):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_rewards
    finally:
        sys.path.remove(str(BENCH))
    assert bench_rewards.parity("p", "ab", {}) == 1.0
    assert bench_rewards.parity("p", "abc", {"solutions": []}) == 0.0
    assert isinstance(bench_rewards.parity("p", "", {}), float)


def test_param_count_reads_safetensors_headers(scale, tmp_path):
    bench_scale, _ = scale
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "m-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "m-2.safetensors"))
    assert bench_scale.param_count(tmp_path) == 12 + 5 + 8


class Step:
    """A StepResult's fields that the scale section reads."""

    def __init__(self, step, finished_at, seconds, response_length=1792.0, adv=1.0):
        self.step, self.finished_at = step, finished_at
        self.timings = {
            "time/step": seconds,
            "time/rollout": seconds / 2,
            "time/inference": 4.0,
            "time/actor/training": 10.0,
        }
        self.metrics = {
            "rollout/response_length": response_length,
            "rollout/advantages_max": adv,
            "rollout/advantages_min": -adv,
            "rollout/reward_scores": 0.5,
            "rollout/correct_fraction": 0.5,
            "actor/training/actor/grad_norm": 0.7 if adv else 0.0,
            "throughput/trained_tokens_per_s": 256 * response_length / 10.0,
            "memory/actor/0/host_rss_gib": 24.0 + step * 0.01,
            "memory/reward/0/host_rss_gib": 0.13,
        }


def test_scale_summary_and_table(scale, tmp_path):
    bench_scale, gpu_use = scale
    # Samples at t = 100..103: step 1 ends at 101.5, step 2 at 102.5, step 3 at 103.5.
    sampler = gpu_use.GpuUseSampler(query=lambda q, g: None)
    sampler.started_at, sampler.baseline_gib = 100.0, 0.5
    for t, actor, rollout, used in ((100, 30.0, 4.0, 35.0), (101, 44.0, 0.7, 45.5)):
        sampler.samples.append(gpu_use.Sample(t, used, {11: actor, 12: rollout, 99: 1.0}))
    for t, actor, rollout, used in ((102, 40.0, 4.2, 52.0), (103, 41.0, 4.1, 51.0)):
        sampler.samples.append(gpu_use.Sample(t, used, {11: actor, 12: rollout}))
    steps = [Step(1, 101.5, 40.0), Step(2, 102.5, 38.0), Step(3, 103.5, 39.0)]
    names = {11: "actor:0", 12: "rollout:0", 99: "driver"}
    n, peak = 1_777_088_000, 740.0
    case = bench_scale.summarise(steps, 256, n, peak, sampler, names)
    assert case["median_stage_s"]["time/step"] == 38.5  # steps 2..3
    assert case["steps_s"] == [40.0, 38.0, 39.0]
    assert case["first_step_stage_s"]["time/step"] == 40.0  # step 1 alone, by stage
    assert case["first_step_stage_s"]["time/rollout"] == 20.0
    tokens = 256 * 1792.0
    assert case["answer_tokens"] == tokens
    assert case["generated_tokens_per_s_per_gpu"] == pytest.approx(tokens / 19.25)
    assert case["inference_mfu"] == pytest.approx(2 * n * tokens / 4.0 / (peak * 1e12))
    assert case["actor_mfu"] == pytest.approx(6 * n * tokens / 10.0 / (peak * 1e12))
    assert case["updates"]["real"] is True
    assert case["nvidia_smi_peak_gib_by_process"] == {
        "actor:0": 44.0,
        "rollout:0": 4.2,
        "driver": 1.0,
    }
    assert case["gpu_peak_gib"] == 52.0 and case["gpu_baseline_gib"] == 0.5
    by_step = case["per_step"]
    assert [s["gpu_peak_gib"] for s in by_step] == [45.5, 52.0, 51.0]
    assert by_step[0]["gpu_peak_gib_by_process"] == {
        "actor:0": 44.0,
        "rollout:0": 4.0,
        "driver": 1.0,
    }
    assert by_step[2]["host_rss_gib"] == {"actor:0": 24.03, "reward:0": 0.13}
    # Each step's own stage seconds and answer length (a step's time is told apart by stage).
    assert [s["stage_s"]["rollout"] for s in by_step] == [20.0, 19.0, 19.5]
    assert by_step[1]["stage_s"] == {
        "step": 38.0,
        "rollout": 19.0,
        "inference": 4.0,
        "actor/training": 10.0,
    }
    assert [s["response_length"] for s in by_step] == [1792.0] * 3

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = {
        "settings": {"activation_checkpointing": False},
        "gpus": [
            {
                "estimate_gib": 45.0,
                "budget_gib": None,
                "processes": [
                    {"component": "actor", "rank": 0, "estimate_gib": 40.0},
                    {"component": "rollout", "rank": 0, "estimate_gib": 4.0},
                ],
            }
        ],
    }
    (run_dir / "memory_plan.json").write_text(json.dumps(plan))
    case.update(bench_scale._plan(run_dir, case["nvidia_smi_peak_gib_by_process"]))
    case["verification_passed"] = True
    assert case["plan_vs_nvidia_smi"][0] == {
        "process": "actor:0",
        "plan_estimate_gib": 40.0,
        "nvidia_smi_peak_gib": 44.0,
        "peak_over_plan": 1.1,
    }
    failed = {"case": "64x8@2048", "error": "TimeoutError: the case's time limit (750 s) ran out"}
    zero = bench_scale.summarise([Step(1, 1, 5.0, 768.0, 0.0)] * 2, 16, n, None, sampler, names)
    zero["endurance"] = bench_scale.endurance(zero["per_step"])  # 2 steps: not judged
    results = {"scale": {"cases": {"32x8@2048": case, "64x8@2048": failed, "tutorial": zero}}}
    table, *notes = bench_scale.scale_table(results).split("\n\n")
    cells = rows(table)
    assert list(cells) == ["32x8@2048", "64x8@2048", "tutorial"]
    assert cells["32x8@2048"] == [
        "38.50",
        "19.25",
        f"{tokens / 19.25:,.0f}",
        "4.00",
        f"{100 * 2 * n * tokens / 4.0 / (peak * 1e12):.1f}%",
        "10.00",
        f"{100 * 6 * n * tokens / 10.0 / (peak * 1e12):.1f}%",
        "actor:0 44.0 / 40.0 (+10%); rollout:0 4.2 / 4.0 (+5%)",
        "52.0 (0.5 before, plan 45.0)",
        "yes",
        "yes",
    ]
    assert cells["64x8@2048"][-2:] == ["error", "-"]
    assert cells["64x8@2048"][0] == "-"
    assert cells["tutorial"][4] == "-" and cells["tutorial"][-1] == "no"  # no bf16 rate: no MFU
    header = table.splitlines()[0]
    assert header.count("|") == 13
    assert len(notes) == 2
    assert notes[0].startswith("64x8@2048: TimeoutError")
    assert notes[1].startswith("endurance tutorial, 2 steps") and "too few steps" in notes[1]


def test_two_gpu_cases_sample_both_gpus_and_report_each(scale, bench_gpu, tmp_path):
    """--scale-topology 2gpu: a sampler per GPU read as one (a process's peak on its GPU, each
    GPU's own peak), the rollout's tokens/s per GPU over both, each GPU's plan in the table;
    and the 2-node placement loads as a valid config for every case."""
    bench_scale, gpu_use = scale
    from rlinf_twoworker.config import load_config, to_typed

    gpu0 = CannedSmi([("", "512\n"), ("11, 4096\n", "5120\n"), ("11, 6144\n", "7168\n")])
    gpu1 = CannedSmi([("", "1024\n"), ("12, 30720\n", "31744\n"), ("12, 40960\n", "[N/A]\n")])
    both = gpu_use.GpuUseSamplers(
        [
            gpu_use.GpuUseSampler(gpu=0, interval_s=0.01, query=gpu0, describe=lambda p: ([], "")),
            gpu_use.GpuUseSampler(gpu=1, interval_s=0.01, query=gpu1, describe=lambda p: ([], "")),
        ]
    )
    with both:
        for _ in range(300):
            if min(len(p.samples) for p in both.parts) >= 4:
                break
            time.sleep(0.01)
    assert {g for _, g in gpu0.calls} == {0} and {g for _, g in gpu1.calls} == {1}
    assert both.peak_by_pid() == {11: 6.0, 12: 40.0}
    assert both.gpu_peaks() == {0: 7.0, 1: 31.0}
    assert both.gpu_peak() == 31.0
    summary = both.summary()
    assert summary["gpu_peak_gib_by_gpu"] == {0: 7.0, 1: 31.0}
    assert summary["gpu_baseline_gib_by_gpu"] == {0: 0.5, 1: 1.0}
    assert summary["gpu_baseline_gib"] == 1.0 and summary["nvidia_smi_failures"] >= 1
    assert isinstance(gpu_use.sampler_for(1), gpu_use.GpuUseSampler)
    assert [p.gpu for p in gpu_use.sampler_for(2).parts] == [0, 1]

    end = max(s.at for p in both.parts for s in p.samples) + 1
    steps = [Step(1, end, 40.0), Step(2, end + 1, 20.0)]
    names = {11: "rollout:0", 12: "actor:0"}
    one = bench_scale.summarise(steps, 256, 1_777_088_000, None, both, names)
    case = bench_scale.summarise(steps, 256, 1_777_088_000, None, both, names, gpus=2)
    assert case["generated_tokens_per_s"] == one["generated_tokens_per_s_per_gpu"]
    assert case["generated_tokens_per_s_per_gpu"] == pytest.approx(
        one["generated_tokens_per_s_per_gpu"] / 2
    )
    assert case["nvidia_smi_peak_gib_by_process"] == {"rollout:0": 6.0, "actor:0": 40.0}
    assert case["per_step"][0]["gpu_peak_gib_by_gpu"] == {0: 7.0, 1: 31.0}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    plan = {
        "gpus": [
            {"resource_rank": r, "estimate_gib": est, "budget_gib": 139.0, "processes": [p]}
            for r, est, p in (
                (0, 8.0, {"component": "rollout", "rank": 0, "estimate_gib": 6.5}),
                (1, 45.0, {"component": "actor", "rank": 0, "estimate_gib": 41.0}),
            )
        ]
    }
    (run_dir / "memory_plan.json").write_text(json.dumps(plan))
    case.update(bench_scale._plan(run_dir, case["nvidia_smi_peak_gib_by_process"]))
    assert [g["estimate_gib"] for g in case["plan_gpus"]] == [8.0, 45.0]
    table = rows(bench_scale.scale_table({"scale": {"cases": {"32x8@2048": case}}}))
    assert table["32x8@2048"][8] == "GPU 0 7.0; GPU 1 31.0 (plan 8.0, 45.0)"

    data = tmp_path / "data.jsonl"
    for name in bench_scale.CASES:
        overrides = bench_gpu.job_overrides(tmp_path, data, tmp_path, "r", 2, topology="2gpu")
        typed = to_typed(load_config(overrides=[*overrides, *bench_scale.case_overrides(name)]))
        assert (typed.cluster.num_nodes, typed.cluster.num_gpus_per_node) == (2, 1)
    args = bench_gpu.parse_args(["--sections", "scale", "--scale-topology", "2gpu"])
    assert bench_gpu.result_key(args) == ("scale", "+".join(bench_scale.CASES) + "-2gpu")
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--sections", "scale", "--scale-topology", "4gpu"])


def test_grader_check_draws_the_same_pairs_and_counts_what_differs():
    """benchmarks/check_grader.py (the library's RLinf grader against RLinf's own code): a seed
    gives the same pairs, and a pair is a disagreement when the verdict or either extracted
    string differs; one that ran out of time on either side is counted, not compared."""
    sys.path.insert(0, str(BENCH))
    try:
        import check_grader
    finally:
        sys.path.remove(str(BENCH))
    drawn = check_grader.pairs(200, 5)
    assert drawn == check_grader.pairs(200, 5) != check_grader.pairs(200, 6)
    assert all(isinstance(a, str) and isinstance(s, str) for a, s in drawn)
    cases = [("\\boxed{1}", "1"), ("\\boxed{2}", "3"), ("\\boxed{x}", "x"), ("a", "b")]
    library = [(True, "1", "1"), (False, "2", "3"), (True, "x", "x"), None]
    reference = [(True, "1", "1"), (False, "2", "3"), (True, "x", "X"), (False, "", "b")]
    result = check_grader.compare(cases, library, reference)
    assert result["judged_by_both"] == 3 and result["timed_out"] == 1
    assert result["disagreements"] == 1 and result["rlinf_correct"] == 2
    assert result["disagreeing_pairs"][0]["rlinf"] == (True, "x", "X")
    assert [d["answer"] for d in result["timed_out_on_one_side"]] == ["a"]
