"""A compile cache on shared storage: the second run of a model shape skips compilation.

torch.compile's own caches (Inductor's FX-graph cache, AOTAutograd's cache, Triton's kernels)
live in a per-host temp directory, so every fresh node compiles again. PyTorch can serialise
what one process compiled (`torch.compiler.save_cache_artifacts`) and load it into another
process before it compiles (`torch.compiler.load_cache_artifacts`); this module keeps those
artifacts on shared storage, one file per component and key:

    <runner.compile_cache_dir>/<key>/<component>.bin

The key names everything the compiled code depends on: torch, transformers and Triton versions,
Python, the device, the model's architecture fields and dtype (`cache_key`). A file is a magic
line, the payload's SHA-256 and the payload; it is written to a temp file and renamed, under a
file lock, so runs that share the cache never read a half-written entry and the last writer
wins with a whole one. An entry that does not verify or does not load is reported, moved aside
(`<component>.bin.corrupt`) and compiled afresh; a cache problem never fails a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlinf_twoworker.storage.private_dir import private_dir_problem

MAGIC = b"rlinf-twoworker compile cache v1\n"
DIGEST_BYTES = 32
LOCK_TIMEOUT_S = 60.0

# Fields of a model config that do not change the compiled code.
_NOT_SHAPE = {
    "_name_or_path",
    "transformers_version",
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
}


def versions() -> dict[str, str]:
    """The software the compiled code depends on."""
    found = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "triton"):
        try:
            found[name] = __import__(name).__version__
        except ImportError:
            found[name] = "absent"
    return found


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine()}"


def cache_key(model_config: dict[str, Any], dtype: torch.dtype, device: torch.device) -> str:
    """`<model_type>-<16 hex digits>`: equal for two processes exactly when their versions,
    device, dtype and model architecture agree (names and token ids aside)."""
    shape = {k: v for k, v in model_config.items() if k not in _NOT_SHAPE}
    identity = {
        "versions": versions(),
        "device": device_name(device),
        "dtype": str(dtype),
        "model": shape,
    }
    text = json.dumps(identity, sort_keys=True, default=str)
    model_type = str(model_config.get("model_type", "model")).replace(os.sep, "_")
    return f"{model_type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _compiled_afresh() -> int:
    """How many graphs this process compiled without a cache hit (Inductor's FX-graph cache
    misses): graphs served from a loaded entry do not count, so a warm run writes nothing."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile (Dynamo's own accounting; 0.0 where
    the running torch does not keep it)."""
    try:
        from torch._dynamo.utils import compile_times

        names, values = compile_times(repr="csv", aggregate=True)
        times = dict(zip(names, values))
        return float(str(times.get("_compile.compile_inner", 0.0)))
    except Exception:  # a private API: its absence must not fail a run
        return 0.0


@dataclass
class CacheEvent:
    """What the cache did, for the run's log: `state` is off, skipped (a directory others
    could write: not used), cold (no entry), warm (loaded), corrupt (an entry that did not
    load: moved aside) or saved."""

    state: str
    path: str = ""
    detail: str = ""

    def line(self, who: str) -> str:
        where = f" {self.path}" if self.path else ""
        more = f" ({self.detail})" if self.detail else ""
        return f"COMPILE_CACHE {who} {self.state}{where}{more}"


class CompileCache:
    """One component process's entry in the shared compile cache."""

    def __init__(self, root: str | Path | None, component: str, key: str) -> None:
        self.path = Path(root) / key / f"{component}.bin" if root else None
        self.compiled_at_save = 0
        self.events: list[CacheEvent] = []

    def load(self) -> CacheEvent:
        """Load the entry into this process's compile caches; call it before anything is
        compiled."""
        event = self._load()
        self.compiled_at_save = _compiled_afresh()
        self.events.append(event)
        return event

    def _load(self) -> CacheEvent:
        if self.path is None:
            return CacheEvent("off")
        problem = private_dir_problem(self.path.parent.parent)  # its entries load as code
        if problem is not None:
            self.path = None  # neither read nor written
            return CacheEvent("skipped", "", problem)
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return CacheEvent(
                "cold", str(self.path), "no entry yet: this run compiles and saves it"
            )
        except OSError as exc:
            return CacheEvent("cold", str(self.path), f"unreadable, compiling afresh: {exc}")
        problem = _verify(blob)
        if problem is None:
            try:
                # torch returns None (with a warning) for artifacts it cannot read.
                if torch.compiler.load_cache_artifacts(blob[len(MAGIC) + DIGEST_BYTES :]):
                    return CacheEvent("warm", str(self.path), f"{len(blob)} bytes loaded")
                problem = "torch could not load it (not artifacts of this torch)"
            except Exception as exc:  # any loader failure: compile afresh
                problem = f"torch could not load it: {type(exc).__name__}: {exc}"
        aside = self.path.with_name(self.path.name + ".corrupt")
        try:
            os.replace(self.path, aside)
        except OSError:
            aside = self.path
        return CacheEvent(
            "corrupt",
            str(self.path),
            f"{problem}; compiling afresh, kept as {aside.name}, a new entry replaces it",
        )

    def save_if_new(self) -> CacheEvent | None:
        """Save this process's compiled artifacts when it compiled something afresh since the
        last load or save (call it after compiled work); None when there was nothing new."""
        if self.path is None or _compiled_afresh() <= self.compiled_at_save:
            return None
        self.compiled_at_save = _compiled_afresh()
        try:
            artifacts = torch.compiler.save_cache_artifacts()
            if artifacts is None:
                return None
            payload = artifacts[0]
            blob = MAGIC + hashlib.sha256(payload).digest() + payload
            _write_atomically(self.path, blob)
            event = CacheEvent("saved", str(self.path), f"{len(blob)} bytes")
        except Exception as exc:  # a full or read-only disk must not fail the run
            event = CacheEvent("unsaved", str(self.path), f"{type(exc).__name__}: {exc}")
        self.events.append(event)
        return event


def _verify(blob: bytes) -> str | None:
    """Why `blob` is not a whole entry, or None."""
    if not blob.startswith(MAGIC):
        return "not a compile-cache entry of this library (bad header)"
    digest = blob[len(MAGIC) : len(MAGIC) + DIGEST_BYTES]
    payload = blob[len(MAGIC) + DIGEST_BYTES :]
    if len(digest) < DIGEST_BYTES or hashlib.sha256(payload).digest() != digest:
        return "checksum mismatch (truncated or overwritten)"
    return None


def _write_atomically(path: Path, blob: bytes) -> None:
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=LOCK_TIMEOUT_S):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(blob)
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def for_model(
    root: str | Path | None, component: str, model: Any, device: torch.device
) -> CompileCache:
    """The cache entry of `component` for a loaded transformers model."""
    dtype = next(model.parameters()).dtype
    return CompileCache(root, component, cache_key(model.config.to_dict(), dtype, device))


__all__ = [
    "CacheEvent",
    "CompileCache",
    "cache_key",
    "compile_seconds",
    "for_model",
    "versions",
    "device_name",
]
