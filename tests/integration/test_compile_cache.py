"""The shared compile cache: its key, a corrupt entry, and runs that share one cache.

Each "run" is a fresh Python process with its own empty Inductor cache directory
(TORCHINDUCTOR_CACHE_DIR), so the only way it can skip compilation is the shared entry; it
compiles the decoder layers of a tiny transformers model the way the components do
(`compile_layers`) and reports torch's cache-hit counters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from support import tiny_lm
from transformers import Qwen2Config

from rlinf_twoworker.engines import compile_cache
from rlinf_twoworker.engines.compile_cache import MAGIC, CompileCache, cache_key
from rlinf_twoworker.engines.models import compile_layers

CPU = torch.device("cpu")


def _config(**changes) -> dict:
    base = Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
    )
    for name, value in changes.items():
        setattr(base, name, value)
    return base.to_dict()


def test_the_key_follows_shape_dtype_device_and_software_not_names(monkeypatch):
    key = cache_key(_config(), torch.float32, CPU)
    assert key.startswith("qwen2-") and key == cache_key(_config(), torch.float32, CPU)
    # Names and token ids do not change the compiled code.
    assert key == cache_key(_config(_name_or_path="/elsewhere", eos_token_id=7), torch.float32, CPU)
    # The architecture, the dtype and the software do.
    assert key != cache_key(_config(hidden_size=64), torch.float32, CPU)
    assert key != cache_key(_config(num_hidden_layers=4), torch.float32, CPU)
    assert key != cache_key(_config(), torch.bfloat16, CPU)
    assert key != cache_key(_config(), torch.float32, torch.device("meta"))
    real = compile_cache.versions()
    monkeypatch.setattr(compile_cache, "versions", lambda: {**real, "torch": "0.0.0"})
    assert key != cache_key(_config(), torch.float32, CPU)


def test_an_off_cache_and_a_missing_entry_compile_without_complaint(tmp_path):
    off = CompileCache(None, "actor", "k")
    assert off.load().state == "off" and off.save_if_new() is None
    cold = CompileCache(tmp_path, "actor", "k").load()
    assert cold.state == "cold" and "no entry yet" in cold.detail


RUN = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM
    from rlinf_twoworker.engines import compile_cache
    from rlinf_twoworker.engines.models import compile_layers

    model_dir, root = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = compile_cache.for_model(root, "inference", model, torch.device("cpu"))
    loaded = cache.load()
    compile_layers(model, True)
    ids = torch.arange(12).view(2, 6) % 64
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    saved = cache.save_if_new()
    print(json.dumps({
        "loaded": loaded.state, "loaded_detail": loaded.detail,
        "saved": None if saved is None else saved.state,
        "hits": counters["inductor"]["fxgraph_cache_hit"],
        "misses": counters["inductor"]["fxgraph_cache_miss"],
        "graphs": counters["stats"]["unique_graphs"],
        "checksum": float(logits.double().sum()),
    }))
    """
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("model")
    tiny_lm(layers=3).save_pretrained(directory)  # _config()'s shape
    return directory


def _start(model: Path, root: Path, inductor: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(inductor),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-c", RUN, str(model), str(root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _run(model: Path, root: Path, inductor: Path) -> dict:
    return _finish(_start(model, root, inductor))


@pytest.fixture(scope="module")
def cold(tiny_model, tmp_path_factory) -> tuple[Path, list[dict]]:
    """Two runs at once on one empty cache: (the cache, their results)."""
    tmp = tmp_path_factory.mktemp("cold")
    root = tmp / "cache"
    first = [_start(tiny_model, root, tmp / f"inductor-{i}") for i in range(2)]
    return root, [_finish(p) for p in first]


def test_two_runs_share_one_cache_and_a_third_starts_warm(tiny_model, cold, tmp_path):
    root, results = cold
    # Two runs at once, both cold: both compile, both save, neither sees a half-written entry.
    for result in results:
        assert result["loaded"] == "cold" and result["saved"] == "saved"
        assert result["misses"] > 0 and result["hits"] == 0
    # One compiled graph serves every decoder layer (3 layers here).
    assert results[0]["graphs"] == 1
    entries = list(root.glob("*/inference.bin"))
    assert len(entries) == 1 and entries[0].read_bytes().startswith(MAGIC)
    assert not [p for p in entries[0].parent.iterdir() if p.name.startswith(".inference.bin.")]
    # A later run, with an empty local cache, compiles nothing: every graph comes from the entry.
    warm = _run(tiny_model, root, tmp_path / "inductor-warm")
    assert warm["loaded"] == "warm" and warm["hits"] > 0 and warm["misses"] == 0
    assert warm["saved"] is None  # nothing compiled afresh: the entry is not rewritten
    assert warm["checksum"] == pytest.approx(results[0]["checksum"], rel=1e-6)


def test_a_corrupt_entry_is_reported_moved_aside_and_replaced(tiny_model, cold, tmp_path):
    root = shutil.copytree(cold[0], tmp_path / "cache")  # a copy of the cold runs' cache
    first = cold[1][0]
    (entry,) = root.glob("*/inference.bin")
    whole = entry.read_bytes()
    entry.write_bytes(whole[: len(whole) // 2])  # a truncated write, say
    broken = _run(tiny_model, root, tmp_path / "inductor-b")
    assert broken["loaded"] == "corrupt" and "checksum mismatch" in broken["loaded_detail"]
    assert broken["misses"] > 0 and broken["saved"] == "saved"  # compiled afresh, replaced
    assert entry.with_name("inference.bin.corrupt").exists()
    assert broken["checksum"] == pytest.approx(first["checksum"], rel=1e-6)
    # The new entry loads (here: a load compiles nothing; a warm run's hits are shown above).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert compile_cache.for_model(root, "inference", model, CPU).load().state == "warm"
    # A payload torch cannot load (right header and checksum, wrong content) is found corrupt
    # and moved aside on load too (what follows is the compilation above).
    payload = b"not torch artifacts"
    import hashlib

    entry.with_name("inference.bin.corrupt").unlink()  # the truncated one, looked at above
    entry.write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
    alien = compile_cache.for_model(root, "inference", model, CPU).load()  # here: no compiling
    assert alien.state == "corrupt" and "torch could not load it" in alien.detail
    assert entry.with_name("inference.bin.corrupt").read_bytes().endswith(payload)
    assert not entry.exists()


def test_compiled_layers_are_one_graph(tiny_model):
    """All identical decoder layers share one compilation (use_cache=False, as the components
    run them)."""
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    torch._dynamo.reset()
    counters.clear()
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    compile_layers(model, True)
    with torch.no_grad():
        model(torch.arange(8).view(2, 4), use_cache=False)
    assert counters["stats"]["unique_graphs"] == 1
    compile_layers(model, False)
    torch._dynamo.reset()
