"""Where a component's model load goes: the library's load_causal_lm on the 1.5B shape, alone
and three processes at once (as the components start), in bf16 and fp32, each in a fresh
process (the CUDA context's creation timed apart from the load).

    python benchmarks/probe_load.py --out load.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path


def _load(model_dir: str, precision: str, queue: mp.Queue) -> None:
    import torch

    from rlinf_twoworker.engines.models import DTYPES, load_causal_lm

    start = time.perf_counter()
    torch.zeros(1, device="cuda")
    context = time.perf_counter() - start
    start = time.perf_counter()
    model = load_causal_lm(model_dir, DTYPES[precision], torch.device("cuda"))
    torch.cuda.synchronize()
    queue.put(
        {
            "precision": precision,
            "context_s": context,
            "load_s": time.perf_counter() - start,
            "device": str(next(model.parameters()).device),
        }
    )


def run(model_dir: Path, precisions: list[str]) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_load, args=(str(model_dir), p, queue)) for p in precisions]
    for p in procs:
        p.start()
    out = [queue.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return out


def main() -> int:
    from bench_gpu import make_model_dir

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="load.json")
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    args = parser.parse_args()
    model_dir = make_model_dir(Path(args.root))
    results = {
        "alone_bf16": run(model_dir, ["bf16"]),
        "alone_fp32": run(model_dir, ["fp32"]),
        "three_at_once": run(model_dir, ["bf16", "bf16", "fp32"]),
    }
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
