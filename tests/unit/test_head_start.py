"""The head start is only a head start: a component process that never gets it computes the same."""

from __future__ import annotations

import torch

from rlinf_twoworker import components
from rlinf_twoworker.api.demo import demo_config, make_inputs
from rlinf_twoworker.config import to_typed
from rlinf_twoworker.engines.models import SequenceBatch
from rlinf_twoworker.run.group import host_class

INFERENCE = "rlinf_twoworker.workers.inference:InferenceWorker"


def _batch() -> SequenceBatch:
    torch.manual_seed(0)
    ids = torch.randint(3, 60, (4, 10))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded prompt
    response = torch.ones(4, 4, dtype=torch.long)
    response[2, 3] = 0  # an answer that ended early
    return SequenceBatch(ids, mask, response, 6)


def test_a_process_without_its_head_start_computes_what_one_with_it_does(tmp_path):
    """The same inference process, once with the head start's calls (imports ahead, its
    preparation, the compile cache's save) and once with none of them: the same log-probs."""
    cfg = to_typed(demo_config(make_inputs(tmp_path / "inputs"), tmp_path, "plain", []))
    settings = components.by_name("inference").settings_for(cfg)
    batch = _batch()
    answers = []
    for head_start in (True, False):
        process = host_class(INFERENCE, "inference", False)(settings, 0)
        if head_start:
            ahead = process.import_ahead()
            assert ahead["missing"] == [] and ahead["seconds"] > 0
        process.load()
        if head_start:
            assert process.prepare_compiler() == {"seconds": {}, "cache": []}  # a CPU
        answers.append(process.call("compute_logprobs", batch).logprobs)
        if head_start:
            assert process.save_compile_cache() == {"cache": [], "compile_s": 0.0}
    with_it, without = answers
    assert torch.equal(with_it, without) and bool((with_it != 0).any())
