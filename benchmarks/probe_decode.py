"""Where a decode step's time goes: kernel table of the static sampler at one batch size.

python benchmarks/probe_decode.py [--batch 16] [--prompt 256] [--new 768]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    from bench_gpu import make_model_dir

    from rlinf_twoworker.engines.models import load_causal_lm
    from rlinf_twoworker.engines.static import SamplingSettings, StaticSampler

    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=768)
    parser.add_argument("--root", default="/tmp/rlinf-bench")
    args = parser.parse_args()
    model_dir = make_model_dir(Path(args.root))
    model = load_causal_lm(model_dir, torch.bfloat16, torch.device("cuda")).eval()
    ids = torch.randint(100, 150000, (args.batch, args.prompt), device="cuda")
    mask = torch.ones_like(ids)
    sampler = StaticSampler(model, args.batch, args.prompt + args.new)
    settings = SamplingSettings()
    sampler.generate(ids, mask, args.new, [10**9], 0, settings)  # compile and capture
    for new in (1, args.new):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.generate(ids, mask, new, [10**9], 0, settings)
        torch.cuda.synchronize()
        print(f"generate {new} tokens: {time.perf_counter() - start:.4f} s", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sampler.generate(ids, mask, 64, [10**9], 0, settings)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    )


if __name__ == "__main__":
    main()
