"""The decode step's matrix products alone, at the 1.5B shape, in a few orientations.

    python benchmarks/probe_decode_gemm.py [--rows 256] [--iters 200]

A decode step at 256 slots multiplies [256, K] activations by each layer's weights: q/k/v
(1536 -> 2048, with bias), o (1536 -> 1536), gate/up (1536 -> 17920), down (8960 -> 1536), and
once the output head (1536 -> 151936). At so few rows cuBLAS's pick for F.linear may use the
GPU poorly (96 output tiles of 64x64 for the down projection on 132 SMs). Each product is
timed, replayed from a CUDA graph of 20 calls so no launch gap counts, as

- `linear`: F.linear(x, W), the sampler's call;
- `swapped`: (W @ x.T).T made contiguous: the same dot products with the operands' roles
  exchanged, so cuBLAS sees a [N, K] x [K, rows] product and picks its kernel for that shape;
- `split2`: K cut in two halves, one batched product of both (twice the output tiles, for a
  product like the down projection's whose output alone gives too few), summed in float32.

For each: microseconds a call, the weight bytes over that time (the bound at this many rows is
reading the weights once), and how many outputs differ from `linear`'s (bf16: a different
summation order may round differently). Prints one line per product and orientation.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

SHAPES = {  # name: (in, out, bias)
    "qkv": (1536, 2048, True),
    "o": (1536, 1536, False),
    "gate_up": (1536, 17920, False),
    "down": (8960, 1536, False),
    "head": (1536, 151936, False),
}


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


def _swapped(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = torch.mm(w, x.t()).t().contiguous()
    return y if b is None else y + b


def _split2(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Split-K in two: the two halves of K as one batched product (twice the output tiles
    for the GPU's SMs), their float32 sum cast back."""
    rows, k = x.shape
    half = k // 2
    xs = x.view(rows, 2, half).transpose(0, 1)  # [2, rows, K/2]
    ws = w.view(w.shape[0], 2, half).permute(1, 2, 0)  # [2, K/2, N]
    y = torch.bmm(xs, ws).float().sum(0).to(x.dtype)
    return y if b is None else y + b


def _time(fn, x, w, b, iters: int) -> float:
    """Microseconds a call, from a CUDA graph of 20 calls replayed iters // 20 times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, w, b)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn(x, w, b)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = max(iters // 20, 1)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--iters", type=int, default=400)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, rows {args.rows}")
    total = {"linear": 0.0, "swapped": 0.0, "split2": 0.0}
    for name, (k, n, bias) in SHAPES.items():
        x = torch.randn(args.rows, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        ref = _linear(x, w, b)
        per_step = 1 if name == "head" else 28
        for label, fn in (("linear", _linear), ("swapped", _swapped), ("split2", _split2)):
            us = _time(fn, x, w, b, args.iters)
            differ = int((fn(x, w, b) != ref).sum())
            total[label] += us * per_step
            print(
                f"{name:8s} {label:8s} {us:8.1f} us  {w.numel() * 2 / us / 1e3:6.0f} GB/s  "
                f"{differ} of {ref.numel()} outputs differ"
            )
    print(
        "a decode step's products (28 layers + head): "
        + ", ".join(f"{k} {v:.0f} us" for k, v in total.items())
    )


if __name__ == "__main__":
    main()
