"""Where a decode step's time goes: kernel table of the static sampler at one batch size.

python benchmarks/probe_decode.py [--batch 16] [--prompt 256] [--new 768]
python benchmarks/probe_decode.py --batch 256 --prompt 1024 --steps 128 --diff
python benchmarks/probe_decode.py --batch 256 --prompt 256 --start 832 --steps 128 --diff --group 8

--diff: decode steps alone. Two runs from the same prompts, of 1 + --start and of 1 + --start +
--steps new tokens, are timed and profiled; the difference per kernel name, divided by --steps,
is what one decode step at about --prompt + --start columns costs (the prefill, the first token
and the first --start steps cancel out). Attention's cost grows with the columns, so steps
around the middle of an answer (--start 832 --steps 128 after a 256-token prompt: columns
1088-1216) cost what the average step of a 1792-token answer does.

--splits N,M,...: with --diff, first the wall time of a decode step with the split-KV kernel's
column ranges per (slot, KV head) set to each (the sampler's own pick, splits_for, is printed),
its graphs captured again for each; then the profile at the sampler's own pick, whose line's
"ms wall" is the own pick's step, measured after the others (list the own pick among them, in
alternation, to compare in one order).

--group G: each prompt repeated for G slots in a row, as a GRPO group's answers (the sampler
prefills it once and the group's slots read its columns from one slot); 1: distinct prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _kernel_us(prof: torch.profiler.profile) -> dict[str, float]:
    """Device microseconds per kernel name in a profile."""
    out: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None)
        if us is None:
            us = event.self_cuda_time_total
        if us > 0:
            out[event.key] += us
    return out


def main() -> None:
    from bench_gpu import make_model_dir

    from rlinf_twoworker.engines.models import load_causal_lm
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=768)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--diff", action="store_true")
    parser.add_argument("--group", type=int, default=1)
    parser.add_argument("--splits", default="")
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    args = parser.parse_args()
    model_dir = make_model_dir(Path(args.root))
    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()
    if args.batch % args.group:
        parser.error(f"--batch {args.batch} is not a whole number of --group {args.group}")
    ids = torch.randint(100, 150000, (args.batch // args.group, args.prompt), device="cuda")
    ids = ids.repeat_interleave(args.group, 0)
    mask = torch.ones_like(ids)
    new = args.start + args.steps + 1 if args.diff else args.new
    sampler = StaticSampler(model, args.batch, args.prompt + new)
    settings = SamplingSettings()

    def run(tokens: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.generate(ids, mask, tokens, [10**9], 0, settings)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    run(new)  # compile and capture
    if not args.diff:
        for tokens in (1, new):
            print(f"generate {tokens} tokens: {run(tokens):.4f} s", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(64)
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
            )
        )
        return

    def step_ms() -> float:
        short = min(run(args.start + 1) for _ in range(3))
        long = min(run(new) for _ in range(3))
        return (long - short) / args.steps * 1e3

    own = sampler.splits
    for splits in [int(n) for n in args.splits.split(",") if n]:
        sampler.splits = splits
        sampler.drop_graphs()  # captured again with this many ranges
        run(new)  # the kernel tunes for this range count outside the capture
        ms = step_ms()
        print(
            f"splits {splits} (the sampler picks {own}): {ms:.3f} ms a step "
            f"({args.batch / ms * 1e3:,.0f} tokens/s)",
            flush=True,
        )
    if sampler.splits != own:
        sampler.splits = own
        sampler.drop_graphs()
        run(new)
    ms = step_ms()
    profiles = []
    for tokens in (args.start + 1, new):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(tokens)
        profiles.append(_kernel_us(prof))
    diff = {
        k: (profiles[1].get(k, 0.0) - profiles[0].get(k, 0.0)) / args.steps for k in profiles[1]
    }
    kernels = sum(v for v in diff.values() if v > 0) / 1e3
    print(
        f"decode step at batch {args.batch} (groups of {args.group}), from "
        f"{args.prompt + args.start} columns: {ms:.3f} ms wall, "
        f"{kernels:.3f} ms of kernels ({args.batch / ms * 1e3:,.0f} tokens/s)"
    )
    for name, us in sorted(diff.items(), key=lambda kv: -kv[1])[:30]:
        print(f"{us:9.1f} us  {100 * us / 1e3 / ms:5.1f}%  {name[:110]}")


if __name__ == "__main__":
    main()
