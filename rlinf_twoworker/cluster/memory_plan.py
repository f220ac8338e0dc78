"""The memory plan: each GPU's need, estimated before any model is loaded, against what it has.

From the model's config (parameters counted on the meta device by transformers), the
placement, the batch, `runner.seq_length` and the settings (precision, FSDP sharding, the
optimiser's state, the rollout's KV cache, activations with or without recompute), every
component process gets an estimate by part; the processes that share a GPU are added up and
compared with that GPU's budget: the free memory the preflight probe saw there, capped by
`cluster.max_gpu_memory_gb`. A GPU that does not fit is refused before any model loads, naming
the GPU, its components, the estimate by part and the settings that would make it fit.

The estimates by part are cluster/memory_parts.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlinf_twoworker import components
from rlinf_twoworker.cluster.memory_parts import GIB, ModelShape, micro_batch_tokens, process_parts
from rlinf_twoworker.config import GRPOConfig
from rlinf_twoworker.config.placement import Placement
from rlinf_twoworker.config.schema import (
    LOGPROB_MICRO_BATCH_TOKENS_FLOOR,
    MICRO_BATCH_TOKENS_FLOOR,
)
from rlinf_twoworker.errors import TwoWorkerError


def _trains(component: str) -> bool:
    """The component's row says it trains (the actor): its peak is the update's."""
    return components.by_name(component).trains


@dataclass
class ProcessPlan:
    """One component process's estimate, in bytes by part."""

    component: str
    rank: int
    resource_rank: int
    parts: dict[str, int]
    idle: int | None = None
    """Bytes it keeps while another process on its GPU works, when it gives the rest back
    (actor.enable_offload); None: it keeps its peak."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def held(self) -> int:
        """What it holds while the others work."""
        return self.total if self.idle is None else self.idle

    def line(self) -> str:
        unit, scale = ("GiB", GIB) if self.total >= GIB // 100 else ("MiB", 1024**2)
        parts = ", ".join(f"{k} {v / scale:.2f}" for k, v in self.parts.items() if v)
        idle = "" if self.idle is None else f", {self.idle / scale:.2f} {unit} while others work"
        return f"{self.component}:{self.rank} {self.total / scale:.2f} {unit} ({parts}){idle}"


@dataclass
class GpuPlan:
    resource_rank: int
    node_rank: int
    local_gpu: int
    processes: list[ProcessPlan]
    budget: int | None = None
    """Bytes it may use: the free memory the preflight saw, capped by the configured budget."""
    budget_source: str = ""

    @property
    def total(self) -> int:
        """The GPU's peak: every process at its peak at once, or, where processes give memory
        back (actor.enable_offload, sequential stages), the larger of the update (the actor
        ranks at their peaks, the others idle) and the other stages (the others at their
        peaks, the actor ranks idle)."""
        if all(p.idle is None for p in self.processes):
            return sum(p.total for p in self.processes)
        return max(self.phase(training=True), self.phase(training=False))

    def phase(self, training: bool) -> int:
        return sum(p.total if _trains(p.component) == training else p.held for p in self.processes)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total <= self.budget

    def where(self) -> str:
        names = "+".join(f"{p.component}:{p.rank}" for p in self.processes)
        return f"node {self.node_rank} GPU {self.local_gpu} (resource rank {self.resource_rank}: {names})"


@dataclass
class MemoryPlan:
    gpus: list[GpuPlan]
    settings: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = []
        for gpu in self.gpus:
            if gpu.budget is None:  # CPUs, or no free memory reported: nothing to hold it to
                budget, verdict = "planned", "no GPU budget known, so nothing is checked"
            else:
                budget = f"of {gpu.budget / GIB:.1f} GiB ({gpu.budget_source})"
                verdict = "fits" if gpu.fits else "DOES NOT FIT"
            phases = ""
            if any(p.idle is not None for p in gpu.processes):
                phases = (
                    f" (update {gpu.phase(True) / GIB:.1f}, other stages "
                    f"{gpu.phase(False) / GIB:.1f}: memory given back between them)"
                )
            unit, scale = ("GiB", GIB) if gpu.total >= GIB // 100 else ("MiB", 1024**2)
            out.append(
                f"MEMORY_PLAN {gpu.where()}: {gpu.total / scale:.1f} {unit}{phases} {budget}: "
                f"{verdict}"
            )
            out += [f"MEMORY_PLAN   {p.line()}" for p in gpu.processes]
        return out

    @property
    def total_bytes(self) -> int:
        """Every GPU's estimate added up."""
        return sum(gpu.total for gpu in self.gpus)

    def too_big(self) -> list[GpuPlan]:
        return [gpu for gpu in self.gpus if not gpu.fits]

    def estimate(self, component: str, rank: int) -> ProcessPlan | None:
        for gpu in self.gpus:
            for p in gpu.processes:
                if (p.component, p.rank) == (component, rank):
                    return p
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "gpus": [
                {
                    "resource_rank": g.resource_rank,
                    "node_rank": g.node_rank,
                    "local_gpu": g.local_gpu,
                    "estimate_gib": round(g.total / GIB, 3),
                    "budget_gib": None if g.budget is None else round(g.budget / GIB, 3),
                    "processes": [
                        {
                            "component": p.component,
                            "rank": p.rank,
                            "estimate_gib": round(p.total / GIB, 3),
                            "idle_gib": None if p.idle is None else round(p.idle / GIB, 3),
                            "parts_gib": {k: round(v / GIB, 3) for k, v in p.parts.items()},
                        }
                        for p in g.processes
                    ],
                }
                for g in self.gpus
            ],
        }


def plan_memory(
    cfg: GRPOConfig,
    placement: Placement,
    shapes: Mapping[str, ModelShape],
    free: Mapping[int, int] | None = None,
    recompute: bool | None = None,
    offload: bool | None = None,
) -> MemoryPlan:
    """The plan of every GPU. `shapes`: model section ('actor', 'rollout', 'inference') ->
    its shape; `free`: resource rank -> free bytes the preflight saw (None: unknown, as on CPU
    runs); `recompute`: the actor's activation recompute, `offload`: actor.enable_offload
    (None: as the config says)."""
    recompute = cfg.actor.recompute if recompute is None else recompute
    offload = cfg.actor.offload if offload is None else offload
    offload = offload and not cfg.pipelined  # RLinf ignores it when pipelined; so does the run
    ranks = len(placement.of("actor"))
    actor_gpus = {slot.resource_rank for slot in placement.of("actor")}
    cap = cfg.cluster.max_gpu_memory_gb
    gpus: dict[int, GpuPlan] = {}
    for slot in placement.slots:
        parts = process_parts(cfg, slot.component, shapes, ranks, recompute)
        if not parts:
            continue
        gpu = gpus.setdefault(
            slot.resource_rank,
            GpuPlan(slot.resource_rank, slot.bundle, slot.local_gpu, []),
        )
        process = ProcessPlan(slot.component, slot.rank, slot.resource_rank, parts)
        role = components.by_name(slot.component)
        if offload and (
            role.trains or (role.receives_weights and slot.resource_rank in actor_gpus)
        ):
            process.idle = parts.get("cuda_context", 0)  # weights, state, caches given back
        gpu.processes.append(process)
    for gpu in gpus.values():
        seen = None if free is None else free.get(gpu.resource_rank)
        limits = []
        if seen is not None:
            limits.append((seen, "free at preflight"))
        if cap is not None:
            limits.append((int(cap * GIB), "cluster.max_gpu_memory_gb"))
        if limits:
            gpu.budget, gpu.budget_source = min(limits)
    settings = {"actor_recompute": recompute, "actor_offload": offload, "actor_ranks": ranks}
    return MemoryPlan(sorted(gpus.values(), key=lambda g: g.resource_rank), settings)


def free_by_resource_rank(
    nodes: list[dict[str, Any]], gpu_of: dict[int, tuple[int, str]]
) -> dict[int, int]:
    """The preflight's per-GPU free memory (probe.py's gpu_memory, each GPU labelled with
    Ray's id), by resource rank. `gpu_of`: resource rank -> (node rank, Ray's GPU id) of the
    GPU its components hold (run/group.py's gpu_of); the probes list those GPUs in no set
    order. A rank whose GPU no probe reported is left out (its budget is then unknown)."""
    by_id = {
        (node["node_rank"], str(gpu.get("ray_gpu_id"))): int(gpu["free_bytes"])
        for node in nodes
        for gpu in node.get("gpu_memory") or []
    }
    return {rank: by_id[where] for rank, where in gpu_of.items() if where in by_id}


def refusal(plan: MemoryPlan, cfg: GRPOConfig) -> TwoWorkerError:
    """The error of a plan that does not fit: each GPU over its budget, by part, and what to
    change."""
    lines = ["the memory plan does not fit (estimated before loading any model):"]
    for gpu in plan.too_big():
        assert gpu.budget is not None
        lines.append(
            f"  {gpu.where()}: needs about {gpu.total / GIB:.1f} GiB, has "
            f"{gpu.budget / GIB:.1f} GiB ({gpu.budget_source})"
        )
        lines += [f"    {p.line()}" for p in gpu.processes]
    lines.append("  to make it fit: " + "; ".join(remedies(plan, cfg)))
    return TwoWorkerError("\n".join(lines))


def remedies(plan: MemoryPlan, cfg: GRPOConfig) -> list[str]:
    """Settings that lower the largest parts of the GPUs that do not fit."""
    biggest: dict[str, int] = {}
    for gpu in plan.too_big():
        for p in gpu.processes:
            for part, size in p.parts.items():
                key = f"{p.component}.{part}"
                biggest[key] = max(biggest.get(key, 0), size)
    advice = {
        "actor.activations": "actor.activation_checkpointing=true or a lower "
        "runner.micro_batch_tokens",
        "actor.logits": "a lower runner.micro_batch_tokens",
        "actor.attention_mask": "RLINF_PACK_LEFT=1 in the job's environment (a model whose "
        "attention slides a window keeps the mask), actor.activation_checkpointing=true or a "
        "lower runner.micro_batch_tokens",
        "actor.optimizer": "more actor ranks (cluster.component_placement.actor over more GPUs)",
        "actor.weights": "more actor ranks (cluster.component_placement.actor over more GPUs)",
        "rollout.kv_cache": "a lower rollout.max_batch_size or runner.seq_length",
        "inference.logits": "a lower runner.logprob_micro_batch_tokens",
        "reference.logits": "a lower runner.logprob_micro_batch_tokens",
        "inference.activations": "a lower runner.logprob_micro_batch_tokens",
    }
    out: list[str] = []
    shared = any(
        len({_trains(p.component) for p in gpu.processes}) == 2  # a trainer and another
        for gpu in plan.too_big()
    )
    if shared and not plan.settings.get("actor_offload") and not cfg.pipelined:
        out.append(
            "actor.enable_offload=true (the actor's GPU is shared: its state leaves it "
            "between updates)"
        )
    for key, _ in sorted(biggest.items(), key=lambda kv: -kv[1]):
        hint = advice.get(key)
        if hint and hint not in out:
            out.append(hint)
    out.append("or put the components on separate GPUs, or free the GPU")
    if cfg.cluster.max_gpu_memory_gb is not None:
        out.append(f"or raise cluster.max_gpu_memory_gb ({cfg.cluster.max_gpu_memory_gb:g})")
    return out


ACTOR_CUTS = (65536, 49152, 32768, 24576, 16384, 12288, 8192, 6144, MICRO_BATCH_TOKENS_FLOOR)
"""runner.micro_batch_tokens values the plan tries when it is null (largest first)."""
LOGPROB_CUTS = (65536, 49152, 32768, 24576, LOGPROB_MICRO_BATCH_TOKENS_FLOOR)
"""runner.logprob_micro_batch_tokens values the plan tries when it is null."""
ACTOR_CUT_OVERHEAD_TOKENS = 800
"""The cost model's fixed cost of one actor micro-batch, in tokens of compute: the host's time to
launch it and the per-cut work that does not grow with its tokens. Fitted on an H100 at the 1.5B
shape, the update alone over 32 x 8 answers of 2048 tokens (`python -m benchmarks actor_step`,
65,536 tokens an update; `benchmarks/results/actor_step-32x8@2048-cuts_recompute-casts_once-
h100.txt`, 329edfb): without recompute 1.512 s at 4096-token cuts, 1.396 at 8192, 1.330 at
16384 (740 and 860 tokens a cut between neighbours); with it 1.906, 1.724, 1.667 (970 and 580).
The 2,500 before it was fitted before the update stopped waiting on the host in every
micro-batch (afe8f0d, 71257f5: the GPU busy 49% of a 4096-token update then, 92% now), and
6,500 before that to the first code's 20.8 s against 11.2 s, which picked 8192-token cuts with
recompute where 4096 without was faster (`test_the_cost_model_orders_...` in
tests/integration/test_memory_plan.py holds the model to both measurements)."""
AUTO_SHARE = 0.90
"""A cut the plan grows past its floor must leave 10% of each GPU's budget unplanned: the
library's own choice keeps a margin for what the estimate misses (on an H200 the per-process
estimates came within -10%..+5% of nvidia-smi's peaks, memory_parts.ACTIVATIONS_COMPILED); the
floors, the library's former fixed defaults, and the user's values are held to the whole
budget, as before."""
LOGPROB_CUT_OVERHEAD_TOKENS = 500
"""The same for a log-prob forward (no backward, no optimiser: a smaller fixed cost). Fitted in
the same call: the forward over 32 x 2048 tokens took 0.448 s in 4096-token cuts, 0.428 in
8192 and 0.414 in 16384 (medians of 3; about 500 tokens a cut)."""


@dataclass(frozen=True)
class Cuts:
    """The actor's micro-batch tokens, the log-prob recompute's, and activation recompute."""

    actor_tokens: int
    logprob_tokens: int
    recompute: bool

    def cost(self, cfg: GRPOConfig, ranks: int) -> float:
        """Relative seconds of a step's update and log-prob recompute with these cuts: per
        token 3 units for a forward and backward (6N FLOPs), one more with recompute, 1 for a
        forward alone (2N), each cut paying a fixed cost (the constants above). Only the
        order of two costs means anything."""
        actor = micro_batch_tokens(cfg, ranks, True, self.actor_tokens, whole_rows=True)
        logprob = micro_batch_tokens(cfg, 1, False, self.logprob_tokens, whole_rows=True)
        update = (4 if self.recompute else 3) * (1 + ACTOR_CUT_OVERHEAD_TOKENS / actor)
        return update + 1 + LOGPROB_CUT_OVERHEAD_TOKENS / logprob


def choose_cuts(
    cfg: GRPOConfig,
    placement: Placement,
    shapes: Mapping[str, ModelShape],
    free: Mapping[int, int] | None,
    offload: bool | None,
    recompute: bool | None = None,
) -> tuple[Cuts, MemoryPlan] | None:
    """The fastest cuts (by Cuts.cost) whose plan fits every GPU, over the values the config
    leaves to the plan (null micro-batch tokens: ACTOR_CUTS / LOGPROB_CUTS; null recompute:
    off and on), the others as set; None when no combination fits. Leaves `cfg` as it was."""
    runner = cfg.runner
    ranks = max(1, len(placement.of("actor")))
    actor_options = (
        ACTOR_CUTS
        if runner.micro_batch_tokens is None and not runner.enable_dynamic_batch_size
        else (runner.actor_cut_tokens,)
    )
    logprob_options = (
        LOGPROB_CUTS if runner.logprob_micro_batch_tokens is None else (runner.logprob_cut_tokens,)
    )
    if recompute is None and cfg.actor.recompute_choice is not None:
        recompute = cfg.actor.recompute
    recompute_options = (False, True) if recompute is None else (recompute,)
    saved = (runner.micro_batch_tokens, runner.logprob_micro_batch_tokens)
    floors = (
        MICRO_BATCH_TOKENS_FLOOR if saved[0] is None else runner.actor_cut_tokens,
        LOGPROB_MICRO_BATCH_TOKENS_FLOOR if saved[1] is None else runner.logprob_cut_tokens,
    )
    best: tuple[float, Cuts, MemoryPlan] | None = None
    seen: set[Cuts] = set()
    try:
        for with_recompute in recompute_options:
            for actor_tokens in actor_options:
                for logprob_tokens in logprob_options:
                    # A value past all rows cuts as all rows: name the cut by what it holds.
                    if saved[0] is None and not runner.enable_dynamic_batch_size:
                        actor_tokens = micro_batch_tokens(
                            cfg, ranks, True, actor_tokens, whole_rows=True
                        )
                    if saved[1] is None:
                        logprob_tokens = micro_batch_tokens(
                            cfg, 1, False, logprob_tokens, whole_rows=True
                        )
                    cuts = Cuts(actor_tokens, logprob_tokens, with_recompute)
                    if cuts in seen:
                        continue
                    seen.add(cuts)
                    cost = cuts.cost(cfg, ranks)
                    if best is not None and cost >= best[0]:
                        continue
                    runner.micro_batch_tokens, runner.logprob_micro_batch_tokens = (
                        actor_tokens,
                        logprob_tokens,
                    )
                    plan = plan_memory(cfg, placement, shapes, free, with_recompute, offload)
                    grown = actor_tokens > floors[0] or logprob_tokens > floors[1]
                    share = AUTO_SHARE if grown else 1.0
                    if all(g.budget is None or g.total <= share * g.budget for g in plan.gpus):
                        best = (cost, cuts, plan)
    finally:
        runner.micro_batch_tokens, runner.logprob_micro_batch_tokens = saved
    return None if best is None else (best[1], best[2])


def budget_known(cfg: GRPOConfig, free: Mapping[int, int] | None) -> bool:
    """Whether the plan has a budget to choose cuts against: GPUs, with the preflight's free
    memory or cluster.max_gpu_memory_gb."""
    if cfg.cluster.accelerator != "cuda":
        return False
    return bool(free) or cfg.cluster.max_gpu_memory_gb is not None


def settle_plan(
    cfg: GRPOConfig,
    placement: Placement,
    shapes: Mapping[str, ModelShape],
    free: Mapping[int, int] | None,
) -> tuple[MemoryPlan, list[str]]:
    """The run's plan and what it decided, written into `cfg` before the components start
    with it. What the config leaves to the plan (null): the actor's and the log-prob
    recompute's micro-batch tokens and the actor's activation recompute are chosen together,
    the fastest combination that fits (choose_cuts), first with the actor's offload as set
    (off when null), then, if nothing fits and actor.enable_offload is null, with it on.
    Where no budget is known the micro-batch tokens take their floors and nothing else is
    turned on."""
    runner = cfg.runner
    auto = [
        key
        for key in ("micro_batch_tokens", "logprob_micro_batch_tokens")
        if getattr(runner, key) is None
    ]
    if not budget_known(cfg, free):
        runner.micro_batch_tokens = runner.actor_cut_tokens
        runner.logprob_micro_batch_tokens = runner.logprob_cut_tokens
        return plan_memory(cfg, placement, shapes, free), []
    offload_free = cfg.actor.enable_offload is None and not cfg.pipelined
    recompute_free = cfg.actor.recompute_choice is None
    for offload in (None, True) if offload_free else (None,):
        found = choose_cuts(cfg, placement, shapes, free, offload)
        if found is None:
            continue
        cuts, plan = found
        # Whether recompute is needed at all, or only the faster choice (asked while the
        # cuts are still left to the plan).
        needs_recompute = (
            recompute_free
            and cuts.recompute
            and choose_cuts(cfg, placement, shapes, free, offload, recompute=False) is None
        )
        runner.micro_batch_tokens = cuts.actor_tokens
        runner.logprob_micro_batch_tokens = cuts.logprob_tokens
        notes = []
        if auto:
            notes.append(
                f"MEMORY_PLAN micro-batches: actor {cuts.actor_tokens} tokens, log-probs "
                f"{cuts.logprob_tokens} tokens (runner.{' and runner.'.join(auto)} null: the "
                "fastest cut that fits, by the plan's cost model; set them to fix the cut)"
            )
        if recompute_free and cuts.recompute:
            if needs_recompute:
                short = plan_memory(cfg, placement, shapes, free, False, offload).too_big()
                why = f"{'; '.join(gpu.where() for gpu in short)} fits only with it"
            else:
                why = "with it a larger micro-batch fits, faster by the plan's cost model"
            cfg.actor.activation_checkpointing = True
            notes.append(
                "MEMORY_PLAN actor activation recompute turned on (actor.activation_"
                f"checkpointing is null and {why}; set it to false to refuse instead)"
            )
        if offload:
            where = "; ".join(
                gpu.where() for gpu in plan_memory(cfg, placement, shapes, free).too_big()
            )
            cfg.actor.enable_offload = True
            notes.append(
                "MEMORY_PLAN actor offload turned on: parameters and optimiser state in CPU "
                "memory outside the update, the rollout's and inference's memory given back "
                f"during it (actor.enable_offload is null and {where} fits only with it; set "
                "it to false to refuse instead)"
            )
        return plan, notes
    runner.micro_batch_tokens = runner.actor_cut_tokens
    runner.logprob_micro_batch_tokens = runner.logprob_cut_tokens
    return plan_memory(cfg, placement, shapes, free), []


def explain_oom(exc: BaseException, plan: MemoryPlan | None, step: int) -> BaseException:
    """A component's out-of-memory failure, with the plan's estimate for that process and what
    to do; any other error unchanged."""
    from rlinf_twoworker.errors import ComponentError

    if not isinstance(exc, ComponentError) or plan is None:
        return exc
    cause = exc.cause.lower()
    if "out of memory" not in cause and "can't allocate memory" not in cause:
        return exc
    estimate = plan.estimate(exc.component, exc.rank)
    gpu = next((g for g in plan.gpus if estimate in g.processes), None)
    if estimate is None or gpu is None:
        return exc
    budget = "" if gpu.budget is None else f" of {gpu.budget / GIB:.1f} GiB ({gpu.budget_source})"
    told = (
        f"{exc.cause} [out of memory at step {step}: the memory plan estimated "
        f"{estimate.line()}, and {gpu.total / GIB:.1f} GiB{budget} for {gpu.where()}; if "
        "another process took that GPU's memory (nvidia-smi lists them), free it; else lower "
        "the largest part (runner.micro_batch_tokens, actor.activation_checkpointing=true, "
        "rollout.max_batch_size) or set cluster.max_gpu_memory_gb to leave room; the run's "
        "completed checkpoints are intact and runner.resume_dir=auto continues from the last]"
    )
    return ComponentError(exc.component, exc.rank, exc.node, told)


def write_plan(plan: MemoryPlan, path: Path) -> None:
    path.write_text(json.dumps(plan.to_dict(), indent=2) + "\n", encoding="utf-8")
