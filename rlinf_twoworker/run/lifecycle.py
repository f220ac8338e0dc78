"""The controller's calls to every component between its start and its end: per-worker logs,
process groups and the actor's build, the start-up report, the compile cache after a compiled
step, and the per-step memory report. Each is one round of calls with a timeout; a failure
names the component, rank and node (group.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.run.group import ComponentGroup, Member
from rlinf_twoworker.run.head_start import RunHeadStart
from rlinf_twoworker.run.startup import StartupClock
from rlinf_twoworker.storage.rundir import RunLog
from rlinf_twoworker.workers.contract import Policy, Process, Trainer

R = TypeVar("R")


async def attach_worker_logs(group: ComponentGroup, cfg: GRPOConfig, run_dir: Path) -> None:
    """runner.per_worker_log: each process also logs to log/<component>-<rank>.log."""
    members = group.all()
    paths = [(str(run_dir / "log" / f"{m.slot.component}-{m.slot.rank}.log"),) for m in members]
    await group.call_each(
        members,
        Process.attach_log,
        timeout=cfg.runner.timeouts.actor_start_s,
        stage="per-worker log",
        per_member=paths,
    )


async def join_process_groups(group: ComponentGroup, cfg: GRPOConfig, clock: StartupClock) -> None:
    """The actors' and the policy copies' process groups (rendezvous at actor rank 0), then the
    actor's FSDP build."""
    timeout = cfg.runner.timeouts.collective_s
    actors = group.actors()
    members = actors + group.policy_copies()
    master = await group.call(
        actors[0], Trainer.rendezvous_address, timeout=timeout, stage="rendezvous"
    )
    actor_ranks = list(range(len(actors)))
    consumer_ranks = list(range(len(actors), len(members)))
    shared = group.shared_gpus()
    args = [
        (tuple(master), i, len(members), actor_ranks, consumer_ranks, shared)
        for i in range(len(members))
    ]
    with clock.phase("process_groups"):
        await group.call_each(
            members, Policy.join, timeout=timeout, stage="process group", per_member=args
        )
    with clock.phase("actor_build"):
        await group.call_each(
            actors, Trainer.build, timeout=cfg.runner.timeouts.actor_start_s, stage="actor build"
        )


async def log_startup(
    group: ComponentGroup,
    cfg: GRPOConfig,
    clock: StartupClock,
    log: RunLog,
    began: float,
    head: RunHeadStart | None,
) -> None:
    """Each component's start-up into the record: spawn (the controller's request, at wall
    clock `began`, to its process's first answer: run/group.ComponentHost), import_ahead (the
    imports it made beside the preflight), init (its constructor, after the memory plan),
    with its model load (its preparation, the compile cache's and the reward's, is reported
    by `prepared`)."""
    answers = await _ask_all(
        group, Process.startup_report, cfg.runner.timeouts.actor_start_s, "start-up report"
    )
    ahead = {id(m): answer for m, answer in (await head.imported() if head else [])}
    for member, report in answers:
        who = f"{member.slot.component}:{member.slot.rank}"
        # spawn is the process's start and imports; on two nodes it mixes their wall clocks.
        if report.get("began") is not None:
            clock.record(f"spawn/{who}", report["began"] - began)
            for phase, seconds in spawn_parts(report, began).items():
                clock.record(f"{phase}/{who}", seconds)
        if id(member) in ahead and ahead[id(member)].get("seconds"):
            clock.record(f"import_ahead/{who}", ahead[id(member)]["seconds"])
        log_bytecode_cache(log, ahead.get(id(member), {}).get("bytecode"))
        if member.ready_at is not None:  # load_began: when ComponentHost.load began
            clock.record(f"init/{who}", member.ready_at - report["load_began"])
        for part, seconds in report["seconds"].items():  # load, grader_start
            clock.record(f"{part}/{who}", seconds)
    preloaded = [f"{m.slot.component}:{m.slot.rank}" for m, r in answers if r.get("preloaded")]
    if preloaded:
        log.detail(
            f"STARTUP preloaded workers (rlinf_twoworker.preload): {', '.join(preloaded)} of "
            f"{len(answers)} components"
        )


def log_bytecode_cache(log: RunLog, taken: dict[str, list[str]] | None) -> None:
    """A process's BytecodeCache.take() into the log: its lines to main.log, its warnings to
    the console as well."""
    for line in (taken or {}).get("lines", []):
        log.detail(f"BYTECODE_CACHE {line}")
    for line in (taken or {}).get("warnings", []):
        log.info(f"BYTECODE_CACHE {line}")


def spawn_parts(report: dict[str, Any], requested: float) -> dict[str, float]:
    """A component's spawn in parts, from its wall-clock marks (workers/process.process_times):
    `process`, the request to the process's creation (Ray's scheduling and worker pool; 0
    when Ray handed over a worker it had started before); `worker_boot`, from there to the
    library's first import (the interpreter, Ray's worker, the actor's assignment); `imports`,
    the component's modules up to its constructor."""
    created, imported, began = report.get("created"), report.get("imported"), report["began"]
    if created is None or imported is None or not created <= imported <= began:
        return {}
    start = max(created, requested)
    return {
        "process": max(0.0, created - requested),
        "worker_boot": max(0.0, imported - start),
        "imports": began - max(imported, start),
    }


async def prepared(head: RunHeadStart | None, clock: StartupClock, log: RunLog) -> None:
    """Wait for every component's preparation (started by the run's head start); record its
    seconds (compiler_imports/<c>:<r>, cache_load/<c>:<r>, grader_start/reward:<r>) and log
    its cache lines."""
    for member, answer in await head.prepared() if head else []:
        who = f"{member.slot.component}:{member.slot.rank}"
        for part, seconds in answer["seconds"].items():
            clock.record(f"{part}/{who}", seconds)
        for line in answer["cache"]:
            log.detail(line)


async def after_compiled_step(
    group: ComponentGroup, cfg: GRPOConfig, clock: StartupClock, log: RunLog, first: bool
) -> dict[str, float]:
    """Save newly compiled kernels to the shared compile cache; after the run's first step
    also record each component's compile seconds. Returns each process's seconds in
    torch.compile so far, by '<component>/<rank>'."""
    answers = await _ask_all(
        group, Process.save_compile_cache, cfg.runner.timeouts.checkpoint_s, "compile cache"
    )
    for member, answer in answers:
        for line in answer["cache"]:
            log.detail(line)
        if first and answer["compile_s"] > 0:
            clock.record(f"compile/{member.slot.component}:{member.slot.rank}", answer["compile_s"])
    return {f"{m.slot.component}/{m.slot.rank}": float(a["compile_s"]) for m, a in answers}


async def memory_metrics(group: ComponentGroup, cfg: GRPOConfig) -> dict[str, float]:
    """Every component process's memory during the step just done, as
    memory/<component>/<rank>/<what> in GiB (GPU peaks on GPUs, host memory everywhere)."""
    answers = await _ask_all(
        group, Process.memory_report, cfg.runner.timeouts.collective_s, "memory report"
    )
    return {
        f"memory/{m.slot.component}/{m.slot.rank}/{what}": value
        for m, report in answers
        for what, value in report.items()
    }


async def _ask_all(
    group: ComponentGroup, method: Callable[..., R], timeout: float, stage: str
) -> list[tuple[Member, R]]:
    """Every member's answer to `method` (a function of workers/contract.py), beside the
    member."""
    members = group.all()
    answers = await group.call_each(members, method, timeout=timeout, stage=stage)
    return list(zip(members, answers))
