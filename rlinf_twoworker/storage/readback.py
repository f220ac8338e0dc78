"""Read a finished run back from shared storage, on any machine: no Ray, no GPU (SCENARIO.md 6).

`readback(run_dir)` checks verification.json, the checkpoint's `.metadata`, shards and data.pt,
then loads every tensor of the DCP checkpoint into memory with `torch.distributed.checkpoint` in
a single process. Tensors are loaded in batches of at most `batch_bytes`, so the optimiser state
of a 1.5 B model never has to fit in memory at once. Any problem raises CheckpointReadError with
one line that names the file.
"""

from __future__ import annotations

import io
import json
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlinf_twoworker.storage.checkpoints import (
    DATA_FILE,
    DCP_SUBDIR,
    MODEL_PREFIX,
    CheckpointReadError,
    checkpoint_problems,
    dcp_problems,
    files_of,
    last_complete,
    read_metadata,
)
from rlinf_twoworker.storage.rundir import VERIFICATION_JSON, checkpoint_dir

BATCH_BYTES = 1 << 30


@dataclass
class Readback:
    """What was read: the checkpoint, its files and the model's parameter count."""

    run_dir: str
    checkpoint_dir: str
    step: int
    files: dict[str, int] = field(default_factory=dict)
    """Path relative to checkpoint_dir -> size in bytes."""
    parameters: int = 0
    """Elements of the model's tensors (the optimiser state not counted)."""
    tensors: int = 0
    """Every tensor loaded, optimiser state and RNG included."""
    loaded_bytes: int = 0

    @property
    def shards(self) -> dict[str, int]:
        return {k: v for k, v in self.files.items() if k.endswith(".distcp")}

    def lines(self) -> list[str]:
        """What `rlinf-twoworker readback` prints: every file with its size, then the counts."""
        files = [
            f"READBACK_{'SHARD' if name.endswith('.distcp') else 'FILE'}={name} size={size}"
            for name, size in self.files.items()
        ]
        return [
            f"READBACK_CHECKPOINT={self.checkpoint_dir} step={self.step}",
            *files,
            f"READBACK_TENSORS={self.tensors} bytes={self.loaded_bytes}",
            f"READBACK_PARAMETERS={self.parameters}",
        ]


def existing_run_dir(run_dir: str | Path) -> Path:
    """`run_dir` resolved, for a command that reads a finished run; CheckpointReadError where
    it is not a directory here."""
    run_dir = Path(run_dir).resolve()
    if not run_dir.is_dir():
        raise CheckpointReadError(
            f"run directory {run_dir} does not exist; check the path and that the shared "
            "storage is mounted on this machine"
        )
    return run_dir


def readback(
    run_dir: str | Path, step: int | None = None, batch_bytes: int = BATCH_BYTES
) -> Readback:
    """Check and load the checkpoint of step `step` (default: the one verification.json names)."""
    run_dir = existing_run_dir(run_dir)
    verification = _verification(run_dir)
    checkpoint = _choose_checkpoint(run_dir, verification, step)
    if checkpoint.name == Path(verification.get("checkpoint_dir") or "").name:
        _compare_sizes(checkpoint, verification.get("checkpoint_files") or {})
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise CheckpointReadError(problems[0])
    _load_data_file(checkpoint / DATA_FILE)
    result = Readback(str(run_dir), str(checkpoint), int(checkpoint.name.rsplit("_", 1)[1]))
    result.files = files_of(checkpoint)
    dcp_dir = checkpoint / DCP_SUBDIR
    for batch in _batches(dcp_dir, batch_bytes):
        for key, value in load_dcp(dcp_dir, batch).items():
            if isinstance(value, torch.Tensor):
                result.tensors += 1
                result.loaded_bytes += value.numel() * value.element_size()
                if key.startswith(MODEL_PREFIX):
                    result.parameters += value.numel()
    return result


def _verification(run_dir: Path) -> dict[str, Any]:
    path = run_dir / VERIFICATION_JSON
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointReadError(
            f"{path} is missing: the run's postflight never finished; run "
            "`rlinf-twoworker verify` on the run directory first"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointReadError(f"{path} cannot be read as JSON ({exc}): it is damaged") from exc
    if not isinstance(report, dict) or report.get("passed") is not True:
        errors = report.get("errors") if isinstance(report, dict) else None
        first = (errors or ["no 'passed': true"])[0]
        raise CheckpointReadError(f"{path} says the postflight did not pass: {first}")
    return report


def _choose_checkpoint(run_dir: Path, verification: dict[str, Any], step: int | None) -> Path:
    if step is not None:
        return checkpoint_dir(run_dir, step)
    named = verification.get("checkpoint_dir")
    if named:  # the storage may be mounted elsewhere here: keep only the directory's name
        return checkpoint_dir(run_dir, int(Path(named).name.removeprefix("global_step_")))
    found = last_complete(run_dir)
    if found is None:
        raise CheckpointReadError(f"{run_dir / 'checkpoints'} holds no complete checkpoint")
    return found


def _compare_sizes(checkpoint: Path, recorded: dict[str, int]) -> None:
    """The postflight recorded every file's size: a file now missing or resized is damage."""
    for name, size in sorted(recorded.items()):
        path = checkpoint / name
        if not path.is_file():
            raise CheckpointReadError(f"{path} is missing (verification.json lists {size} bytes)")
        if path.stat().st_size != size:
            raise CheckpointReadError(
                f"{path} has {path.stat().st_size} bytes but verification.json recorded {size}: "
                "the file changed or was truncated after the run"
            )


def _load_data_file(path: Path) -> None:
    try:
        torch.load(path, weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise CheckpointReadError(
            f"{path} cannot be loaded ({type(exc).__name__}: {first})"
        ) from exc


def _batches(dcp_dir: Path, batch_bytes: int) -> Iterator[list[str]]:
    """Keys of the checkpoint in groups of at most batch_bytes of tensor data."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    batch: list[str] = []
    size = 0
    for key, entry in read_metadata(dcp_dir).state_dict_metadata.items():
        nbytes = 0
        if isinstance(entry, TensorStorageMetadata):
            nbytes = entry.size.numel() * torch.empty((), dtype=entry.properties.dtype).itemsize
        if batch and size + nbytes > batch_bytes:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += nbytes
    if batch:
        yield batch


def load_dcp(dcp_dir: Path, keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Load the given flattened DCP keys (default: all) into CPU memory, without a process
    group. Raises CheckpointReadError naming the damaged file."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from rlinf_twoworker.storage.safe_dcp import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        refusal_in,
    )

    metadata = read_metadata(dcp_dir)
    entries = metadata.state_dict_metadata
    state: dict[str, Any] = {}
    for key in list(entries) if keys is None else keys:
        entry = entries[key]
        is_tensor = isinstance(entry, TensorStorageMetadata)
        state[key] = torch.empty(entry.size, dtype=entry.properties.dtype) if is_tensor else None
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(str(dcp_dir)),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        refused = refusal_in(exc)
        if refused is not None:
            raise refused from exc
        raise CheckpointReadError(_read_failure(Path(dcp_dir), metadata, exc)) from exc
    return state


def _read_failure(dcp_dir: Path, metadata: Any, exc: BaseException) -> str:
    """Name the shard that broke a load: re-read each stored tensor on its own."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    problems = dcp_problems(dcp_dir)
    if problems:
        return problems[0]
    for index, info in metadata.storage_data.items():
        entry = metadata.state_dict_metadata.get(index.fqn)
        if info.transform_descriptors or not isinstance(entry, TensorStorageMetadata):
            continue  # compressed items and pickled objects need DCP's own reader
        shard = dcp_dir / info.relative_path
        with open(shard, "rb") as handle:
            handle.seek(info.offset)
            blob = handle.read(info.length)
        try:
            torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as item_exc:
            reason = (str(item_exc).splitlines() or [""])[0][:120]
            return (
                f"shard {shard} is damaged: {index.fqn} at byte {info.offset} cannot be read "
                f"({type(item_exc).__name__}: {reason})"
            )
    cause = " ".join(str(exc).split())[:200]
    return f"checkpoint {dcp_dir} cannot be loaded ({type(exc).__name__}: {cause})"


def model_state(dcp_dir: Path) -> dict[str, torch.Tensor]:
    """The actor model's full (unsharded) weights, keyed by their Hugging Face names."""
    keys = [k for k in read_metadata(dcp_dir).state_dict_metadata if k.startswith(MODEL_PREFIX)]
    if not keys:
        raise CheckpointReadError(
            f"{Path(dcp_dir) / '.metadata'} has no '{MODEL_PREFIX}*' keys: not an actor checkpoint"
        )
    return {k.removeprefix(MODEL_PREFIX): v for k, v in load_dcp(dcp_dir, keys).items()}
