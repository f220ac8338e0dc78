"""bench_gpu.py's `scale` section: whole GRPO steps at real batch sizes (issue 32, item 4).

    python benchmarks/bench_gpu.py --sections scale [--scale-cases 32x8@2048,memory40]
        [--scale-steps 3] [--scale-endurance-steps 30] [--scale-case-limit-s 900]
        [--scale-override runner.micro_batch_tokens=16384 ...] [--scale-cold]
        [--scale-topology colocated|2gpu]

Each case is one run of `run_grpo_two_worker` on a LocalCluster of one node with one GPU, every
component on it (bench_gpu.TOPOLOGIES["colocated"]), or with --scale-topology 2gpu of 2 nodes
x 1 GPU: the rollout and reward on the first, inference and the actor on the second, the stages
pipelined (rollout results flow on to inference and the actor as they complete); the 1.5B shape
with random weights, the tutorial's data, a checkpoint at the last step (deleted after the
case: ~21 GB):
  PxG@S     data.rollout_batch_size=P, algorithm.group_size=G, runner.seq_length=S and
            reward.reward_fn=bench_rewards:parity; every other key the library's default
            (data.max_prompt_length 256, so answers of up to S - 256 tokens; 4 minibatches;
            rollout.max_batch_size 256 decode slots, more rows decode in waves; the memory plan
            picks recompute and offload). runner.max_epochs is raised where the 512 prompts
            run out before the last step.
  memory40  the tutorial job (the library's defaults) with cluster.max_gpu_memory_gb=40
  tutorial  the tutorial job, the library's defaults
--scale-override adds overrides to every case. The cases of a call, and the calls on one machine,
share their compiled code (Inductor's, Triton's and the library's compile caches under the
benchmark root), so a case's step 1 depends on what ran before it; --scale-cold gives each case
empty caches of its own, so step-1 figures compare across cases and calls.

The reward: random weights answer every prompt wrongly, so the math grader gives a group's
answers one score, every advantage is 0 and the update is not a real one. bench_rewards.parity
scores an answer by the parity of its length (about half of a group each way); benchmarks/ is
put on PYTHONPATH before the cluster starts, so the reward's grading processes import it. On a
commit whose config has no reward.reward_fn the PxG@S cases run with the default reward (the
case says so). memory40 and tutorial keep the default reward: they are the tutorial's job.

Per case: every stage's seconds (time/... of StepResult.timings, the median over steps 2..N,
and step 1's on their own);
generated tokens/s per GPU (answer tokens, rollout/response_length x rows, over the
rollout's seconds, over the job's GPUs); inference MFU, 2 x N x answer tokens over the log-prob
recompute's seconds, and actor MFU, 6 x N x trained (answer) tokens over the update's seconds,
N the model's parameters and the bf16 rate the one bench_gpu.py measured in the same call;
each component process's nvidia-smi peak (every 0.25 s, gpu_use.py) beside its memory-plan
estimate (memory_plan.json, the CUDA context included) and the whole GPU's (each GPU's with
2gpu); the advantages and the gradient norm (the updates were real); verification. Each
step's figures are kept too: the GPU's and each process's nvidia-smi peak during it and each
process's host RSS after it. With --scale-endurance-steps N the 32x8@2048 case runs N steps
and says whether host RSS or GPU memory grew after step 3.

A case that fails keeps its error and the figures of the steps it finished; the next case
runs. Each case has a time limit (--scale-case-limit-s; by default 300 s + 150 s a step).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gpu_use import (  # benchmarks/ is the script's path
    GpuUseSampler,
    GpuUseSamplers,
    by_name,
    component_pids,
    grew,
    name_of,
    plan_estimates,
    sampler_for,
    wait_released,
)

BENCH = Path(__file__).resolve().parent
CASES = ("32x8@2048", "64x8@2048", "8x8@8192", "memory40", "tutorial")
ENDURANCE_CASE = "32x8@2048"
REWARD_FN = "bench_rewards:parity"
BUDGET_40 = "cluster.max_gpu_memory_gb=40"
GROWTH_TOLERANCE_GIB = 0.25
"""A per-step figure that rises by at most this after step 3 has not grown."""
_SHAPE = re.compile(r"^(\d+)x(\d+)@(\d+)$")


def parse_cases(text: str) -> list[str]:
    """'all' or a comma list of CASES or PROMPTSxGROUP@SEQ names -> the names, in order."""
    names = list(CASES) if text.strip() in ("", "all") else [c.strip() for c in text.split(",")]
    for name in names:
        if name not in CASES and not _SHAPE.match(name):
            raise SystemExit(
                f"--scale-cases: unknown case {name!r}; give PROMPTSxGROUP@SEQ (32x8@2048) or "
                f"one of {', '.join(CASES)}"
            )
    return list(dict.fromkeys(names))  # once each


def case_overrides(name: str, reward_fn: bool = True) -> list[str]:
    """The case's own overrides (the run's plumbing aside)."""
    if name == "tutorial":
        return []
    if name == "memory40":
        return [BUDGET_40]
    match = _SHAPE.match(name)
    if not match:
        raise ValueError(f"unknown scale case {name!r}")
    prompts, group, seq = match.groups()
    out = [
        f"data.rollout_batch_size={prompts}",
        f"algorithm.group_size={group}",
        f"runner.seq_length={seq}",
    ]
    return out + ([f"reward.reward_fn={REWARD_FN}"] if reward_fn else [])


def reward_fn_supported() -> bool:
    """Whether this commit's config has reward.reward_fn."""
    import dataclasses

    from rlinf_twoworker.config.schema import RewardConfig

    return "reward_fn" in {f.name for f in dataclasses.fields(RewardConfig)}


def default_limit_s(steps: int) -> float:
    return 300.0 + 150.0 * steps


def run_id_for(name: str, stamp: int) -> str:
    """A RUN_ID for the case ('@' is not allowed in one)."""
    return f"scale-{name.replace('@', '-')}-{stamp}"


def param_count(model_dir: Path) -> int:
    """The model's parameters, from its safetensors files' headers (no tensor is read)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def _on_pythonpath(directory: Path) -> None:
    """Put `directory` first on PYTHONPATH: the cluster's processes, started after this,
    inherit it (the reward's grading processes too)."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(directory) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(directory), *paths])


def _epochs_needed(data_path: Path, prompts: int, steps: int) -> int:
    """runner.max_epochs for `steps` steps of `prompts` prompts (RLinf's loader drops the last
    incomplete batch of an epoch)."""
    with open(data_path, encoding="utf-8") as f:
        rows = sum(1 for line in f if line.strip())
    per_epoch = rows // prompts
    if per_epoch < 1:
        raise ValueError(f"{data_path} has {rows} prompts, fewer than a step's {prompts}")
    return math.ceil(steps / per_epoch)


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def _get(ref: Any, deadline: float, what: str, limit_s: float) -> Any:
    """ray.get within the case's time limit; the run's own error without Ray's wrapping."""
    import ray

    if time.monotonic() >= deadline:
        raise TimeoutError(f"the case's time limit ({limit_s:.0f} s) ran out before {what}")
    try:
        return ray.get(ref, timeout=_left(deadline))
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"the case's time limit ({limit_s:.0f} s) ran out in {what}") from None
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        raise (cause if isinstance(cause, BaseException) else exc) from None


def _cold_dir(root: Path, run_id: str) -> Path:
    return root / "cold" / run_id


def case_caches(root: Path, run_id: str, cold: bool) -> dict[str, Path]:
    """Where a case's compiled code is kept: Inductor's and Triton's caches (the node-local
    ones, through their environment variables) and the library's shared compile cache
    (runner.compile_cache_dir). Shared by every case and call under `root` unless `cold`:
    then directories of the case's own that start empty (and are removed after it), so its
    step 1 pays every compile and compares with another cold case's."""
    if cold:
        own = _cold_dir(root, run_id)
        shutil.rmtree(own, ignore_errors=True)
        return {
            "TORCHINDUCTOR_CACHE_DIR": own / "inductor",
            "TRITON_CACHE_DIR": own / "triton",
            "compile_cache": own / "compile-cache",
        }
    return {
        "TORCHINDUCTOR_CACHE_DIR": root / "node-scale" / "inductor",
        "TRITON_CACHE_DIR": root / "node-scale" / "triton",
        "compile_cache": root / "compile-cache-scale",
    }


def run_case(
    model_dir: Path,
    root: Path,
    name: str,
    steps: int,
    limit_s: float | None = None,
    peak_tflops: float | None = None,
    extra: Sequence[str] = (),
    stamp: int | None = None,
    cold: bool = False,
    topology: str = "colocated",
) -> dict[str, Any]:
    """One case (module docstring), its figures as a dict; never raises for the run's
    failures: they are kept under "error" beside the figures of the finished steps. `cold`:
    the case compiles on empty caches of its own (case_caches); `topology`: a key of
    bench_gpu.TOPOLOGIES."""
    from bench_gpu import TOPOLOGIES, job_overrides  # benchmarks/ is the script's path

    from rlinf_twoworker.api.demo import make_inputs
    from rlinf_twoworker.api.handle import run_grpo_two_worker
    from rlinf_twoworker.cluster.local import LocalCluster
    from rlinf_twoworker.config import load_config

    limit_s = limit_s or default_limit_s(steps)
    deadline = time.monotonic() + limit_s
    stamp = stamp or int(time.time())
    run_id = run_id_for(name, stamp)
    run_dir = root / "runs" / run_id
    custom_reward = _SHAPE.match(name) is not None
    reward = REWARD_FN if custom_reward else "library default (the math grader)"
    if custom_reward and not reward_fn_supported():
        custom_reward = False
        reward = "library default: this commit's config has no reward.reward_fn"
    own = case_overrides(name, reward_fn=custom_reward)
    out: dict[str, Any] = {
        "case": name,
        "overrides": [*own, *extra],
        "reward": reward,
        "steps": steps,
        "time_limit_s": limit_s,
        "run_dir": str(run_dir),
    }
    caches = case_caches(root, run_id, cold)
    out["caches"] = "cold: empty caches of its own" if cold else "shared with the other cases"
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[var] = str(caches[var])  # inherited by the cluster's workers
    _on_pythonpath(BENCH)
    nodes, gpus, placement = TOPOLOGIES[topology]
    out["topology"] = f"{topology}: {nodes} node(s) x {gpus} GPU(s), {placement}"
    results: list[Any] = []
    pids: dict[int, str] = {}
    sampler = sampler_for(nodes * gpus)
    started = time.perf_counter()
    report = None
    try:
        data = make_inputs(root / "inputs").data_path
        overrides = [
            *job_overrides(model_dir, data, root, run_id, steps, topology, caches["compile_cache"]),
            *own,
            *extra,
        ]
        cfg = load_config(overrides=overrides)
        epochs = _epochs_needed(data, cfg.data.rollout_batch_size, steps)
        if epochs > cfg.runner.max_epochs:
            overrides.append(f"runner.max_epochs={epochs}")
            out["overrides"].append(f"runner.max_epochs={epochs}")
            cfg = load_config(overrides=overrides)
        rows = cfg.data.rollout_batch_size * cfg.algorithm.group_size
        out.update(
            rows=rows,
            prompts=cfg.data.rollout_batch_size,
            group_size=cfg.algorithm.group_size,
            seq_length=cfg.runner.seq_length,
            max_prompt_length=cfg.data.max_prompt_length,
        )
        with sampler, LocalCluster(num_nodes=nodes, gpus_per_node=gpus):
            handle = None
            try:
                handle = run_grpo_two_worker(cfg)
                for n in range(1, steps + 1):
                    results.append(_get(handle.step(n), deadline, f"step {n}", limit_s))
                    if not pids:
                        try:
                            pids, out["pid_source"] = component_pids(handle, run_dir)
                        except Exception as exc:
                            out["pid_source"] = f"none: {type(exc).__name__}: {exc}"
                    print(
                        f"[scale/{name}] step {n}/{steps}: "
                        f"{results[-1].timings['time/step']:.1f} s",
                        flush=True,
                    )
                _get(handle.checkpoint(steps), deadline, "the last checkpoint", limit_s)
                report = _get(handle.result_ref(), deadline, "the verification", limit_s)
            except BaseException:
                if handle is not None:
                    try:
                        handle.cancel(timeout=30)
                    except Exception:  # the run may be gone already
                        pass
                raise
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        out["traceback"] = traceback.format_exc()[-3000:]
    finally:
        # ~21 GB of DCP files a checkpoint at this shape: the cases would fill a 64 GiB disk.
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if cold:  # no later case may find what this one compiled
            shutil.rmtree(_cold_dir(root, run_id), ignore_errors=True)
    out["case_s"] = time.perf_counter() - started
    out["component_pids"] = {str(pid): n for pid, n in pids.items()}
    if report is not None:
        out["verification_passed"] = report.passed
        out["verification_errors"] = report.errors[:5]
    if "rows" in out:
        try:
            out.update(
                _figures(
                    model_dir,
                    run_dir,
                    results,
                    out["rows"],
                    peak_tflops,
                    sampler,
                    pids,
                    gpus=nodes * gpus,
                )
            )
        except Exception as exc:  # the figures must not cost the case its error or the others
            out["figures_error"] = f"{type(exc).__name__}: {exc}"
            out["figures_traceback"] = traceback.format_exc()[-3000:]
    return out


def _figures(
    model_dir: Path,
    run_dir: Path,
    results: list[Any],
    rows: int,
    peak_tflops: float | None,
    sampler: GpuUseSampler | GpuUseSamplers,
    pids: dict[int, str],
    gpus: int = 1,
) -> dict[str, Any]:
    from bench_gpu import plan_vs_measured  # benchmarks/ is the script's path

    names = {**pids, os.getpid(): "driver"}
    out = summarise(results, rows, param_count(model_dir), peak_tflops, sampler, names, gpus)
    out.update(_plan(run_dir, out["nvidia_smi_peak_gib_by_process"]))
    if results and (run_dir / "memory_plan.json").exists():
        out["memory_plan_vs_pytorch"] = _or_error(plan_vs_measured, run_dir, results)
    out["memory_plan_lines"] = _log_lines(run_dir, "MEMORY_PLAN")
    return out


def _or_error(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _log_lines(run_dir: Path, tag: str) -> list[str]:
    try:
        text = (run_dir / "log" / "main.log").read_text(encoding="utf-8")
    except OSError:
        return []
    return [line.split(tag, 1)[1].strip() for line in text.splitlines() if tag in line]


def _median(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def stage_medians(results: Sequence[Any]) -> dict[str, float]:
    """Each timing's median over steps 2..N (step 1 alone when there is no other)."""
    later = list(results[1:]) or list(results)
    keys = dict.fromkeys(k for r in later for k in r.timings)
    return {k: statistics.median(r.timings[k] for r in later if k in r.timings) for k in keys}


def rates(results: Sequence[Any], rows: int, gpus: int = 1) -> dict[str, float | None]:
    """Tokens a step (medians over steps 2..N) over the stages' median seconds: the answers'
    tokens (rollout/response_length x rows) for the rollout and the log-prob recompute, the
    actor's own count of the tokens it trained on (the answers' too) for the update. The
    rollout's rate per GPU is over the job's `gpus` GPUs (generated_tokens_per_s: the whole)."""
    later = list(results[1:]) or list(results)
    stages = stage_medians(results)
    answers = _median(
        [
            None
            if r.metrics.get("rollout/response_length") is None
            else r.metrics["rollout/response_length"] * rows
            for r in later
        ]
    )
    trained = _median(
        [
            r.metrics["throughput/trained_tokens_per_s"] * r.timings["time/actor/training"]
            if "throughput/trained_tokens_per_s" in r.metrics and "time/actor/training" in r.timings
            else None
            for r in later
        ]
    )

    def per_s(tokens: float | None, stage: str) -> float | None:
        seconds = stages.get(stage)
        return tokens / seconds if tokens and seconds else None

    rollout = per_s(answers, "time/rollout")
    return {
        "answer_tokens": answers,
        "trained_tokens": trained,
        "generated_tokens_per_s": rollout,
        "generated_tokens_per_s_per_gpu": None if rollout is None else rollout / gpus,
        "inference_tokens_per_s": per_s(answers, "time/inference"),
        "actor_tokens_per_s": per_s(trained, "time/actor/training"),
    }


def summarise(
    results: Sequence[Any],
    rows: int,
    n_params: int,
    peak_tflops: float | None,
    sampler: GpuUseSampler | GpuUseSamplers,
    names: dict[int, str],
    gpus: int = 1,
) -> dict[str, Any]:
    """A case's figures from its StepResults and the nvidia-smi samples (module docstring);
    `gpus`: the job's GPUs (the rollout's tokens/s per GPU is over them)."""
    out: dict[str, Any] = {"steps_done": len(results), "model_params": n_params}
    if results:
        stages = stage_medians(results)
        rate = rates(results, rows, gpus)
        peak = peak_tflops * 1e12 if peak_tflops else None
        inference_tok, actor_tok = rate["inference_tokens_per_s"], rate["actor_tokens_per_s"]
        out.update(
            steps_s=[r.timings.get("time/step") for r in results],
            median_stage_s=stages,
            # Step 1 on its own: where its compiling goes (a setting that slows step 1 shows
            # up here by stage, not only in steps_s[0]).
            first_step_stage_s=dict(results[0].timings),
            step_s=stages.get("time/step"),
            **rate,
            inference_mfu=(2 * n_params * inference_tok / peak)
            if peak and n_params and inference_tok
            else None,
            actor_mfu=(6 * n_params * actor_tok / peak)
            if peak and n_params and actor_tok
            else None,
            bf16_peak_tflops=peak_tflops,
            updates=_updates(results),
        )
    out.update(sampler.summary())
    lineage, commands = sampler.ancestors, sampler.commands
    peaks = sampler.peak_by_pid()
    out["nvidia_smi_peak_gib_by_process"] = by_name(peaks, names, lineage, commands)
    out["nvidia_smi_unreported_pids"] = sampler.unreported_pids()
    out["nvidia_smi_other_processes"] = {  # what each pid of no component ran
        name_of(pid, names, lineage, commands): command.strip()
        for pid, command in commands.items()
        if pid not in names
    }
    out["per_step"] = per_step(results, sampler, names)
    return out


def _updates(results: Sequence[Any]) -> dict[str, Any]:
    """Whether the updates were real: non-zero advantages and gradients at every later step."""
    later = list(results[1:]) or list(results)
    keys = ("rollout/advantages_min", "rollout/advantages_max", "rollout/reward_scores")
    keys += ("rollout/correct_fraction", "actor/training/actor/grad_norm")
    # How far the actor's log-probs were from inference's before the step's first update.
    keys += ("actor/training/actor/logprob_diff_max",)
    # With loss scaling (fp16): the minibatches whose step an overflow skipped, and the scale.
    keys += ("actor/training/actor/skipped_steps", "actor/training/actor/loss_scale")
    per = [{k.rsplit("/", 1)[1]: r.metrics.get(k) for k in keys} for r in results]
    real = all(
        (p["advantages_max"] or 0.0) > 0 > (p["advantages_min"] or 0.0) and (p["grad_norm"] or 0.0)
        for p in per[len(results) - len(later) :]
    )
    return {"real": bool(real), "per_step": per}


PER_STEP_STAGES = (
    "time/step",
    "time/rollout",
    "time/inference",
    "time/actor/training",
    "time/sync_weights",
)
"""The stage timings each step of per_step keeps (the record's names without "time/")."""


def per_step(
    results: Sequence[Any], sampler: GpuUseSampler | GpuUseSamplers, names: dict[int, str]
) -> list:
    """Each step's nvidia-smi peaks (the GPU's and each process's, from the previous step's
    end to its own), each process's host RSS after it (its memory/<c>/<r>/host_rss_gib), its
    stage seconds (PER_STEP_STAGES) and mean answer length, and each process's seconds in
    torch.compile during it (compile/<c>/<r>/seconds)."""
    out = []
    start = sampler.started_at or None
    for r in results:
        end = r.finished_at or None
        rss = {
            ":".join(k.split("/")[1:3]): round(v, 3)
            for k, v in r.metrics.items()
            if k.startswith("memory/") and k.endswith("/host_rss_gib")
        }
        peak = sampler.gpu_peak(start, end)
        by_gpu = (
            {
                g: None if v is None else round(v, 3)
                for g, v in sampler.gpu_peaks(start, end).items()
            }
            if isinstance(sampler, GpuUseSamplers)
            else None
        )
        out.append(
            {
                "step": r.step,
                "gpu_peak_gib": None if peak is None else round(peak, 3),
                **({} if by_gpu is None else {"gpu_peak_gib_by_gpu": by_gpu}),
                "gpu_peak_gib_by_process": by_name(
                    sampler.peak_by_pid(start, end), names, sampler.ancestors, sampler.commands
                ),
                "host_rss_gib": rss,
                # Each step's stage seconds and mean answer length: a step that ran faster or
                # slower says which stage did, and whether the answers' length moved with it.
                "stage_s": {
                    k.split("/", 1)[1]: round(r.timings[k], 3)
                    for k in PER_STEP_STAGES
                    if k in r.timings
                },
                "response_length": r.metrics.get("rollout/response_length"),
                # Seconds each process spent in torch.compile during the step (a slow later
                # step that compiled again shows here).
                "compile_s": {
                    ":".join(k.split("/")[1:3]): round(v, 3)
                    for k, v in r.metrics.items()
                    if k.startswith("compile/") and k.endswith("/seconds")
                },
            }
        )
        start = end
    return out


def endurance(steps: list[dict], after_step: int = 3) -> dict[str, Any]:
    """Whether host RSS or GPU memory grew after `after_step`: per process, and the GPU."""
    host: dict[str, dict[int, float]] = {}
    gpu: dict[str, dict[int, float]] = {}
    for s in steps:
        for name, v in s["host_rss_gib"].items():
            host.setdefault(name, {})[s["step"]] = v
        for name, v in s["gpu_peak_gib_by_process"].items():
            gpu.setdefault(name, {})[s["step"]] = v
        if s["gpu_peak_gib"] is not None:
            gpu.setdefault("GPU", {})[s["step"]] = s["gpu_peak_gib"]
    host_rise = {n: round(grew(v, after_step), 3) for n, v in host.items()}
    gpu_rise = {n: round(grew(v, after_step), 3) for n, v in gpu.items()}
    return {
        "after_step": after_step,
        "steps": len(steps),
        "tolerance_gib": GROWTH_TOLERANCE_GIB,
        "host_rss_rise_gib": host_rise,
        "gpu_rise_gib": gpu_rise,
        "host_rss_grew": any(v > GROWTH_TOLERANCE_GIB for v in host_rise.values()),
        "gpu_grew": any(v > GROWTH_TOLERANCE_GIB for v in gpu_rise.values()),
        "judged": len(steps) > after_step,
    }


def _plan(run_dir: Path, peaks: dict[str, float]) -> dict[str, Any]:
    """memory_plan.json beside the nvidia-smi peaks: each process's estimate and peak, the
    GPU's estimate and budget, the plan's settings."""
    path = run_dir / "memory_plan.json"
    if not path.exists():
        return {}
    plan = json.loads(path.read_text(encoding="utf-8"))
    estimates = plan_estimates(run_dir)
    gpus = plan.get("gpus") or [{}]
    gpu = gpus[0]
    return {
        "plan_settings": plan.get("settings", {}),
        # Each GPU's estimate and budget where the job has more than one (the first's above).
        **(
            {
                "plan_gpus": [
                    {k: g.get(k) for k in ("resource_rank", "estimate_gib", "budget_gib")}
                    for g in gpus
                ]
            }
            if len(gpus) > 1
            else {}
        ),
        "plan_gpu_estimate_gib": gpu.get("estimate_gib"),
        "plan_gpu_budget_gib": gpu.get("budget_gib"),
        "plan_vs_nvidia_smi": [
            {
                "process": name,
                "plan_estimate_gib": est,
                "nvidia_smi_peak_gib": peaks.get(name),
                "peak_over_plan": round(peaks[name] / est, 3) if peaks.get(name) and est else None,
            }
            for name, est in sorted(estimates.items())
        ],
    }


def bench_scale(
    model_dir: Path,
    root: Path,
    cases: str = "all",
    steps: int = 3,
    endurance_steps: int = 0,
    limit_s: float | None = None,
    peak_tflops: float | None = None,
    extra: Sequence[str] = (),
    save: Callable[[dict], None] | None = None,
    cold: bool = False,
    topology: str = "colocated",
) -> dict[str, Any]:
    """Every case in turn (module docstring); `save` gets the section after each case.
    `cold`: every case on empty caches of its own (case_caches); `topology`: a key of
    bench_gpu.TOPOLOGIES, the nodes and GPUs of every case's LocalCluster."""
    from bench_gpu import TOPOLOGIES  # benchmarks/ is the script's path
    from gpu_use import parse_used

    nodes, gpus, _ = TOPOLOGIES[topology]

    names = parse_cases(cases)
    if endurance_steps > 0 and ENDURANCE_CASE not in names:
        names.append(ENDURANCE_CASE)
    stamp = int(time.time())
    out: dict[str, Any] = {
        "cases": {},
        "steps": steps,
        "endurance_steps": endurance_steps,
        "extra_overrides": list(extra),
        "cold_caches": cold,
        "topology": topology,
        "bf16_peak_tflops": peak_tflops,
    }
    befores = [parse_used(_query_gpu(g)) for g in range(nodes * gpus)]
    out["gpu_before_gib"] = befores[0]
    if len(befores) > 1:
        out["gpu_before_gib_by_gpu"] = dict(enumerate(befores))
    for name in names:
        n = endurance_steps if endurance_steps > 0 and name == ENDURANCE_CASE else steps
        # The last case's processes give their memory back (each GPU's figure after the wait).
        waited = [
            None if before is None else wait_released(g, before + 1.0, timeout_s=90)
            for g, before in enumerate(befores)
        ]
        case = run_case(
            model_dir, root, name, n, limit_s, peak_tflops, extra, stamp, cold, topology
        )
        case["gpu_used_at_case_start_gib"] = waited[0]
        if len(waited) > 1:
            case["gpu_used_at_case_start_gib_by_gpu"] = dict(enumerate(waited))
        if n == endurance_steps and name == ENDURANCE_CASE:
            case["endurance"] = endurance(case.get("per_step", []))
        out["cases"][name] = case
        print(f"[scale/{name}] {json.dumps(_brief(case), default=str)}", flush=True)
        if save is not None:
            save(out)
    return out


def _query_gpu(gpu: int = 0) -> str | None:
    from gpu_use import GPU_QUERY, nvidia_smi

    return nvidia_smi(GPU_QUERY, gpu)


def _brief(case: dict) -> dict:
    keys = ("step_s", "generated_tokens_per_s_per_gpu", "actor_mfu", "gpu_peak_gib", "error")
    return {k: case.get(k) for k in keys if k in case}


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _processes_cell(case: dict) -> str:
    rows = case.get("plan_vs_nvidia_smi") or []
    cells = []
    for r in rows:
        peak, est = r["nvidia_smi_peak_gib"], r["plan_estimate_gib"]
        over = f" ({peak / est - 1:+.0%})" if peak and est else ""
        cells.append(f"{r['process']} {_cell(peak, '.1f')} / {_cell(est, '.1f')}{over}")
    return "; ".join(cells) or "-"


def _gpu_cell(case: dict) -> str:
    peak = case.get("gpu_peak_gib")
    if peak is None:
        return "-"
    by_gpu = case.get("gpu_peak_gib_by_gpu")
    if by_gpu and len(by_gpu) > 1:  # each GPU's peak, then each GPU's plan
        plans = case.get("plan_gpus") or []
        cells = [f"GPU {g} {_cell(v, '.1f')}" for g, v in by_gpu.items()]
        plan = ", ".join(_cell(p.get("estimate_gib"), ".1f") for p in plans)
        return "; ".join(cells) + (f" (plan {plan})" if plan else "")
    notes = [f"{case['gpu_baseline_gib']:.1f} before"] if case.get("gpu_baseline_gib") else []
    if case.get("plan_gpu_estimate_gib") is not None:
        notes.append(f"plan {case['plan_gpu_estimate_gib']:.1f}")
    return f"{peak:.1f}" + (f" ({', '.join(notes)})" if notes else "")


def scale_table(results: dict) -> str:
    """The scale section as a markdown table, then the errors and the endurance verdicts,
    a paragraph each."""
    cases = results.get("scale", {}).get("cases", {})
    lines = [
        "| case | step s | rollout s | gen tok/s | inference s | inference MFU | actor s "
        "| actor MFU | per-process nvidia-smi peak / plan (GiB) | GPU peak (GiB) | verified "
        "| real update |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, c in cases.items():
        stages = c.get("median_stage_s", {})
        verified = c.get("verification_passed")
        verdict = "error" if "error" in c else {True: "yes", False: "no", None: "-"}[verified]
        real = c.get("updates", {}).get("real")
        lines.append(
            f"| {name} | {_cell(c.get('step_s'), '.2f')} | {_cell(stages.get('time/rollout'), '.2f')} "
            f"| {_cell(c.get('generated_tokens_per_s_per_gpu'), ',.0f')} "
            f"| {_cell(stages.get('time/inference'), '.2f')} | {_percent(c.get('inference_mfu'))} "
            f"| {_cell(stages.get('time/actor/training'), '.2f')} | {_percent(c.get('actor_mfu'))} "
            f"| {_processes_cell(c)} | {_gpu_cell(c)} | {verdict} "
            f"| {'-' if real is None else 'yes' if real else 'no'} |"
        )
        if "error" in c:
            notes.append(f"{name}: {c['error'][:400]}")
        e = c.get("endurance")
        if e:
            host = max(e["host_rss_rise_gib"].items(), key=lambda kv: kv[1], default=("-", 0.0))
            gpu = max(e["gpu_rise_gib"].items(), key=lambda kv: kv[1], default=("-", 0.0))
            notes.append(
                f"endurance {name}, {e['steps']} steps: after step {e['after_step']} host RSS "
                f"grew: {'yes' if e['host_rss_grew'] else 'no'} (largest rise {host[1]:.2f} GiB, "
                f"{host[0]}); GPU memory grew: {'yes' if e['gpu_grew'] else 'no'} (largest rise "
                f"{gpu[1]:.2f} GiB, {gpu[0]}); tolerance {e['tolerance_gib']} GiB"
                + ("" if e["judged"] else " (too few steps to judge)")
            )
    return "\n".join(lines) + "".join(f"\n\n{note}" for note in notes)
