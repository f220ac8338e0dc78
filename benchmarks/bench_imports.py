"""What a component process's imports cost on this machine: the floor of a plain cluster's start.

Each component process imports torch, transformers and its model family before it can load
(`run/head_start.HeadStart.import_ahead`). This measures, in fresh interpreters:

- one process alone: torch, then transformers with a causal-LM family, and the 15 modules
  whose own import (python -X importtime's self time) is the largest;
- N processes at once (as a run starts them), each's wall seconds;
- whether the interpreter can use and write bytecode caches (a site-packages without them
  compiles every module from source in every process): how many imported modules have no
  bytecode file, under which path and package;
- the same imports with the bytecode kept in a directory of its own (PYTHONPYCACHEPREFIX),
  first when it is empty, then twice more.

    python benchmarks/bench_imports.py --processes 5 --out imports.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

CHILD = """
import time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401
getattr(transformers, "Qwen2ForCausalLM")
t2 = time.perf_counter()
import os, sys
cached = [getattr(m, "__cached__", None) for m in list(sys.modules.values())]
cached = [c for c in cached if isinstance(c, str)]
absent = [c for c in cached if not os.path.exists(c)]
by_root = {}
for c in absent:  # grouped by the sys.path entry and top-level package they are under
    root = max((p for p in sys.path if p and c.startswith(p)), key=len, default="?")
    top = c[len(root):].lstrip("/").split("/")[0]
    by_root[f"{root}:{top}"] = by_root.get(f"{root}:{top}", 0) + 1
print(f"{t1 - t0:.3f} {t2 - t1:.3f} {len(cached)} {len(absent)}")
import json
print(json.dumps(by_root))
"""


def child(
    extra: list[str] | None = None, env: dict[str, str] | None = None
) -> tuple[float, float, float, str, list]:
    """One fresh interpreter: its wall seconds, torch's and transformers' import seconds,
    its stderr, and [modules with a bytecode cache path, how many of those files are absent]."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *(extra or []), "-c", CHILD],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    )
    first, by_root = done.stdout.splitlines()[-2:]
    torch_s, transformers_s, modules, missing = first.split()
    wall = time.perf_counter() - start
    counts = [int(modules), int(missing), json.loads(by_root)]
    return wall, float(torch_s), float(transformers_s), done.stderr, counts


def top_self_times(stderr: str, n: int = 15) -> list[tuple[str, float, float]]:
    """python -X importtime lines -> the n largest (module, self s, cumulative s)."""
    rows = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        own, total, name = line.removeprefix("import time:").split("|")
        rows.append((name.strip(), int(own) / 1e6, int(total) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:n]


def bytecode() -> dict:
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    where = os.path.dirname(spec.origin) if spec and spec.origin else ""
    cache = os.path.join(where, "__pycache__")
    return {
        "dont_write_bytecode": sys.flags.dont_write_bytecode,
        "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE"),
        "PYTHONPYCACHEPREFIX": os.environ.get("PYTHONPYCACHEPREFIX"),
        "transformers_dir_writable": os.access(where, os.W_OK),
        "transformers_pycache_files": len(os.listdir(cache)) if os.path.isdir(cache) else 0,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/imports-<config>-<hardware>.json"
    )
    args = parser.parse_args(argv)
    from record import write_result  # benchmarks/ is the script's path

    child()  # bytecode caches written, files in the page cache
    alone = [child() for _ in range(2)]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    bare = time.perf_counter() - start
    timed = child(["-X", "importtime"])
    with ThreadPoolExecutor(args.processes) as pool:
        together = list(pool.map(lambda _: child(), range(args.processes)))
    # Bytecode kept in a directory of its own (sys.pycache_prefix), written on first import.
    prefix = {"PYTHONPYCACHEPREFIX": tempfile.mkdtemp(prefix="pyc-"), "PYTHONDONTWRITEBYTECODE": ""}
    prefixed = [child(env=prefix) for _ in range(3)]
    result = {
        "python": sys.version.split()[0],
        "bytecode": bytecode(),
        "modules_and_absent_bytecode_files": alone[-1][4],
        "interpreter_bare_s": bare,
        "alone_s": [{"wall": a[0], "torch": a[1], "transformers": a[2]} for a in alone],
        "together_s": [{"wall": t[0], "torch": t[1], "transformers": t[2]} for t in together],
        "with_pycache_prefix_s": [
            {"wall": a[0], "torch": a[1], "transformers": a[2], "absent": a[4][1]} for a in prefixed
        ],
        "largest_self_imports": [
            {"module": m, "self_s": round(o, 3), "cumulative_s": round(c, 3)}
            for m, o, c in top_self_times(timed[3])
        ],
        "largest_cumulative_top_level": [
            {"module": m, "cumulative_s": round(c, 3)}
            for m, _, c in sorted(
                (r for r in top_self_times(timed[3], 10**6) if "." not in r[0]),
                key=lambda r: -r[2],
            )[:15]
        ],
    }
    print(json.dumps(result, indent=2))
    path = write_result("imports", f"processes{args.processes}", None, result, args.out)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
