"""Where a run's start-up time goes, phase by phase.

Every phase is logged as it ends (`STARTUP <phase> <seconds>s` in log/main.log), kept for
`handle.status()["startup"]` and handed to the run's first StepResult (`StepResult.startup`).
Phases, in order (the components' processes start beside the preflight; their model loads
overlap one another):

    connect          from the call of run_grpo_two_worker to the controller running (its
                     process imports no torch: run/controller.py)
    placement        the placement group ready
    component_start  every component's process started and answered where it runs (from
                     the request, made when the placement group is ready), inside `preflight`
    spawn/<c>:<r>    one component's request to its process's first answer, inside
                     `component_start`, in parts: process/ (Ray's scheduling and worker
                     pool), worker_boot/ (the interpreter and Ray's worker, up to the
                     library's import) and imports/ (the library's process module,
                     run/group.py; no torch)
    import_ahead/<c>:<r>  its worker module (torch) and what its model load will import
                     (transformers' classes, the model's family), from its first answer on,
                     beside the preflight; on GPUs it then starts a thread importing
                     torch.compile's stack (compiler_imports/)
    controller_imports  the controller's training modules (torch), imported in a thread from
                     the components' request on; recorded before the process groups
    preflight        from the components' request to every node's probe done (the probes
                     check the GPUs the components hold, once they have answered)
    preflight/node<i>/<check>  one check's seconds on one node (gpus, env_and_code, manifests,
                     model_configs, imports), inside `preflight`
    preflight/collective  the cross-node all-reduce, inside `preflight`
    data             the training (and validation) data read
    memory_plan      the models' shapes against the free memory of each component's GPU
    components       every component's model loaded (its constructor, the actor's too),
                     after the memory plan
    init/<c>:<r>     its constructor, in parts: tokenizer/ (the rollout's), load/ (the
                     model), engine/ (the rollout's generation engine)
    compiler_imports/<c>:<r>, cache_load/<c>:<r>  on GPUs, the wait for torch.compile's
                     imports (started by import_ahead, in a thread) and the component's
                     compile-cache entry (its prepare_compiler call, right after its
                     constructor, while the others still load); recorded at the end of the
                     first step
    load/<c>:<r>     one component's model load, inside `components`
    grader_start/reward:0  the reward's grading processes started and warmed up (its
                     warm_up_grader call, right after its constructor, while the others
                     still load); recorded at the end of the first step
    process_groups   the run's process group and sub-groups
    actor_build      FSDP sharding and the optimiser
    weight_sync      the first sync (rollout and inference start from the actor's weights)
    warm_up/<c>:<r>  runner.compile_warm_up: one log-prob component's or actor rank's
                     made-up batch (run/warmup.py), started after the first sync, beside
                     step 1's rollout; recorded at the end of the first step;
                     warm_up_compile/<c>:<r> its seconds in torch.compile (GPUs)
    ready            from the call to the first step starting
    first_step       step 1 (or the first step after a resume), compilation included
    compile/<c>:<r>  one component's seconds in torch.compile up to the end of that step,
                     its warm-up included (GPUs)
    to_first_step    from the call to the first step done
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StartupClock:
    def __init__(self, log: Callable[[str], None], called_at: float | None = None) -> None:
        self.log = log
        self.called_at = called_at if called_at is not None else time.time()
        self.seconds: dict[str, float] = {}

    def record(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = round(seconds, 3)
        self.log(f"STARTUP {phase} {seconds:.2f}s")

    def since_call(self, phase: str) -> None:
        """Record `phase` as the time from the call to now."""
        self.record(phase, time.time() - self.called_at)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.record(name, time.perf_counter() - start)
