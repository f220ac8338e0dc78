"""How a run starts its components (run/group.py): each process starts and answers before its
worker is built (its model loaded), in a plain process as in a Ray actor."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import os

import pytest

from rlinf_twoworker import components
from rlinf_twoworker.config.settings import ProcessSettings
from rlinf_twoworker.run.group import ComponentHost, host_class

STAND_IN = ProcessSettings(
    accelerator="cpu", seed=0, collective_timeout_s=60.0, compile_cache_root=None, model=None
)
"""What a stand-in worker is given: a process's common settings, no model."""


class Loads:
    """A component stand-in whose constructor does the work (a model load)."""

    loaded = 0

    def __init__(self, settings: ProcessSettings, rank: int = 0) -> None:
        Loads.loaded += 1
        self.settings, self.rank, self.began = settings, rank, 123.0

    def where(self) -> dict:
        return {"component": "loads", "rank": self.rank, "loaded": True}

    def startup_report(self) -> dict:
        return {"began": self.began, "seconds": {"load": 1.0}}


def test_a_component_process_answers_before_its_worker_is_built():
    cls = host_class(Loads, "rollout")
    assert cls.__name__ == "Loads" and issubclass(cls, ComponentHost)
    component = cls(STAND_IN, 3)
    assert Loads.loaded == 0  # created: the process is up, no model loaded
    placed = component.where()
    assert (placed["component"], placed["rank"], placed["pid"]) == ("rollout", 3, os.getpid())
    with pytest.raises(RuntimeError, match="rollout:3: where was called before the worker"):
        component.call("where")
    assert component.import_ahead()["seconds"] >= 0  # a class with nothing to import
    assert component.load() == placed  # the process's own answer, as before the load
    assert Loads.loaded == 1 and component.call("where")["loaded"] is True
    report = component.startup_report()
    # began: when the process answered first; load_began: when the constructor ran.
    assert report["began"] == component._placed_at <= report["load_began"]
    assert report["seconds"] == {"load": 1.0}


def test_a_worker_is_built_with_the_settings_the_memory_plan_settled():
    """The process starts with its settings under the config as requested (beside the
    preflight); the memory plan then settles recompute, offload and micro-batch tokens in the
    run's config, and the worker is built with its settings under that one (ComponentGroup.load
    passes them), not the ones the process began with."""
    settled = dataclasses.replace(STAND_IN, seed=7)
    component = host_class(Loads, "actor")(STAND_IN, 0)
    component.load(settled)
    assert component._worker.settings is settled


class Grades:
    """A worker with an async method, like the reward."""

    def __init__(self, settings: ProcessSettings, rank: int = 0) -> None:
        self.rank = rank

    async def score(self, answers: list[str]) -> list[float]:
        await asyncio.sleep(0)
        return [float(a == "7") for a in answers]

    def count(self, answers: list[str]) -> int:
        return len(answers)

    def where(self) -> dict:
        return {"rank": self.rank}


def test_an_async_worker_gets_an_event_loop_host_that_awaits_its_calls():
    cls = host_class(Grades, "reward")
    assert inspect.iscoroutinefunction(cls.call)
    component = cls(STAND_IN, 0)
    component.load()
    assert asyncio.run(component.call("score", ["7", "1"])) == [1.0, 0.0]
    assert asyncio.run(component.call("count", ["7"])) == 1  # a plain method, answered as is
    assert not inspect.iscoroutinefunction(host_class(Loads, "rollout").call)
    with pytest.raises(ValueError, match="say whether"):
        host_class("rlinf_twoworker.workers.rollout:RolloutWorker", "rollout")


def test_a_worker_that_does_not_import_is_a_named_error():
    """The process imports its worker only ahead of its load: a module missing on the node
    fails there, naming the component, its rank, the worker and what to do."""
    component = host_class("rlinf_twoworker.workers.no_such_worker:Nothing", "rollout", False)(
        STAND_IN, 1
    )
    assert component.where()["component"] == "rollout"  # the process itself is up
    with pytest.raises(ImportError, match=r"rollout:1: its worker .*no_such_worker.* install"):
        component.import_ahead()
    with pytest.raises(ImportError, match="does not import in this process"):
        component.load()


def test_the_table_says_which_workers_are_async():
    """The run makes each process from its worker's name without importing it, so the table
    says whether the worker has async methods; it must match the class."""
    for entry in components.TABLE:
        cls = entry.worker_class()
        has_async = any(inspect.iscoroutinefunction(f) for _, f in inspect.getmembers(cls))
        assert entry.asynchronous == has_async, entry.name


def test_a_process_made_by_name_imports_its_worker_only_ahead_of_its_load(tmp_path, own_process):
    """In a fresh interpreter: the process of a component made from its worker's name answers
    where it runs without importing torch or the worker's module; import_ahead imports the
    worker, transformers and the model's family module (what the model load would) and
    nothing of the model's weights."""
    import json

    from rlinf_twoworker.api.demo import demo_config, make_inputs

    inputs = make_inputs(tmp_path / "inputs")
    cfg = demo_config(inputs, tmp_path, "ahead", [])
    script = (
        "import json, sys\n"
        "from omegaconf import OmegaConf\n"
        "from rlinf_twoworker.config import GRPOConfig, to_typed\n"
        "from rlinf_twoworker.config.settings import rollout_settings\n"
        "from rlinf_twoworker.run.group import host_class\n"
        "cfg = to_typed(OmegaConf.merge(OmegaConf.structured(GRPOConfig), json.loads(sys.argv[1])))\n"
        "host = host_class('rlinf_twoworker.workers.rollout:RolloutWorker', 'rollout', False)\n"
        "process = host(rollout_settings(cfg), 0)\n"
        "process.where()\n"
        "family = 'transformers.models.qwen2.modeling_qwen2'\n"
        "before = [m for m in ('torch', 'rlinf_twoworker.workers.rollout', family) if m in sys.modules]\n"
        "answer = process.import_ahead()\n"
        "after = [m for m in ('torch', 'rlinf_twoworker.workers.rollout', family) if m in sys.modules]\n"
        "print(json.dumps({'before': before, 'after': after, **answer}))\n"
    )
    from omegaconf import OmegaConf

    as_json = json.dumps(OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True))
    answer = own_process(script, as_json, timeout=300)
    assert answer["before"] == [] and len(answer["after"]) == 3, answer
    assert answer["missing"] == [] and answer["seconds"] > 0


def test_the_reward_process_answers_without_importing_torch(own_process):
    """The reward never needs torch: its first answers (where, its start-up report) and its
    scores come without it, so neither the start-up nor step 1's grading waits on a torch
    import (3 s on the H200 host)."""
    script = (
        "import json, sys, time\n"
        "from rlinf_twoworker.workers.process import place, process_memory, process_times\n"
        "import rlinf_twoworker.workers.reward\n"
        "place('reward', 0); process_times(time.time()); process_memory()\n"
        "from rlinf_twoworker.messages import Graded\n"  # what score() returns
        "print(json.dumps('torch' in sys.modules))\n"
    )
    assert own_process(script, timeout=120) is False


def test_the_controller_process_starts_without_torch(own_process):
    """The run's controller places the run and starts the components before it needs torch
    (its training modules import in a thread, beside the preflight): importing its module,
    and the memory plan's and checkpoint schedule's, imports neither torch nor transformers;
    the training modules it imports later are importable and bring torch."""
    script = (
        "import json, sys\n"
        "import rlinf_twoworker.run.controller as c\n"
        "import rlinf_twoworker.cluster.memory_plan, rlinf_twoworker.storage.checkpoints\n"
        "before = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "seconds = c._import_training()\n"
        "print(json.dumps([before, 'torch' in sys.modules, seconds > 0]))\n"
    )
    assert own_process(script, timeout=300) == [[], True, True]


def test_import_ahead_leaves_the_compiler_to_a_thread_on_gpus_only(tmp_path):
    """On GPUs, the head start's import_ahead returns once the model load's modules are
    imported and starts one thread that imports torch.compile's stack (its `prepare` waits
    for it); on CPU it starts none, and neither prepares nor saves a compile cache. In fresh
    interpreters (import_ahead touches no GPU either way)."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    from rlinf_twoworker.api.demo import demo_config, make_inputs

    inputs = make_inputs(tmp_path / "inputs")
    cfg = OmegaConf.to_container(
        OmegaConf.structured(demo_config(inputs, tmp_path, "compiler", [])), resolve=True
    )
    script = (
        "import json, sys\n"
        "from omegaconf import OmegaConf\n"
        "from rlinf_twoworker.config import GRPOConfig, to_typed\n"
        "from rlinf_twoworker.run import head_start\n"
        "cfg = to_typed(OmegaConf.merge(OmegaConf.structured(GRPOConfig), json.loads(sys.argv[1])))\n"
        "cuda = cfg.cluster.accelerator == 'cuda'\n"
        "head = head_start.HeadStart(cfg.compile_cache_root, 'inference:0', cfg.inference.model, cuda)\n"
        "from rlinf_twoworker.components import named\n"
        "worker = lambda: named('rlinf_twoworker.workers.inference:InferenceWorker')\n"
        "answer = head.import_ahead(worker)\n"
        "first = head.compiler_imports\n"
        "head.import_ahead(worker)\n"  # a second call starts no second one
        "same = head.compiler_imports is first\n"
        "if first is not None:\n"
        "    first.join(300)\n"
        "cpu = {} if first else {'prepare': head.prepare(), 'save': head.save()}\n"
        "print(json.dumps({'thread': None if first is None else first.name, 'same': same,\n"
        "    'missing': answer['missing'], **cpu,\n"
        "    'imported': [m for m in head_start.COMPILER_MODULES if m in sys.modules]}))\n"
    )
    answers = {}
    for accelerator in ("cuda", "cpu"):
        cfg["cluster"]["accelerator"] = accelerator
        done = subprocess.run(
            [sys.executable, "-c", script, json.dumps(cfg)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        answers[accelerator] = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["cuda"]["thread"] == "compiler-imports" and answers["cuda"]["same"]
    assert answers["cuda"]["imported"] == ["torch._dynamo", "torch._inductor.compile_fx"]
    assert answers["cpu"]["thread"] is None and answers["cpu"]["missing"] == []
    assert "torch._inductor.compile_fx" not in answers["cpu"]["imported"]
    assert answers["cpu"]["prepare"] == {"seconds": {}, "cache": []}
    assert answers["cpu"]["save"] == {"cache": [], "compile_s": 0.0}


class Records:
    """A worker that records the order of its calls; `fail` raises."""

    def __init__(self, settings: ProcessSettings, rank: int = 0) -> None:
        self.seen: list[str] = []

    def slow(self, label: str) -> None:
        import time

        time.sleep(0.5)  # long enough for a later call to arrive while it runs
        self.seen.append(label)

    def fail(self) -> None:
        raise RuntimeError("bucket already freed")

    def order(self) -> list[str]:
        return self.seen

    def where(self) -> dict:
        return {}


def test_a_call_nobody_waits_for_runs_before_later_calls_and_settle_raises_its_failure(
    cluster_2x2,
):
    """The weight sync's release (`call_behind`): the process runs it before any call made
    after it, and its failure is raised by `settle` with component, rank and node."""
    import sys

    import ray

    from rlinf_twoworker.config.placement import Slot
    from rlinf_twoworker.errors import ComponentError
    from rlinf_twoworker.run.group import ComponentGroup, Member

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not importable there
    handle = ray.remote(num_cpus=0)(host_class(Records, "actor")).remote(STAND_IN, 0)
    ray.get(handle.load.remote())
    member = Member(Slot("actor", 0, 0, 0, 0), handle, {"ip": "127.0.0.1", "node_id": "n1"})
    group = ComponentGroup.__new__(ComponentGroup)  # only the calls: no placement, no config
    group.behind = []

    async def scenario() -> list[str]:
        group.call_behind(member, "slow", "release", timeout=30, stage="weight release")
        # Made right after, without awaiting the first: it still runs second.
        order = await group.call(member, "order", timeout=30, stage="check")
        await group.settle()
        group.call_behind(member, "fail", timeout=30, stage="weight release")
        with pytest.raises(ComponentError, match=r"actor.*rank 0.*weight release \(fail\) failed"):
            await group.settle()
        assert group.behind == []
        return order

    try:
        assert asyncio.run(scenario()) == ["release"]
    finally:
        ray.kill(handle)
