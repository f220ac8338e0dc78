"""Prompts: reading AReaL-boba JSONL files, a resumable seeded sampler, and prompt tokenisation.

The sampler's state is a handful of plain ints so that it rides in a checkpoint's `data.pt`
(loadable with `torch.load(weights_only=True)`) and a resumed run draws exactly the prompts the
uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rlinf_twoworker.errors import TwoWorkerError

logger = logging.getLogger(__name__)

_SKIP_HINT = "set data.skip_malformed_lines=true to skip such lines"


class DataError(TwoWorkerError):
    """The training data cannot be read, or a sampler state does not fit the data."""


@dataclass
class Sample:
    prompt: str
    """The full prompt text, chat markup included (AReaL-boba prompts carry it)."""
    solutions: list[str]
    """Gold answers; an answer matching any of them is correct."""
    query_id: str | None = None
    row: dict[str, Any] | None = None
    """The line's whole JSON object, kept only when asked (load_jsonl keep_rows: a
    reward.reward_fn gets it); None otherwise, so a large data set is not held twice."""


def _parse_line(line: str, prompt_key: str, answer_key: str, keep_row: bool = False) -> Sample:
    """One JSONL line as a Sample; raises ValueError with the problem in words."""
    try:
        # Without its newline: a line cut short is reported at its own end, not at column 1
        # of the line after it.
        obj: Any = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    prompt = obj.get(prompt_key)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"key '{prompt_key}' (data.prompt_key) must be a non-empty string")
    solutions = obj.get(answer_key)
    if isinstance(solutions, str):
        solutions = [solutions]
    if (
        not isinstance(solutions, list)
        or not solutions
        or not all(isinstance(s, str) for s in solutions)
    ):
        raise ValueError(
            f"key '{answer_key}' (data.answer_key) must be a string or a non-empty list of strings"
        )
    query_id = obj.get("query_id")
    row = obj if keep_row else None
    return Sample(prompt, solutions, None if query_id is None else str(query_id), row)


def _read_file(
    path: Path, prompt_key: str, answer_key: str, skip_malformed: bool, keep_rows: bool = False
) -> tuple[list[Sample], list[str]]:
    """Samples of one file and descriptions of the lines skipped."""
    samples, skipped = [], []
    try:
        with path.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    samples.append(_parse_line(line, prompt_key, answer_key, keep_rows))
                except ValueError as exc:
                    where = f"{path}:{lineno}: {exc}"
                    if not skip_malformed:
                        raise DataError(f"malformed line {where}; fix it or {_SKIP_HINT}") from None
                    skipped.append(where)
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"cannot read data file {path} ({exc}); check data.train_data_paths"
        ) from exc
    return samples, skipped


def data_file_problem(path: Path, prompt_key: str, answer_key: str) -> str | None:
    """The first malformed line of one data file, as the run's load would report it, or None:
    every line parsed as the run parses it, nothing kept (the request's check, in seconds)."""
    try:
        with Path(path).open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    _parse_line(line, prompt_key, answer_key)
                except ValueError as exc:
                    return f"malformed line {path}:{lineno}: {exc}; fix it or {_SKIP_HINT}"
    except (OSError, UnicodeDecodeError) as exc:
        return f"cannot read data file {path} ({exc}); check data.train_data_paths"
    return None


def load_jsonl(
    paths: Sequence[str],
    prompt_key: str = "prompt",
    answer_key: str = "solutions",
    skip_malformed: bool = False,
    log: Callable[[str], None] | None = None,
    keep_rows: bool = False,
) -> list[Sample]:
    """All samples of the given AReaL-boba JSONL files, in file then line order.

    Blank lines are ignored. A malformed line fails the load naming file and line, unless
    `skip_malformed`, in which case it is skipped and the count logged (a silently shrunken data
    set would be a surprise). No sample at all is an error either way. `keep_rows`: each
    Sample keeps its line's JSON object (Sample.row), for a reward.reward_fn.
    """
    samples: list[Sample] = []
    skipped: list[str] = []
    for path in paths:
        got, bad = _read_file(Path(path), prompt_key, answer_key, skip_malformed, keep_rows)
        samples.extend(got)
        skipped.extend(bad)
    if skipped:
        note = (
            f"skipped {len(skipped)} malformed line(s) in {list(paths)} "
            f"(data.skip_malformed_lines=true); first: {skipped[0]}"
        )
        (log or logger.warning)(note)
    if not samples:
        raise DataError(
            f"no samples in {list(paths)}: the files hold no valid lines; check "
            "data.train_data_paths"
        )
    return samples


class PromptSampler:
    """Seeded, resumable sampler of prompt indices, one rollout batch at a time, in RLinf's order.

    RLinf's reasoning runner (rlinf/runners/reasoning_runner.py:166-186) loads prompts with a
    torch `RandomSampler` whose `torch.Generator` is seeded once with data.seed, batched with
    drop_last: epoch e is the generator's (2e+1)-th `torch.randperm(num_samples)`, because each
    finished epoch draws a second, empty permutation (`RandomSampler.__iter__` draws
    `randperm(n)[: num_samples % n]` after the full one, and drop_last batching runs the
    iterator to its end). Without data.shuffle (RLinf's `SequentialSampler`) every epoch is
    range(num_samples). Batches are consecutive slices of the epoch's order; the tail shorter
    than batch_size is dropped and the next epoch starts. Any epoch's order is recomputed from
    (seed, epoch), so the state is two ints and a resumed run draws exactly the prompts the
    uninterrupted run would have drawn.
    """

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool, seed: int) -> None:
        if batch_size < 1 or batch_size > num_samples:
            raise DataError(
                f"data.rollout_batch_size={batch_size} must be between 1 and the number of "
                f"samples ({num_samples})"
            )
        if seed < 0:
            raise DataError(f"data.seed={seed} must be >= 0")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch, self.position = 0, 0
        self._perm_epoch = -1
        self._perm: list[int] = list(range(num_samples))
        self._generator: Any = None
        self._drawn = 0  # permutations the generator has drawn since it was seeded

    def _permutation(self) -> list[int]:
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                self._perm = self._rlinf_order(self.epoch)
            self._perm_epoch = self.epoch
        return self._perm

    def _rlinf_order(self, epoch: int) -> list[int]:
        """Epoch `epoch`'s order: the generator's draw 2 x epoch (counting from 0)."""
        import torch  # here, not at import: the controller starts before torch is imported

        if self._generator is None or self._drawn > 2 * epoch:
            self._generator = torch.Generator()
            self._generator.manual_seed(self.seed)
            self._drawn = 0
        while True:
            perm = torch.randperm(self.num_samples, generator=self._generator)
            self._drawn += 1
            if self._drawn > 2 * epoch:
                return [int(i) for i in perm.tolist()]

    def next_batch(self) -> list[int]:
        """The next batch_size sample indices."""
        if self.position + self.batch_size > self.num_samples:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._permutation()[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int | bool]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where a saved sampler stopped; the data and settings must be the same."""
        missing = {"epoch", "position", "seed", "num_samples", "batch_size"} - set(state)
        if missing:
            raise DataError(f"sampler state lacks {sorted(missing)}; the checkpoint is incomplete")
        for key, setting in (
            ("num_samples", "the data set (data.train_data_paths)"),
            ("batch_size", "data.rollout_batch_size"),
            ("seed", "data.seed"),
            ("shuffle", "data.shuffle"),
        ):
            saved, now = state.get(key, getattr(self, key)), getattr(self, key)
            if saved != now:
                raise DataError(
                    f"cannot resume the prompt sampler: {key} was {saved} in the checkpoint but "
                    f"is {now} now; resume with the same {setting}"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


def validation_samples(pool: Sequence[Sample], cfg: Any) -> list[Sample]:
    """The validation prompts of a run, fixed for its whole length: data.val_num_prompts
    (default data.rollout_batch_size) of `pool`, drawn with data.seed when
    data.validation_shuffle, else the first ones."""
    data = cfg.data
    count = min(len(pool), data.val_num_prompts or data.rollout_batch_size)
    if not data.validation_shuffle:
        return list(pool[:count])
    order = np.random.default_rng([data.seed, 7]).permutation(len(pool))[:count]
    return [pool[int(i)] for i in order]


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[str],
    max_prompt_length: int,
    add_special_tokens: bool = True,
    log: Callable[[str], None] = logger.warning,
) -> list[list[int]]:
    """Token ids of each prompt, cut to its first max_prompt_length tokens, as RLinf does.

    Special tokens are added as the tokenizer does by default, as RLinf's `tokenizer.encode`
    does: for DeepSeek-R1-Distill that is the BOS token its chat template puts before
    `<｜User｜>`, which AReaL-boba prompts lack. A prompt that already starts with the BOS text
    is encoded without them, so BOS never doubles (RLinf would double it). A longer prompt
    keeps its first max_prompt_length tokens, BOS included, as RLinf's ReasoningDataset does
    (rlinf/data/datasets/reasoning/dataset.py:231-239: `tokenizer.encode`, then
    `[: max_prompt_length]`), so the cut drops the end of the prompt, with the
    `<｜Assistant｜><think>` cue; one warning counts the prompts cut.
    """
    bos = getattr(tokenizer, "bos_token", None)
    encoded: list[list[int]] = []
    for prompt in prompts:
        special = add_special_tokens and not (bos and prompt.startswith(bos))
        encoded.append(list(tokenizer(prompt, add_special_tokens=special)["input_ids"]))
    too_long = [len(ids) for ids in encoded if len(ids) > max_prompt_length]
    if too_long:
        log(
            f"{len(too_long)} of {len(encoded)} prompts exceed data.max_prompt_length="
            f"{max_prompt_length} tokens (longest {max(too_long)}) and were cut to their first "
            f"{max_prompt_length} tokens, as RLinf cuts them (their ends, where the answer cue "
            "sits, are lost); raise data.max_prompt_length to keep them whole"
        )
    return [ids[:max_prompt_length] for ids in encoded]
