"""The benchmarks' one entry point: a section by name, its module's own arguments after it.

    python -m benchmarks --list                      # each section, what it measures
    python -m benchmarks scale --scale-cases 32x8@2048 --scale-endurance-steps 30
    python -m benchmarks learning --smoke --tag cpu-smoke
    python -m benchmarks SECTION --help              # the section module's own options

Each section runs its module as the script it is (`python benchmarks/<module>.py ARGS`, with
the section's fixed arguments first), so what the module records as its command is that
script's command line. Results go to benchmarks/results/<section>-<configuration>-<hardware>.json
(benchmarks/record.py). Listing the sections imports nothing but this file.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# section: (module in benchmarks/, fixed arguments, what it measures)
SECTIONS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "gpu": (
        "bench_gpu",
        (),
        "the GPU suite: rollout, inference, actor MFU, weight sync, GRPO steps on 1 and 2 GPUs, "
        "TRL (--sections picks any of bench_gpu.py's sections)",
    ),
    "startup": (
        "bench_gpu",
        ("--sections", "startup"),
        "time to result: the tutorial's 2-step job, cold and warm, phase by phase (--startup-runs)",
    ),
    "scale": (
        "bench_gpu",
        ("--sections", "scale"),
        "whole GRPO steps at real batch sizes: stage seconds, tokens/s, MFU, each process's "
        "GPU peak against the memory plan, endurance (--scale-cases; --scale-topology 2gpu: "
        "2 nodes x 1 GPU, pipelined)",
    ),
    "grader": (
        "check_grader",
        (),
        "the default math grader against RLinf's own verify.py on generated answer/solution "
        "pairs: verdicts and extracted strings (CPU; needs an RLinf checkout, --rlinf DIR)",
    ),
    "scaling": (
        "bench_gpu",
        ("--sections", "scaling"),
        "the rollout's cost as the work grows: continuous batching against one static batch",
    ),
    "memory": (
        "bench_gpu",
        ("--sections", "memory"),
        "the tutorial job's memory, with the defaults and under a 40 GiB budget (--memory-runs)",
    ),
    "qwen3": (
        "bench_gpu",
        ("--sections", "qwen3"),
        "the Qwen3-0.6B shape on the static engine: exactness and decode tokens/s vs generate",
    ),
    "pipeline": (
        "bench_pipeline",
        (),
        "pipelined against sequential GRPO steps on two one-GPU nodes, answers of varied length",
    ),
    "learning": (
        "bench_learning",
        (),
        "does the policy learn: a small demo model's reward and correct fraction over 200 steps",
    ),
    "imports": (
        "bench_imports",
        (),
        "a fresh process's torch and transformers imports, alone, together, with bytecode kept",
    ),
    "run_cost": (
        "bench_run_cost",
        (),
        "a CPU run's cost: the host's CPU-seconds and wall time of successive 2-step demo runs "
        "on one LocalCluster, each process's share (the unit of the test suite's time)",
    ),
    "trl": (
        "bench_trl",
        (),
        "the baseline: TRL's GRPOTrainer on the same workload, process start to each step",
    ),
    "checkpoint": (
        "probe_checkpoint",
        (),
        "the disk's write rate against DCP's writer for the 1.5B actor's state, by streams",
    ),
    "staging": (
        "probe_staging",
        (),
        "a GPU loop's rate beside host buffers being allocated (pageable, pinned, registered)",
    ),
    "decode": (
        "probe_decode",
        (),
        "the static sampler's generate at --batch slots (default 16): its seconds, and a "
        "short generate's kernels by GPU time (profiler table)",
    ),
    "actor_step": (
        "probe_actor_step",
        (),
        "one GRPO step's actor update at the tutorial's shape (or --rows/--seq/--cut), by part, "
        "with the GPU's busy share and the kernels and host operators by time (profiler)",
    ),
    "logprobs": (
        "probe_logprobs",
        (),
        "inference's log-prob tokens/s, eager against the compiled log-softmax, by rows",
    ),
}


def listing() -> str:
    width = max(map(len, SECTIONS))
    lines = [f"{name:<{width}}  {what}" for name, (_, _, what) in SECTIONS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("--list", "-l", "list"):
        print(listing())
        return 0
    if argv[0] in ("-h", "--help"):
        print(__doc__)
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SECTIONS:
        print(f"unknown section {name!r}; one of: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    module, fixed, _ = SECTIONS[name]
    script = HERE / f"{module}.py"
    sys.path.insert(0, str(HERE))  # the modules import each other by name, as scripts do
    sys.argv = [str(script.relative_to(HERE.parent)), *fixed, *rest]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
