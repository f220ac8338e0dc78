"""Model loading errors and the batch layout, without Ray."""

from __future__ import annotations

import json

import pytest
import torch

from rlinf_twoworker.demo import make_inputs
from rlinf_twoworker.errors import TwoWorkerError
from rlinf_twoworker.models import SequenceBatch, load_causal_lm
from rlinf_twoworker.rollout import left_pad, response_mask


def test_a_model_that_is_not_a_causal_lm_is_refused(tmp_path):
    inputs = make_inputs(tmp_path)
    config = inputs.model_path / "config.json"
    config.write_text(
        json.dumps({**json.loads(config.read_text()), "architectures": ["BertModel"]})
    )
    with pytest.raises(TwoWorkerError, match=r"is \['BertModel'\], not a causal LM"):
        load_causal_lm(inputs.model_path, torch.float32, torch.device("cpu"))
    with pytest.raises(TwoWorkerError, match="has no config.json"):
        load_causal_lm(tmp_path / "nowhere", torch.float32, torch.device("cpu"))


def test_left_padding_positions_and_response_mask():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    responses = torch.tensor([[3, 2, 9, 9], [4, 4, 4, 4]])  # 2 is EOS; 9 pads after it
    resp = response_mask(responses, eos_ids=[2])
    assert resp.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]  # EOS itself is part of the answer
    batch = SequenceBatch(torch.cat([ids, responses], 1), torch.cat([mask, resp], 1), resp, 3)
    assert batch.position_ids[1].tolist()[:4] == [0, 0, 0, 1]  # real tokens count from 0
    assert batch.responses.tolist() == responses.tolist()


def test_weights_travel_in_the_rollouts_dtype():
    from rlinf_twoworker.config import load_config, to_typed
    from rlinf_twoworker.grpo_step import sync_dtype

    def dtype(*overrides: str) -> str:
        return sync_dtype(to_typed(load_config(overrides=overrides)))

    assert dtype() == "bfloat16"  # the rollout's default precision on GPUs
    assert dtype("rollout.model.precision=fp16") == "float16"
    assert dtype("cluster.accelerator=cpu") == "float32"  # CPUs always run fp32
