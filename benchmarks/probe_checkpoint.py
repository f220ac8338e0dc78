"""How fast this machine writes a checkpoint like the actor's, and what bounds it.

Measures, on one GPU and the disk under --dir:
  * the disk: 4 GiB written and fsynced, by 1 and by 8 threads (plain files);
  * torch DCP: a state dict shaped like the 1.5B actor's (fp32 parameters and AdamW's two
    moments, ~18.5 GB on the GPU) saved with FileSystemWriter(thread_count=1, 4, 8).
Each checkpoint is deleted once timed (the device's disk is 64 GiB). Prints one JSON object.

    python probe_checkpoint.py --dir /tmp/rlinf-bench/ckpt-probe [--scale 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

# DeepSeek-R1-Distill-Qwen-1.5B's parameter shapes (benchmarks/shapes.py's model).
HIDDEN, INTER, LAYERS, VOCAB, KV = 1536, 8960, 28, 151936, 256


def state(scale: float, device: str) -> dict[str, torch.Tensor]:
    """fp32 weights and two AdamW moments per weight, as the actor's DCP state holds them."""
    shapes: dict[str, tuple[int, ...]] = {"embed": (VOCAB, HIDDEN), "lm_head": (VOCAB, HIDDEN)}
    for i in range(int(LAYERS * scale)):
        shapes.update(
            {
                f"l{i}.q": (HIDDEN, HIDDEN),
                f"l{i}.k": (KV, HIDDEN),
                f"l{i}.v": (KV, HIDDEN),
                f"l{i}.o": (HIDDEN, HIDDEN),
                f"l{i}.gate": (INTER, HIDDEN),
                f"l{i}.up": (INTER, HIDDEN),
                f"l{i}.down": (HIDDEN, INTER),
            }
        )
    out = {}
    for name, shape in shapes.items():
        for part in ("param", "exp_avg", "exp_avg_sq"):
            out[f"{name}.{part}"] = torch.randn(shape, device=device)
    return out


def disk(root: Path, threads: int, gib: int = 4) -> float:
    """GB/s writing `gib` GiB in `threads` files at once, each fsynced."""
    block = os.urandom(64 << 20)
    per = (gib << 30) // threads

    def one(i: int) -> None:
        with open(root / f"disk-{i}.bin", "wb") as f:
            for _ in range(per // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(threads)))
    seconds = time.perf_counter() - start
    for i in range(threads):
        (root / f"disk-{i}.bin").unlink()
    return (gib << 30) / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/rlinf-bench/ckpt-probe")
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the layers")
    parser.add_argument("--threads", default="1,4,8")
    parser.add_argument("--staged-threads", type=int, default=8)
    parser.add_argument("--staged", default="pageable,pinned,reused", help="staged variants")
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out: dict = {"device": device, "cpus": os.cpu_count()}
    out["disk_gb_s"] = {f"{t}_threads": round(disk(root, t), 2) for t in (1, 8)}
    print(json.dumps(out), flush=True)
    sd = state(args.scale, device)
    size = sum(t.numel() * t.element_size() for t in sd.values())
    out["state_gb"] = round(size / 1e9, 2)
    out["dcp"] = {}
    for threads in [int(t) for t in args.threads.split(",") if t]:
        path = root / f"dcp-{threads}"
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        writer = dcp.FileSystemWriter(str(path), thread_count=threads)
        dcp.save(sd, storage_writer=writer, no_dist=True)
        seconds = time.perf_counter() - start
        files = sorted(p.name for p in path.iterdir())
        out["dcp"][f"{threads}_threads"] = {
            "seconds": round(seconds, 2),
            "gb_s": round(size / seconds / 1e9, 2),
            "files": files,
        }
        shutil.rmtree(path)
        print(json.dumps(out), flush=True)
    if device == "cuda":
        variants = args.staged.split(",")
        for pinned in [p for p in (False, True) if ("pinned" if p else "pageable") in variants]:
            out["dcp"][f"staged_{'pinned' if pinned else 'pageable'}"] = staged(
                sd, root / "dcp-staged", args.staged_threads, pinned, size
            )
            print(json.dumps(out), flush=True)
        if "reused" in variants:
            out["dcp"]["staged_pinned_reused"] = staged_reused(
                sd, root / "dcp-staged", args.staged_threads, size
            )
            print(json.dumps(out), flush=True)
    print(json.dumps(out, indent=2))


def staged_reused(sd: dict, path: Path, threads: int, size: int) -> dict:
    """Pinned buffers allocated once (as a run would keep them), then two checkpoints: the
    copies into them and the writes from them, timed apart."""
    start = time.perf_counter()
    cpu = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for n, t in sd.items()}
    allocated = time.perf_counter()
    rounds = []
    for _ in range(2):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for name, tensor in sd.items():
            cpu[name].copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        copied = time.perf_counter()
        writer = dcp.FileSystemWriter(str(path), thread_count=threads)
        dcp.save(cpu, storage_writer=writer, no_dist=True)
        written = time.perf_counter()
        shutil.rmtree(path)
        rounds.append({"copy_s": round(copied - began, 2), "write_s": round(written - copied, 2)})
    del cpu
    return {
        "threads": threads,
        "alloc_s": round(allocated - start, 2),
        "rounds": rounds,
        "gb_s_after_alloc": round(size / (rounds[-1]["copy_s"] + rounds[-1]["write_s"]) / 1e9, 2),
    }


def staged(sd: dict, path: Path, threads: int, pinned: bool, size: int) -> dict:
    """Copy the state to CPU memory first (every tensor, then one sync), write from there."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    cpu = {}
    for name, tensor in sd.items():
        cpu[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
        cpu[name].copy_(tensor, non_blocking=pinned)
    torch.cuda.synchronize()
    copied = time.perf_counter()
    dcp.save(
        cpu, storage_writer=dcp.FileSystemWriter(str(path), thread_count=threads), no_dist=True
    )
    written = time.perf_counter()
    shutil.rmtree(path)
    del cpu
    return {
        "threads": threads,
        "copy_s": round(copied - start, 2),
        "write_s": round(written - copied, 2),
        "seconds": round(written - start, 2),
        "gb_s": round(size / (written - start) / 1e9, 2),
    }


if __name__ == "__main__":
    main()
