"""One way to write a benchmark's result: provenance added, one file per configuration.

    write_result(section, configuration, hardware, payload) -> Path

adds the commit ($RLINF_COMMIT if set, else `git rev-parse HEAD`, else "unknown"), the command
(sys.argv), the versions (python, torch, ray, transformers, trl; None where not installed), the
GPU's name where there is one, and a UTC timestamp, then writes
`benchmarks/results/<section>-<configuration>-<hardware>.json`. A newer run of the same
configuration on the same hardware replaces the file: the history is git's
(`git log -p benchmarks/results/<file>`). Imports neither torch nor CUDA unless the caller has.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "ray", "transformers", "trl")


def commit() -> dict[str, str | bool | None]:
    """The library's commit: $RLINF_COMMIT where the caller sets it (a copy whose .git is not
    the tree's), else git's (and whether tracked files differ from it), else 'unknown'."""
    if os.environ.get("RLINF_COMMIT"):
        return {"commit": os.environ["RLINF_COMMIT"], "commit_dirty": None}
    here = Path(__file__).resolve().parent

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *argv], cwd=here, capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    head = git("rev-parse", "HEAD")
    if head:
        changed = git("status", "--porcelain", "--untracked-files=no")
        return {"commit": head, "commit_dirty": None if changed is None else bool(changed)}
    return {"commit": "unknown", "commit_dirty": None}


def versions() -> dict[str, str | None]:
    """Python's and the installed packages' versions, read from their metadata (no import)."""
    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_names() -> list[str]:
    """The GPUs' names: torch's where the caller has torch with CUDA up, else nvidia-smi's."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            return []
        if done.returncode == 0:
            return [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return []


def hardware_tag(names: list[str] | None = None) -> str:
    """'h200' for one NVIDIA H200, 'h200x2' for two, 'cpu' without a GPU."""
    names = gpu_names() if names is None else names
    if not names:
        return "cpu"
    model = re.sub(r"^(nvidia|amd)\s+", "", names[0].strip(), flags=re.I).split()[0].lower()
    return model if len(names) == 1 else f"{model}x{len(names)}"


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    names = gpu_names()
    return {
        **commit(),
        "command": shlex.join(sys.argv if argv is None else argv),
        "versions": versions(),
        "gpu": names[0] if names else None,
        "gpu_count": len(names),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _part(text: str) -> str:
    """A file-name part: ',' becomes '+'; characters other than letters, digits and . @ + _ -
    become '_'."""
    return re.sub(r"[^A-Za-z0-9.@+_-]", "_", text.replace(",", "+")) or "default"


def result_name(section: str, configuration: str, hardware: str) -> str:
    """`<section>-<configuration>-<hardware>.json`, e.g. scale-32x8@2048-h200.json."""
    return f"{_part(section)}-{_part(configuration)}-{_part(hardware)}.json"


def write_result(
    section: str,
    configuration: str,
    hardware: str | None,
    payload: dict[str, Any],
    out: str | Path | None = None,
    argv: list[str] | None = None,
) -> Path:
    """Write payload with its provenance (the payload's own keys win) to
    results/<section>-<configuration>-<hardware>.json, or to `out` where given; the path."""
    hardware = hardware or hardware_tag()
    record = {
        "section": section,
        "configuration": configuration,
        "hardware": hardware,
        **provenance(argv),
        **payload,
    }
    path = Path(out) if out else RESULTS / result_name(section, configuration, hardware)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
