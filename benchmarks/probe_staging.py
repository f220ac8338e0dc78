"""Host buffers for checkpoint staging: what allocating them in a background thread costs the
process's own GPU work, and how fast the GPU copies into each kind.

Allocates --gib GiB (in tensors of the 1.5B model's largest shapes) in a thread, three ways:
  * torch_pinned: torch.empty(..., pin_memory=True) (torch's host allocator);
  * ctypes_pinned: cudaHostAlloc through ctypes, which lets go of the interpreter lock while
    the driver pins the pages;
  * torch_registered: torch.empty(...) pinned in place by torch.cuda.cudart().cudaHostRegister;
  * pageable: torch.empty(...) then zero_() (the pages touched, nothing pinned);
meanwhile the main thread runs small GPU steps (a matmul and a sync, then a little Python) and
counts them against the same loop with nothing beside it. Then copies the same bytes from the
GPU into each kind of buffer. Prints one JSON object.

    python probe_staging.py [--gib 8]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import threading
import time

import torch

SHAPES = [(151936, 1536), (8960, 1536), (1536, 8960), (1536, 1536)]


def shapes_for(gib: float) -> list[tuple[int, int]]:
    out, total, i = [], 0, 0
    while total < gib * 2**30:
        shape = SHAPES[i % len(SHAPES)]
        out.append(shape)
        total += shape[0] * shape[1] * 4
        i += 1
    return out


def cudart() -> ctypes.CDLL:
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    import glob
    import os

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    found = glob.glob(f"{lib}/libcudart*.so*") + glob.glob(
        f"{os.path.dirname(os.path.dirname(torch.__file__))}/nvidia/*/lib/libcudart.so*"
    )
    return ctypes.CDLL(found[0])


def alloc_torch_pinned(shapes):
    return [torch.empty(s, dtype=torch.float32, pin_memory=True) for s in shapes]


def alloc_ctypes_pinned(shapes):
    rt = cudart()
    out = []
    for s in shapes:
        nbytes = s[0] * s[1] * 4
        ptr = ctypes.c_void_p()
        err = rt.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes), 0)
        if err != 0:
            raise RuntimeError(f"cudaHostAlloc {err}")
        buf = (ctypes.c_byte * nbytes).from_address(ptr.value)
        out.append(torch.frombuffer(buf, dtype=torch.float32).view(s))
    return out


def alloc_registered(shapes):
    """Pageable tensors, then pinned in place with torch's cudaHostRegister binding."""
    rt = torch.cuda.cudart()
    out = []
    for s in shapes:
        t = torch.empty(s, dtype=torch.float32)
        err = rt.cudaHostRegister(t.data_ptr(), t.numel() * 4, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister {err}")
        out.append(t)
    return out


def alloc_pageable(shapes):
    return [torch.empty(s, dtype=torch.float32).zero_() for s in shapes]


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main_loop(stop: threading.Event, counts: list[int]) -> None:
    a = torch.randn(1024, 1024, device=DEVICE)
    n = 0
    while not stop.is_set():
        b = a @ a
        _sync()
        _ = sum(range(2000))  # a little Python, as a step's bookkeeping
        n += 1
        del b
    counts.append(n)


def steps_per_s(seconds: float) -> float:
    stop, counts = threading.Event(), []
    t = threading.Thread(target=main_loop, args=(stop, counts))
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    return counts[0] / seconds


def with_alloc(alloc, shapes) -> dict:
    """The main loop's rate while `alloc` runs in a thread, and the allocation's seconds."""
    done: dict = {}

    def run():
        start = time.perf_counter()
        done["buffers"] = alloc(shapes)
        done["seconds"] = time.perf_counter() - start

    stop, counts = threading.Event(), []
    loop = threading.Thread(target=main_loop, args=(stop, counts))
    began = time.perf_counter()
    loop.start()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    stop.set()
    loop.join()
    wall = time.perf_counter() - began
    return {
        "alloc_s": round(done["seconds"], 2),
        "main_steps_per_s": round(counts[0] / wall, 1),
    }, done["buffers"]


def copy_rate(buffers, sources) -> float:
    _sync()
    start = time.perf_counter()
    for buf, src in zip(buffers, sources):
        buf.copy_(src, non_blocking=True)
    _sync()
    seconds = time.perf_counter() - start
    nbytes = sum(b.numel() * 4 for b in buffers)
    return round(nbytes / seconds / 1e9, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the pageable path")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    shapes = shapes_for(args.gib)
    sources = [torch.randn(s, device=DEVICE) for s in shapes]
    out: dict = {"gib": args.gib, "tensors": len(shapes)}
    out["baseline_main_steps_per_s"] = round(steps_per_s(5.0), 1)
    print(json.dumps(out), flush=True)
    kinds = [("pageable", alloc_pageable)]
    if DEVICE == "cuda":
        kinds += [
            ("ctypes_pinned", alloc_ctypes_pinned),
            ("torch_registered", alloc_registered),
            ("torch_pinned", alloc_torch_pinned),
        ]
    for name, alloc in kinds:
        buffers = None
        try:
            result, buffers = with_alloc(alloc, shapes)
            result["copy_gb_s"] = copy_rate(buffers, sources)
            result["copy_again_gb_s"] = copy_rate(buffers, sources)
            result["is_pinned"] = DEVICE == "cuda" and bool(buffers[0].is_pinned())
        except Exception as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        out[name] = result
        del buffers
        print(json.dumps(out), flush=True)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
