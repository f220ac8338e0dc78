"""Where a fresh component process's start goes, part by part, on a GPU machine.

A component in a process Ray has just started imports torch and the library, then loads its
model through transformers; on the H200 the `load/<component>` phase of a run took 7-8 s in
fresh processes against 1.1-2.0 s in preloaded ones. This script times the parts in fresh
Python processes: one alone, then four at once (a colocated run's components), and writes
`python -X importtime` of one process for the modules that cost most.

    python benchmarks/probe_process_start.py --out start.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PARTS = (
    "torch",
    "worker_module",
    "transformers_auto",
    "cuda_init",
    "model_class",
    "load",
    "tokenizer",
)


def child(model_dir: str, spawned: float) -> dict:
    """The parts in this process's order, each in seconds; `python_start` from the parent's
    spawn to this function (the interpreter and site-packages)."""
    marks = {"python_start": time.time() - spawned}
    t = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        marks[name] = now - t
        t = now

    import torch

    mark("torch")
    import rlinf_twoworker.workers.actor  # noqa: F401  what a component's worker module pulls in

    mark("worker_module")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    mark("transformers_auto")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of this script
    torch.empty(1, device=device)
    mark("cuda_init")
    config = AutoConfig.from_pretrained(model_dir)
    AutoModelForCausalLM._model_mapping[type(config)]  # imports the model's modeling module
    mark("model_class")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa", device_map={"": device}
    )
    if device == "cuda":
        torch.cuda.synchronize()
    mark("load")
    AutoTokenizer.from_pretrained(model_dir)
    mark("tokenizer")
    del model
    return marks


def run_children(model_dir: Path, n: int) -> list[dict]:
    procs = []
    for _ in range(n):
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--child", str(model_dir), str(time.time())],
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def import_profile(model_dir: Path, top: int = 25) -> list[tuple[str, float]]:
    """The modules with the largest cumulative import time (s) in one fresh process."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", __file__, "--child", str(model_dir), str(time.time())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tops = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative_us, name = line[len("import time:") :].split("|")
        if not name[1:].startswith(" "):  # a top-level import: what it cost whole
            tops.append((name.strip(), int(cumulative_us) / 1e6))
    return sorted(tops, key=lambda r: -r[1])[:top]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], float(sys.argv[3]))))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="process_start.json")
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_gpu import make_model_dir

    model_dir = make_model_dir(Path(args.root))
    results: dict = {"cpus": os.cpu_count()}
    run_children(model_dir, 1)  # the page cache warm, as on a node that ran a job before
    results["alone"] = run_children(model_dir, 1)
    results["four_at_once"] = run_children(model_dir, 4)
    results["import_profile_top"] = import_profile(model_dir)
    Path(args.out).write_text(json.dumps(results, indent=2))
    keys = ("python_start", *PARTS)
    print("| part | alone (s) | four at once, median (s) |")
    print("|---|---|---|")
    for k in keys:
        four = statistics.median(r[k] for r in results["four_at_once"])
        print(f"| {k} | {results['alone'][0][k]:.2f} | {four:.2f} |")
    for name, seconds in results["import_profile_top"]:
        print(f"{seconds:7.2f} s  {name}")


if __name__ == "__main__":
    main()
