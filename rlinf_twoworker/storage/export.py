"""Export the actor's DCP checkpoint as a Hugging Face model directory.

The directory gets the run's model files (config.json, generation and tokenizer files, copied
from `actor.model.model_path` and `actor.tokenizer.tokenizer_model` as recorded in the run's
hydra/.hydra/config.yaml), the trained weights as `model.safetensors`, `export_info.json` (where
they came from) and a SHA256SUMS manifest. It is written under a temporary name and renamed, so
a directory under the final name is complete; an existing one is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.storage.checkpoints import (
    DCP_SUBDIR,
    CheckpointReadError,
    checkpoint_problems,
    last_complete,
)
from rlinf_twoworker.storage.manifest import MANIFEST_NAME, write_manifest
from rlinf_twoworker.storage.readback import model_state
from rlinf_twoworker.storage.rundir import CONFIG_YAML, checkpoint_dir

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
EXPORT_INFO = "export_info.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ExportResult:
    out_dir: str
    checkpoint: str
    step: int
    parameters: int
    dtype: str
    files: list[str]

    def lines(self) -> list[str]:
        """What `rlinf-twoworker export-hf` prints."""
        return [
            f"EXPORT_DIR={self.out_dir} step={self.step} checkpoint={self.checkpoint}",
            f"EXPORT_PARAMETERS={self.parameters} dtype={self.dtype}",
            f"EXPORT_FILES={','.join(self.files)}",
        ]


def export_hf(
    run_dir: str | Path, out_dir: str | Path, step: int | None = None, dtype: str | None = None
) -> ExportResult:
    """Write `out_dir` from the checkpoint of `step` (default: the newest complete one).

    `dtype` casts the weights (float32, bfloat16, float16); None keeps the checkpoint's."""
    run_dir, out_dir = Path(run_dir).resolve(), Path(out_dir).resolve()
    if dtype is not None and dtype not in DTYPES:
        raise TwoWorkerError(f"export dtype {dtype!r} is unknown; choose one of {DTYPES}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise TwoWorkerError(
            f"export directory {out_dir} already exists and is not empty; exports never "
            "overwrite: choose a new --out"
        )
    checkpoint = _checkpoint(run_dir, step)
    model_dir, tokenizer_dir = _source_dirs(run_dir)
    weights = model_state(checkpoint / DCP_SUBDIR)
    if dtype is not None:
        weights = {k: v.to(getattr(torch, dtype)) for k, v in weights.items()}
    saved_dtype = str(next(iter(weights.values())).dtype).removeprefix("torch.")
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if config.get("tie_word_embeddings") and "lm_head.weight" in weights:
        del weights["lm_head.weight"]  # tied to the embedding: transformers re-ties it on load
    staging = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _copy_model_files(model_dir, staging)
        if tokenizer_dir != model_dir:
            _copy_model_files(tokenizer_dir, staging)
        _write_config(staging / "config.json", config, saved_dtype)
        _write_weights(staging / "model.safetensors", weights)
        parameters = sum(v.numel() for v in weights.values())
        step_done = int(checkpoint.name.removeprefix("global_step_"))
        info = {
            "run_dir": str(run_dir),
            "checkpoint": str(checkpoint),
            "step": step_done,
            "parameters": parameters,
            "dtype": saved_dtype,
            "source_model": str(model_dir),
            "time": time.time(),
        }
        (staging / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        write_manifest(staging)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.rename(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    files = sorted(p.name for p in out_dir.iterdir())
    return ExportResult(str(out_dir), str(checkpoint), step_done, parameters, saved_dtype, files)


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    if step is None:
        found = last_complete(run_dir)
        if found is None:
            raise CheckpointReadError(
                f"{run_dir / 'checkpoints'} holds no complete checkpoint to export"
            )
        return found
    checkpoint = checkpoint_dir(run_dir, step)
    problems = checkpoint_problems(checkpoint)
    if problems:
        raise CheckpointReadError(problems[0])
    return checkpoint


def _source_dirs(run_dir: Path) -> tuple[Path, Path]:
    """The model and tokenizer directories the run trained from (its resolved config)."""
    path = run_dir / CONFIG_YAML
    try:
        cfg: Any = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        model = Path(cfg["actor"]["model"]["model_path"])
        tokenizer = Path(cfg["actor"].get("tokenizer", {}).get("tokenizer_model") or model)
    except Exception as exc:  # missing file or keys: say which file
        raise CheckpointReadError(
            f"{path} cannot give actor.model.model_path ({type(exc).__name__}: {exc}); the run's "
            "resolved config is missing or damaged"
        ) from exc
    if not (model / "config.json").is_file():
        raise CheckpointReadError(
            f"{model / 'config.json'} (the run's actor.model.model_path) is not readable here; "
            "mount the storage that holds the model on this machine"
        )
    if not tokenizer.is_dir():
        raise CheckpointReadError(f"tokenizer directory {tokenizer} (from {path}) is missing")
    return model, tokenizer


def _copy_model_files(source: Path, target: Path) -> None:
    """Every file but the weights and the manifest (config, generation, tokenizer files)."""
    for item in sorted(source.iterdir()):
        if (
            item.is_file()
            and item.name != MANIFEST_NAME
            and not item.name.endswith(WEIGHT_SUFFIXES + (".index.json",))
        ):
            shutil.copyfile(item, target / item.name)  # a new file: its mode from the umask


def _write_config(path: Path, config: dict[str, Any], dtype: str) -> None:
    config = dict(config, dtype=dtype)
    if "torch_dtype" in config:  # older transformers name the same setting torch_dtype
        config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _write_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in weights.items()}, str(path), {"format": "pt"})
    path.chmod(umask_mode())  # safetensors writes 0600: give it what any new file gets


def umask_mode() -> int:
    """The mode a new file gets under the process's umask (0644 under 022, 0600 under 077)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask
