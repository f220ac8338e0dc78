# ruff: noqa: B023  (each lambda runs within the loop iteration that makes it)
"""Decode attention alone and in the sampler: the grouped matrix product against the split-KV
kernel (engines/decode_attention.py), with FlexAttention and unmasked SDPA for comparison.

python benchmarks/probe_decode_attention.py [--out FILE]

Part 1: one layer's decode attention, 1.5B shape (12 heads, 2 KV heads, head_dim 128), cache of
2304 columns (--cache-len); B slots (--slots), read width W (--widths), every slot filled to W
("full") or to a uniform length in [256, W] ("mixed"); microseconds per call (CUDA events,
median of 5 x 50 calls, launched eagerly or, with --graphs, replayed from a CUDA graph as the
sampler runs them) and the largest difference from a float32 reference. Part 2: the sampler's
generate() at B slots and N new tokens after a 256-token prompt (--generate-cases), GRPO groups
of 8 answers a prompt, each attention (and the kernel on distinct prompts, which share
nothing), seconds and generated tokens/s. Part 3: the kernel table of a decode. Part 4: the
sampler's generate() as in part 2 (groups of 8, the attention the sampler picks) with the
sampling race compiled (the default: its noise drawn inside the compiled pass), compiled with
the noise drawn beforehand by exponential_ ("given", the race before the draw moved inside) and
eager, the three interleaved.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

HEADS, KV, DIM, LEN = 12, 2, 128, 2304


def _time(fn, calls: int = 50, repeats: int = 5, graph: bool = False) -> float:
    """Microseconds a call: the median of `repeats` timings of `calls` calls, CUDA events.
    `graph`: the calls captured once in a CUDA graph and the graph replayed, as the sampler
    runs its decode steps (no Python, guard or launch cost between kernels); else launched
    eagerly, which at few slots can time the host rather than the GPU."""
    fn()
    torch.cuda.synchronize()
    run = fn
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(calls):
                fn()
        run = captured.replay
        run()
        torch.cuda.synchronize()
    launches = 1 if graph else calls  # one replay runs the `calls` captured calls
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            run()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    return statistics.median(times)


def part1(
    slot_counts: list[int], length: int, widths: list[int], graph: bool = False
) -> list[dict]:
    from rlinf_twoworker.engines.decode_attention import (
        combine,
        grouped_matmul,
        split_kv,
        splits_for,
    )
    from rlinf_twoworker.engines.static_kernels import masked_softmax

    dev = torch.device("cuda")
    softmax = torch.compile(masked_softmax, dynamic=True)
    reduce = torch.compile(combine)
    rows = []
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception as error:  # noqa: BLE001
        flex, flex_error = None, repr(error)
    for b in slot_counts:
        g = torch.Generator(device=dev).manual_seed(0)
        keys = torch.randn(b, KV, length, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        values = torch.randn(b, KV, length, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        q = torch.randn(b, HEADS, 1, DIM, device=dev, dtype=torch.bfloat16, generator=g)
        splits = splits_for(b, KV, length, dev)
        for width in widths:
            for fill in ("full", "mixed"):
                if fill == "full":
                    end = torch.full((b,), width, device=dev)
                else:
                    end = torch.randint(256, width + 1, (b,), device=dev, generator=g)
                cols = torch.arange(length, device=dev)
                valid = (cols[None, :] < end[:, None]) & (cols[None, :] >= 3)  # 3 padding cols
                bias = torch.zeros(b, width, device=dev).masked_fill(~valid[:, :width], -math.inf)
                bias4 = bias[:, None, None, :]
                scale = DIM**-0.5
                ref = grouped_matmul(
                    q.float(), keys.float(), values.float(), bias4, scale, masked_softmax
                )
                row = {
                    "slots": b,
                    "cache": length,
                    "width": width,
                    "fill": fill,
                    "splits": splits,
                    "mean_end": float(end.float().mean()),
                }
                runs = {
                    "grouped": lambda: grouped_matmul(q, keys, values, bias4, scale, softmax),
                    "split_kv": lambda: split_kv(
                        q, keys, values, valid, end, width, scale, splits, reduce
                    ),
                    "sdpa_unmasked_bound": lambda: F.scaled_dot_product_attention(
                        q, keys[:, :, :width], values[:, :, :width], enable_gqa=True
                    ),
                }
                if flex is not None:

                    def score_mod(score, bi, h, qi, kv):
                        return torch.where(valid[bi, kv], score, -math.inf)

                    runs["flex_score_mod"] = lambda: flex(
                        q,
                        keys[:, :, :width],
                        values[:, :, :width],
                        score_mod=score_mod,
                        enable_gqa=True,
                    )
                for name, fn in runs.items():
                    try:
                        out = fn()
                        us = _time(fn, graph=graph)
                        row[f"{name}_us"] = round(us, 1)
                        if name != "sdpa_unmasked_bound":
                            out = out.reshape(b, 1, -1).float()
                            row[f"{name}_max_err"] = float((out - ref).abs().max())
                    except Exception as error:  # noqa: BLE001
                        row[f"{name}_error"] = repr(error)[:300]
                needed = float(end.float().sum()) * KV * DIM * 2 * 2
                row["needed_gb_s_split_kv"] = round(needed / row.get("split_kv_us", 1e9) / 1e3, 1)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if flex is None:
        print("flex unavailable:", flex_error)
    return rows


@functools.cache
def _model():
    """The 1.5B shape with random bf16 weights on the GPU, loaded once for parts 2 and 3."""
    from bench_gpu import make_model_dir

    from rlinf_twoworker.engines.models import load_causal_lm

    model_dir = make_model_dir(Path("/tmp/rlinf-bench"))
    return load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()


def _timed_generate(sampler, ids, mask, new: int, settings, **labels) -> dict:
    """The seconds and tokens/s of the sampler's second generate() (the first compiles and
    captures), with `labels`; printed as a JSON line."""
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.generate(ids, mask, new, [10**9], 0, settings)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    slots = ids.shape[0]
    row = {"slots": slots, "new": new, **labels, "seconds": round(seconds, 4)}
    row["tok_s"] = round(slots * new / seconds)
    print(json.dumps(row), flush=True)
    return row


def part2(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler

    model = _model()
    settings = SamplingSettings()
    rows = []
    runs = [("grouped", 8), ("split_kv", 8), ("split_kv", 1)] * repeats
    for b, new in cases:
        for attention, group in runs:
            # GRPO rows: b / group prompts, each repeated in `group` consecutive rows (1: every
            # row its own prompt, so no slot shares another's prompt columns).
            ids = torch.randint(100, 150000, (b // group, 256), device="cuda")
            ids = ids.repeat_interleave(group, 0)
            mask = torch.ones_like(ids)
            sampler = StaticSampler(model, b, 256 + new, attention=attention)
            rows.append(
                _timed_generate(sampler, ids, mask, new, settings, attention=attention, group=group)
            )
            del sampler
            torch.cuda.empty_cache()
    return rows


def part3() -> str:
    """Kernel table of the sampler's decode at 256 slots, reading 1,100-1,300 columns (a 1024-
    token prompt, 256 new tokens), with the attention the sampler picks."""
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler

    model = _model()
    ids = torch.randint(100, 150000, (256, 1024), device="cuda")
    mask = torch.ones_like(ids)
    sampler = StaticSampler(model, 256, 1024 + 256)
    settings = SamplingSettings()
    sampler.generate(ids, mask, 256, [10**9], 0, settings)  # compile and capture
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sampler.generate(ids, mask, 256, [10**9], 0, settings)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=30, max_name_column_width=60
    )
    print(f"attention={sampler.attention}\n{table}", flush=True)
    return f"attention={sampler.attention}\n{table}"


def part4(cases: list[tuple[int, int]], repeats: int) -> list[dict]:
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler
    from rlinf_twoworker.engines.static_kernels import (
        eager_race,
        exponential_noise,
        exponential_race,
    )

    model = _model()
    settings = SamplingSettings()
    rows = []
    for b, new in cases:
        ids = torch.randint(100, 150000, (b // 8, 256), device="cuda").repeat_interleave(8, 0)
        mask = torch.ones_like(ids)
        sampler = StaticSampler(model, b, 256 + new)
        compiled = sampler.kernels
        fused = torch.compile(exponential_race)

        def given(logits: torch.Tensor, temperature: float) -> torch.Tensor:
            return fused(logits, exponential_noise(logits), temperature)

        races = {"compiled": compiled.race, "given": given, "eager": eager_race}
        for race in ["compiled", "given", "eager"] * repeats:
            sampler.kernels = compiled._replace(race=races[race])
            sampler.drop_graphs()  # captured again with this race
            labels = {"attention": sampler.attention, "race": race}
            rows.append(_timed_generate(sampler, ids, mask, new, settings, **labels))
        del sampler
        torch.cuda.empty_cache()
    return rows


def positive_ints(text: str, sep: str) -> list[int] | None:
    """`text` split at `sep` as positive integers, or None where a piece is not one."""
    pieces = text.split(sep)
    if not all(piece.isdigit() and int(piece) > 0 for piece in pieces):
        return None
    return [int(piece) for piece in pieces]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    parser.add_argument("--parts", default="1,2,3")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--generate-cases",
        default="256x1792,16x768",
        help="part 2's (slots)x(new tokens) cases, comma-separated (64x7936: 8x8@8192's rollout)",
    )
    parser.add_argument("--slots", default="256,64,16", help="part 1's slot counts")
    parser.add_argument("--cache-len", type=int, default=LEN, help="part 1's cache columns")
    parser.add_argument("--widths", default="512,1024,2048", help="part 1's read widths")
    parser.add_argument(
        "--graphs",
        action="store_true",
        help="part 1 times replays of a CUDA graph of the calls (the sampler's form) instead of "
        "eager calls",
    )
    args = parser.parse_args()
    numbers = {flag: positive_ints(getattr(args, flag), ",") for flag in ("slots", "widths")}
    for flag, values in numbers.items():
        if values is None:
            parser.error(f"--{flag} {getattr(args, flag)!r}: expected positive integers, N[,N...]")
    slots, widths = numbers["slots"] or [], numbers["widths"] or []
    if max(widths) > args.cache_len:
        parser.error(f"--widths {args.widths!r}: a width passes --cache-len {args.cache_len}")
    cases = [positive_ints(case, "x") for case in args.generate_cases.split(",")]
    if not all(case is not None and len(case) == 2 for case in cases):
        parser.error(f"--generate-cases {args.generate_cases!r}: expected SLOTSxNEW[,SLOTSxNEW]")
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "1" in args.parts:
        result["attention"] = part1(slots, args.cache_len, widths, args.graphs)
        result["attention_timing"] = "cuda graph replays" if args.graphs else "eager calls"
    if "2" in args.parts:
        result["generate"] = part2([(c[0], c[1]) for c in cases if c], args.repeats)
    if "3" in args.parts:
        result["profile"] = part3()
    if "4" in args.parts:
        result["race"] = part4([(256, 1792)], args.repeats)  # 16 slots race eagerly
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
