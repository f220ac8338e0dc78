"""What the examples share: where the config comes from and which cluster they run on.

`--config FILE` (and overrides) is a real run on the cluster this machine belongs to (or
`--address`). `--demo` swaps in the embedded demo inputs (a tiny model, CPU-sized settings);
`--local` also starts a 2-node Ray cluster on this machine, so an example runs anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rlinf_twoworker import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="a YAML config in RLinf's layout")
    parser.add_argument("--address", default=None, help="Ray address (default: auto)")
    parser.add_argument("--local", action="store_true", help="start a 2x2 cluster here (demo)")
    parser.add_argument("--demo", action="store_true", help="use the embedded demo inputs")
    parser.add_argument("--output-root", default="example-runs", help="for --demo/--local")
    parser.add_argument("--run-id", default=None, help="for --demo/--local (default: a time)")
    parser.add_argument("overrides", nargs="*", help="config overrides (a.b=c)")


def config_of(args: argparse.Namespace, name: str) -> Any:
    """The run's config: the demo's (with --demo or --local) or --config plus overrides."""
    if not (args.demo or args.local):
        return load_config(args.config, args.overrides)
    from rlinf_twoworker.api.demo import demo_config, make_inputs

    root = Path(args.output_root).resolve()
    run_id = args.run_id or time.strftime(f"{name}-%Y%m%d-%H%M%S")
    inputs = make_inputs(root / f".inputs-{run_id}")  # the demo's task and model
    return demo_config(inputs, root, run_id, args.overrides)


def cluster_of(args: argparse.Namespace) -> AbstractContextManager[Any]:
    """A LocalCluster for --local (this process connects to it); otherwise nothing to start."""
    if not args.local:
        return contextlib.nullcontext()
    from rlinf_twoworker.cluster.local import LocalCluster

    return LocalCluster(num_nodes=2, gpus_per_node=2)
