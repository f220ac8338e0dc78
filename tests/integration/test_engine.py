"""The whole job through `run_grpo_two_worker` on a real 2-node Ray cluster (CPU, gloo)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file
from support import KEPT, ONE_RANK
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rlinf_twoworker import RunCancelledError, TwoWorkerError, run_grpo_two_worker
from rlinf_twoworker.api.demo import demo_config
from rlinf_twoworker.cluster.placement import bundle_node_ids
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.storage.data import load_jsonl
from rlinf_twoworker.storage.verify import verify_run
from rlinf_twoworker.workers.rollout import RolloutWorker

# Classes injected into a run (component_classes) travel by value: the workers cannot import
# this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TAGS = (
    "rollout/reward_scores",
    "actor/training/actor/final_loss",
    "actor/training/actor/grad_norm",
    "actor/training/actor/lr",
)
TIMEOUT = 300
EARLY_PHASES = (
    "starting",
    "placement",
    "preflight",
    "loading data",
    "memory plan",
    "loading components",
)


@pytest.fixture(scope="module")
def inputs(finished_inputs):
    return finished_inputs


def live_placement_groups() -> list[dict]:
    return [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]


def wait_no_placement_groups(timeout: float = 30) -> list[dict]:
    deadline = time.monotonic() + timeout
    while live_placement_groups() and time.monotonic() < deadline:
        time.sleep(0.2)
    return live_placement_groups()


def test_two_step_run_end_to_end(reference_run, inputs, tmp_path):
    """The session's reference run (conftest.py), started and awaited as a user would."""
    cfg, handle, (step1, step2) = reference_run.cfg, reference_run.handle, reference_run.steps
    ckpt, run_dir = reference_run.checkpoint, reference_run.run_dir
    assert step1.finished_at <= step2.finished_at <= ckpt.finished_at
    # Weight sync checked bit for bit after every step (rollout.validate_weight).
    assert step1.metrics["sync/verified"] == 1.0 and step2.metrics["sync/verified"] == 1.0
    topology = handle.topology()
    bundle_nodes = bundle_node_ids(handle.placement_group)
    assert {(r["component"], r["rank"]) for r in topology} == {
        ("rollout", 0),
        ("reward", 0),
        ("inference", 0),
        ("actor", 0),
        ("actor", 1),
    }
    for row in topology:
        assert row["node_id"] == bundle_nodes[row["bundle"]], row
    assert bundle_nodes[0] == ray.get_runtime_context().get_node_id()
    gpus = {r["component"]: r["gpu_ids"] for r in topology if r["rank"] == 0}
    assert gpus["rollout"] == gpus["reward"] != gpus["inference"]
    actor_gpus = [r["gpu_ids"] for r in topology if r["component"] == "actor"]
    assert actor_gpus[0] != actor_gpus[1]

    # Every component process's memory, every step (host memory here: a CPU run).
    for step in (step1, step2):
        for row in topology:
            prefix = f"memory/{row['component']}/{row['rank']}/"
            rss, peak = (
                step.metrics[prefix + "host_rss_gib"],
                step.metrics[prefix + "host_peak_rss_gib"],
            )
            assert 0.01 < rss <= peak < 64, (prefix, rss, peak)
            assert prefix + "gpu_peak_allocated_gib" not in step.metrics  # no GPU to report
    assert (
        step2.metrics["memory/actor/1/host_rss_gib"] > step2.metrics["memory/reward/0/host_rss_gib"]
    )

    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    assert handle.done() and handle.status()["state"] == "succeeded"
    # The same report as a Ray future (what an asyncio program awaits).
    assert ray.get(handle.result_ref(), timeout=TIMEOUT).errors == report.errors
    # The run's record of where it placed everything: each process as topology() answers,
    # each component as the tutorial's placement resolves, and the postflight reports that.
    record = json.loads((run_dir / "placement.json").read_text())
    assert record["processes"] == topology
    assert record["components"]["actor"] == {"spec": "2-3", "resource_ranks": [2, 3], "nodes": [1]}
    assert record["components"]["reward"]["resource_ranks"] == [0]
    assert report.placement == record["components"]
    assert "memory/actor/0/host_rss_gib" in handle.status()["metrics"]
    # The postflight keeps each process's peak over the run.
    assert set(report.memory_peaks) == {k for k in step2.metrics if k.startswith("memory/")}
    for tag, peak in report.memory_peaks.items():
        assert peak == pytest.approx(max(step1.metrics[tag], step2.metrics[tag]), rel=1e-6), tag
    # The memory plan of every GPU-holding process, estimated before the start, beside them
    # (the reward grades on CPUs: no estimate).
    assert set(report.memory_estimates) == {
        f"memory/{r['component']}/{r['rank']}/plan_estimate_gib"
        for r in topology
        if r["component"] != "reward"
    }
    assert all(0 < v < 1 for v in report.memory_estimates.values())  # a tiny model, no budget
    plan_lines = [
        line
        for line in (run_dir / "log" / "main.log").read_text().splitlines()
        if "MEMORY_PLAN node" in line
    ]
    assert len(plan_lines) == 4 and all(
        "planned: no GPU budget known, so nothing is checked" in x for x in plan_lines
    )
    # The share of the step's batches that is real tokens; under 0.6 at step 2 (the tiny
    # model's short answers) with the length-aware cut off, main.log says once that the cut
    # would skip the rest; with it on it says nothing.
    share = step2.metrics["throughput/real_token_share"]
    assert 0 < step1.metrics["throughput/real_token_share"] <= 1 and 0 < share <= 1
    hints = (run_dir / "log" / "main.log").read_text().count("PERF_HINT step 2: real tokens")
    assert hints == (1 if share < 0.6 and cfg.runner.trim_padding_multiple == 0 else 0)
    for rel in (
        "driver.log",
        "preflight.json",
        "hydra/.hydra/config.yaml",
        "hydra/.hydra/overrides.yaml",
        "log/main.log",
        "verification.json",
        "checkpoints/global_step_2/actor/dcp_checkpoint/.metadata",
        "checkpoints/global_step_2/data/data.pt",
    ):
        assert (run_dir / rel).is_file(), rel
    # two ranks, each writing its shard as runner.checkpoint_write_threads files at once
    shards = (run_dir / "checkpoints/global_step_2/actor/dcp_checkpoint").glob("*.distcp")
    threads = cfg.runner.checkpoint_write_threads
    assert sorted(p.name for p in shards) == sorted(
        f"__{rank}_{i}.distcp" for rank in (0, 1) for i in range(threads)
    )
    assert report.actor_fsdp_shards == 2
    assert verify_run(run_dir, 2, 2, write=False).passed
    assert (
        "Step limit given by max_steps=2 reached. Stopping run"
        in (run_dir / "log/main.log").read_text()
    )

    # Every step's answers, one line each (runner.rollout_dump, on by default): the step's
    # prompts in the sampler's order, group_size contiguous answers a prompt, the rewards
    # those the step logged.
    typed = to_typed(cfg)
    size = typed.algorithm.group_size
    rows = typed.data.rollout_batch_size * size
    data = typed.data
    samples = load_jsonl(data.train_data_paths, data.prompt_key, data.answer_key)
    for step in (step1, step2):
        lines = (run_dir / "rollouts" / f"step_{step.step}.jsonl").read_text().splitlines()
        answers = [json.loads(line) for line in lines]
        assert len(answers) == rows
        assert set(answers[0]) == {
            "step", "data_index", "query_id", "prompt", "answer",
            "reward", "advantage", "length", "ended",
        }  # fmt: skip
        assert {a["step"] for a in answers} == {step.step}
        for a in answers:
            assert a["prompt"] == samples[a["data_index"]].prompt
            assert a["ended"] == (a["length"] < typed.max_new_tokens)
        groups = [answers[g : g + size] for g in range(0, rows, size)]
        assert all(len({a["data_index"] for a in g}) == 1 for g in groups)
        mean = sum(a["reward"] for a in answers) / rows
        assert mean == pytest.approx(step.metrics["rollout/reward_scores"], abs=1e-6)
        for g in groups:  # group-relative: a better reward never gets a lower advantage
            for a in g:
                for b in g:
                    if a["reward"] > b["reward"]:
                        assert a["advantage"] > b["advantage"], g
                    if a["reward"] == b["reward"]:
                        assert a["advantage"] == pytest.approx(b["advantage"], abs=1e-5), g

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for tag in TAGS:
        values = events.Scalars(tag)
        assert [v.step for v in values] == [1, 2], tag
        assert all(math.isfinite(v.value) for v in values), tag
    # RLinf's layout beside them (storage/rlinf_scalars.py): step 1 only (RLinf never logs the
    # last step), its time and rollout tags at x = 0, the actor's of minibatch i at x = i.
    n_mb = typed.algorithm.n_minibatches
    assert len(step1.minibatches) == n_mb
    rlinf = EventAccumulator(str(run_dir / "tensorboard" / "rlinf"), size_guidance={"scalars": 0})
    rlinf.Reload()
    reward = rlinf.Scalars("rollout/reward_scores")
    assert [e.step for e in reward] == [0]
    assert reward[0].value == pytest.approx(step1.metrics["rollout/reward_scores"], abs=1e-6)
    assert [e.step for e in rlinf.Scalars("time/actor/inference")] == [0]
    ratios = rlinf.Scalars("actor/training/actor/ratio")
    assert [e.step for e in ratios] == list(range(n_mb))
    mean = sum(e.value for e in ratios) / n_mb
    assert mean == pytest.approx(step1.metrics["actor/training/actor/ratio_mean"], rel=1e-5)
    assert wait_no_placement_groups() == []

    # The checkpoint loads in a fresh process with plain DCP, and training changed the weights.
    out = tmp_path / "loaded.pt"
    script = (
        "import sys, torch\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, ckpt.directory + "/actor/dcp_checkpoint", str(out)],
        check=True,
        timeout=120,
    )
    loaded = torch.load(out, weights_only=False)["fsdp_checkpoint"]
    initial = load_file(str(Path(inputs.model_path) / "model.safetensors"))
    model = loaded["model"]
    assert set(initial) <= set(model)
    assert any(not torch.equal(initial[k], model[k]) for k in initial)
    assert "optimizers" in loaded and "lr_schedulers" in loaded and "rng" in loaded


def test_cancel_makes_pending_futures_raise_and_frees_the_cluster(cluster_2x2, inputs, tmp_path):
    cfg = demo_config(
        inputs, tmp_path, "cancelled", [*ONE_RANK, "runner.max_steps=50", "runner.save_interval=20"]
    )
    handle = run_grpo_two_worker(cfg)
    # An unscheduled checkpoint or a step outside the run raises at once; the last step is
    # always saved.
    with pytest.raises(ValueError, match="no checkpoint is scheduled at step 1"):
        handle.checkpoint(1)
    with pytest.raises(ValueError, match="outside"):
        handle.step(51)
    assert handle.checkpoint(40) is not None and handle.checkpoint(50) is not None
    early = handle.status()
    assert early["steps_done"] == 0 and early["phase"] in EARLY_PHASES, early
    if early["phase"] != "loading components":  # components not started: topology says so
        with pytest.raises(TwoWorkerError, match="has no components yet"):
            handle.topology()
    first = ray.get(handle.step(1), timeout=TIMEOUT)
    status = handle.status()
    assert status["steps_done"] >= 1 and status["metrics_step"] == status["steps_done"]
    # The start-up, phase by phase: in the first step's result, status() and log/main.log.
    phases = {"connect", "placement", "component_start", "preflight", "data", "components"}
    phases |= {"process_groups", "controller_imports"}
    phases |= {"actor_build", "weight_sync", "ready", "first_step", "to_first_step"}
    phases |= {f"load/{c}:{r}" for c, r in [("rollout", 0), ("inference", 0), ("actor", 0)]}
    phases |= {"grader_start/reward:0", "preflight/node0/manifests", "preflight/collective"}
    processes = ["rollout:0", "reward:0", "inference:0", "actor:0"]  # one rank: ONE_RANK
    phases |= {f"{part}/{who}" for part in ("spawn", "init") for who in processes}
    phases |= {f"import_ahead/{who}" for who in processes if who != "reward:0"}  # models' only
    assert phases <= set(first.startup), first.startup
    assert all(seconds >= 0 for seconds in first.startup.values())
    seen = first.startup
    # The processes start beside the preflight: every one has answered within component_start,
    # which lies inside the preflight; the constructors (the model loads) come after it.
    assert seen["component_start"] <= seen["preflight"]
    for who in processes:
        assert seen[f"spawn/{who}"] <= seen["component_start"] + 0.1, who
        assert seen[f"init/{who}"] <= seen["components"] + 0.1, who
        # the spawn in parts (Ray's worker pool, the interpreter, the imports) adds up to it
        parts = [seen[f"{part}/{who}"] for part in ("process", "worker_boot", "imports")]
        assert sum(parts) == pytest.approx(seen[f"spawn/{who}"], abs=0.01), (who, parts)
        assert seen[f"imports/{who}"] > 0, who  # its worker module's imports
    assert first.startup["tokenizer/rollout:0"] > 0 and "engine/rollout:0" in first.startup
    for who in ["rollout:0", "inference:0", "actor:0"]:
        assert first.startup[f"load/{who}"] <= first.startup[f"init/{who}"], who
    assert first.startup["to_first_step"] >= first.startup["ready"] >= first.startup["components"]
    assert phases <= set(handle.startup()) and "startup" not in status
    assert ray.get(handle.step(2), timeout=TIMEOUT).startup == {}  # the first step's only
    log = (tmp_path / "cancelled" / "log" / "main.log").read_text()
    for phase in phases:
        assert f"STARTUP {phase} " in log, phase
    assert "rollout/reward_scores" in status["metrics"]
    assert "run_id='cancelled'" in repr(handle) and "steps_done=" in repr(handle)
    # A Driver polling handle.step(n) costs the controller one waiting call per step, not one
    # per poll (its calls share max_concurrency slots with status() and cancel()): after
    # 10,000 polls of a step minutes away, status() answers within 1 s, cancel() within 10 s.
    for _ in range(10_000):
        ready, _ = ray.wait([handle.step(50)], timeout=0)
        assert not ready
    pending = handle.step(50)
    started = time.monotonic()
    status = handle.status()
    assert time.monotonic() - started < 1.0 and status["state"] == "running", status
    started = time.monotonic()
    handle.cancel()
    assert time.monotonic() - started < 10.0
    with pytest.raises(RunCancelledError):
        try:
            ray.get(pending, timeout=60)
        except ray.exceptions.RayTaskError as exc:
            raise exc.cause from None
    with pytest.raises(RunCancelledError):
        handle.result(timeout=60)
    assert time.monotonic() - started < 60
    # Every waiter gets an error of its own: none carries another waiter's frames, and asking
    # again does not make it longer.
    texts = []
    for ref in (handle.step(40), handle.checkpoint(50), handle.step(45), handle.step(40)):
        with pytest.raises(ray.exceptions.RayTaskError) as info:
            ray.get(ref, timeout=60)
        texts.append(str(info.value))
    assert all("wait_result" not in t and "wait_checkpoint" not in t for t in texts[::2])
    assert len(texts[3].splitlines()) == len(texts[0].splitlines()) < 40
    assert handle.status()["phase"] == "cancelled"
    assert wait_no_placement_groups() == []
    assert json.loads((tmp_path / "cancelled" / "failure.json").read_text())["state"] == "cancelled"
    report = verify_run(tmp_path / "cancelled", 2, 2, log=lambda _: None, write=False)
    assert any("records the run cancelled: RunCancelledError" in e for e in report.errors)


class CorruptingRollout(RolloutWorker):
    """A rollout whose received weights are off by a little: the weight check must catch it."""

    def receive_weights(self, sync_dtype: str) -> dict[str, float]:
        result = super().receive_weights(sync_dtype)
        with torch.no_grad():
            next(self.model.parameters()).add_(1e-3)
        return result


def test_broken_weight_sync_fails_the_run_naming_the_rollout(cluster_2x2, inputs, tmp_path):
    from rlinf_twoworker import ComponentError

    cfg = demo_config(inputs, tmp_path, "badsync", [*ONE_RANK, "rollout.validate_weight=true"])
    handle = run_grpo_two_worker(cfg, component_classes={"rollout": CorruptingRollout})
    with pytest.raises(ComponentError, match="rollout rank 0 .*weights differ"):
        handle.result(timeout=TIMEOUT)
    assert wait_no_placement_groups() == []


def test_policy_learns_to_answer_seven(cluster_2x2, inputs, tmp_path):
    """A random policy sometimes answers '7' (reward +5); GRPO must make that the habit.
    A sign error in the loss drives the reward down instead, and this test fails."""
    steps = 14
    cfg = demo_config(
        inputs,
        tmp_path,
        "learn",
        [
            *ONE_RANK,  # the learning, not the ranks: the reference run has two
            *KEPT,  # its processes then serve the dynamic-batch runs (the same placement)
            f"runner.max_steps={steps}",
            f"runner.save_interval={steps}",
            "algorithm.sampling_params.max_new_tokens=1",
            "algorithm.group_size=8",
            "data.rollout_batch_size=8",
            "algorithm.n_minibatches=2",
            "actor.optim.lr=3e-3",
            "algorithm.training_batch_size_per_gpu=8",
            "algorithm.logprob_forward_micro_batch_size=64",
            "actor.optim.weight_decay=0.0",
        ],
    )
    handle = run_grpo_two_worker(cfg)
    report = handle.result(timeout=600)
    assert report.passed, report.errors
    rewards = [
        ray.get(handle.step(n), timeout=30).metrics["rollout/reward_scores"]
        for n in range(1, steps + 1)
    ]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 3.0, rewards


def _final_weights(run_dir: Path, step: int, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(str(run_dir / f"checkpoints/global_step_{step}/actor/dcp_checkpoint"), out)
    return torch.load(out, weights_only=False)["fsdp_checkpoint"]["model"]


def test_dynamic_batch_size_gives_the_same_update(cluster_2x2, inputs, tmp_path):
    """Token-budget micro-batches change how rows are grouped, never the update itself."""
    common = [
        *ONE_RANK,  # how one rank cuts its rows; the ranks' split is the reference run's
        *KEPT,  # the learning run's processes, then the first run's for the second
        "runner.max_steps=1",
        "runner.save_interval=1",
        "actor.optim.lr=1e-3",
        "algorithm.n_minibatches=2",
    ]
    runs = {
        "fixed": [*common, "runner.micro_batch_tokens=0"],  # RLinf's 1-row cut
        "dynamic": [
            *common,
            "runner.enable_dynamic_batch_size=true",
            "runner.max_tokens_per_mbs=400",
            "runner.save_full_weights=true",
        ],
    }
    weights = {}
    for name, overrides in runs.items():
        handle = run_grpo_two_worker(demo_config(inputs, tmp_path, name, overrides))
        assert handle.result(timeout=TIMEOUT).passed
        weights[name] = _final_weights(tmp_path / name, 1, tmp_path)
    initial = load_file(str(Path(inputs.model_path) / "model.safetensors"))
    moved = 0
    for key, value in weights["fixed"].items():
        torch.testing.assert_close(weights["dynamic"][key], value, rtol=1e-5, atol=1e-6)
        moved += int(key in initial and not torch.equal(initial[key], value))
    assert moved > 0
    # runner.save_full_weights: a Hugging Face copy of the checkpoint that transformers loads.
    from transformers import AutoModelForCausalLM

    hf_dir = tmp_path / "dynamic/checkpoints/global_step_1/actor/huggingface"
    exported = AutoModelForCausalLM.from_pretrained(hf_dir).state_dict()
    for key, value in weights["dynamic"].items():
        assert torch.equal(exported[key], value), key
    assert not (tmp_path / "fixed/checkpoints/global_step_1/actor/huggingface").exists()


def test_two_nodes_one_gpu_each_with_inference_beside_the_actor(cluster_2x2, inputs, tmp_path):
    """The topology of the two-GPU benchmark (one GPU a node; the session's nodes have two,
    the run asks for one of each): the actor's weights cross the node boundary to the rollout
    and fan out back to the inference component on the actor's node; the weight check
    (digests of every copy) passes after each sync, and the postflight passes. Padding
    trimming is on (multiples of 8 columns), so its path runs in a real update."""
    placement = "{rollout:0,reward:0,inference:1,actor:1}"
    overrides = [
        "cluster.num_gpus_per_node=1",
        f"cluster.component_placement={placement}",
        "rollout.validate_weight=true",
        "runner.trim_padding_multiple=8",
    ]
    handle = run_grpo_two_worker(demo_config(inputs, tmp_path, "two-by-one", overrides))
    steps = [ray.get(handle.step(n), timeout=TIMEOUT) for n in (1, 2)]
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    driver = ray.get_runtime_context().get_node_id()
    topology = handle.topology()
    nodes = {p["component"]: p["node_id"] for p in topology}
    assert nodes["rollout"] == nodes["reward"] == driver
    assert nodes["inference"] == nodes["actor"] != driver
    assert len({p["bundle"] for p in topology}) == 2
    assert all(s.metrics["sync/bytes"] > 0 for s in steps)


def test_a_kl_term_runs_against_a_frozen_reference_policy(cluster_2x2, inputs, tmp_path):
    """algorithm.kl_beta > 0 adds the reference component (the actor's initial weights,
    never synced), placed where cluster.component_placement.reference says; its KL term is 0
    while the policy still equals it and grows once the policy moves."""
    cfg = demo_config(
        inputs,
        tmp_path,
        "kl",
        [
            *ONE_RANK,
            "algorithm.kl_beta=0.1",
            "actor.optim.lr=1e-3",
            "cluster.component_placement.reference=3",
            "+runner.per_worker_log=true",
        ],
    )
    handle = run_grpo_two_worker(cfg)
    steps = [ray.get(handle.step(n), timeout=TIMEOUT) for n in (1, 2)]
    where = {(r["component"], r["rank"]): r for r in handle.topology()}
    assert where[("reference", 0)]["resource_rank"] == 3
    assert where[("reference", 0)]["bundle"] == 1
    kl = [s.metrics["actor/training/actor/kl_loss"] for s in steps]
    assert 0.0 <= kl[0] < kl[1] and all(math.isfinite(k) for k in kl)
    assert "time/reference" in steps[0].timings
    report = handle.result(timeout=TIMEOUT)
    assert report.passed, report.errors
    # runner.per_worker_log: every process, the reference and the reward included, also logs
    # to a file of its own (each process's host attaches it).
    for component, rank in where:
        log = tmp_path / "kl" / "log" / f"{component}-{rank}.log"
        assert f"{component} rank {rank} logs to {log}" in log.read_text(), log
