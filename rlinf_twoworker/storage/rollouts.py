"""Every step's answers on storage: rollouts/step_<N>.jsonl under the run directory
(runner.rollout_dump, on by default), one JSON line per answer, as verl's rollout data dumps.
It is how a user reads what a run generated and graded, and sees the order of its prompts.

A line: step, data_index (the prompt's position among the training samples as loaded, the
data files in order), query_id (the data's own id when it has one), prompt, answer, reward,
advantage (the GRPO advantage of the answer, whitened where algorithm.normalize_advantages is
on), length (answer tokens, EOS included) and ended (false when the answer stopped at the token limit,
max_new_tokens, rather than at an EOS before it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROLLOUTS_DIR = "rollouts"


def rollouts_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step}.jsonl"


def write_rollouts(run_dir: Path, step: int, records: Sequence[dict[str, Any]]) -> Path:
    """Write one step's lines, whole or not at all (a temp file renamed into place)."""
    path = rollouts_path(run_dir, step)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
        out.flush()
        os.fsync(out.fileno())
    tmp.replace(path)
    return path
