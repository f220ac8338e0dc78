"""reward.reward_fn: a user's Python function as the reward, in the reward's grading processes.

The functions below are module-level so that the grading processes (spawned, with this
process's sys.path) import them by name, as they import a user's: 'test_reward_fn:<name>'.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import EXAMPLES, NODE_CODE, ONE_RANK

from rlinf_twoworker.api.request import RequestError, input_problems, resolve_request
from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.errors import ConfigError
from rlinf_twoworker.messages import PromptRow
from rlinf_twoworker.storage.data import load_jsonl
from rlinf_twoworker.storage.lineage import training_settings
from rlinf_twoworker.workers.reward import MathReward, RewardError, RewardFunctionError

HERE = Path(__file__).resolve().parent
MODULE = Path(__file__).stem
HANG, BOOM, EXIT = "<hang>", "<boom>", "<exit>"
NOT_CALLABLE = 3


def encode(prompt: str, answer: str, row: dict[str, Any]) -> float:
    """A value that shows all three arguments arrived: the prompt's and the answer's lengths,
    signed by a key only the row has."""
    assert prompt == row["prompt"], (prompt, row)
    return float(100 * len(prompt) + len(answer)) * row["sign"]


def sleepy(prompt: str, answer: str, row: dict[str, Any]) -> float:
    if answer == HANG:
        time.sleep(600)
    return 1.0


def faulty(prompt: str, answer: str, row: dict[str, Any]) -> float:
    if answer == BOOM:
        raise ValueError(f"cannot score {answer}")
    if answer == EXIT:
        os._exit(3)
    return row["value"]


def rows_of(prompts: list[str], **keys: Any) -> list[PromptRow]:
    return [PromptRow(p, {"prompt": p, "solutions": ["-"], **keys}) for p in prompts]


# ---- in the grading processes ----------------------------------------------------------------


def test_the_function_gets_prompt_answer_and_row_and_its_value_is_the_reward():
    prompts = ["Q1", "Question 2", "Q1", "Question 2"]
    answers = ["a", "bb", "", "dddd"]
    rows = rows_of(prompts[:2], sign=1.0) + rows_of(prompts[2:], sign=-1.0)
    with MathReward(reward_scale=5.0, num_workers=2, reward_fn=f"{MODULE}:encode") as reward:
        scores = reward.score(answers, [["-"]] * 4, rows)
        assert scores == [201.0, 1002.0, -200.0, -1004.0]  # reward_scale does not apply
        stats = reward.last_stats
        assert (stats["correct"], stats["wrong"], stats["timed_out"], stats["errors"]) == (
            2,
            2,
            0,
            0,
        )
        assert reward.score([], [], []) == []
        with pytest.raises(ValueError, match="needs each answer's prompt and data row"):
            reward.score(["a"], [["-"]])


def test_a_call_past_timeout_s_is_cut_and_scores_zero():
    """As the math grader's timeout: the process is killed and replaced, later answers and
    later calls are still scored."""
    with MathReward(timeout_s=1.0, num_workers=1, reward_fn=f"{MODULE}:sleepy") as reward:
        reward.warm_up()  # the process starts (and imports this module) outside the timed call
        pid = reward._workers[0].process.pid
        start = time.monotonic()
        rows = rows_of(["p"] * 3)
        scores = reward.score([HANG, "a", "b"], [["-"]] * 3, rows)
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 1.0]
        assert reward.last_stats["timed_out"] == 1
        assert elapsed < 1.0 + 15.0  # the limit plus a fresh process's start
        assert reward._workers[0].process.pid != pid  # killed and replaced
        assert reward.score(["c"], [["-"]], rows[:1]) == [1.0]
        assert reward.last_stats["timed_out"] == 0


def test_a_raising_function_fails_with_its_name_the_answer_and_the_traceback():
    with MathReward(num_workers=1, reward_fn=f"{MODULE}:faulty") as reward:
        with pytest.raises(RewardFunctionError) as info:
            reward.score(["ok", BOOM], [["-"]] * 2, rows_of(["p", "p"], value=1.0))
        text = str(info.value)
        assert f"reward.reward_fn {MODULE}:faulty failed on answer 1 (of 2" in text
        assert "Traceback" in text and "ValueError: cannot score <boom>" in text
        assert "in faulty" in text  # the user's frame
        # The grading processes survive a user's bug: the next call scores.
        assert reward.score(["ok"], [["-"]], rows_of(["p"], value=2.5)) == [2.5]


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (None, "returned None of type NoneType, not a float"),
        (float("nan"), "returned nan, not a finite float"),
        (math.inf, "returned inf, not a finite float"),
        (True, "returned True of type bool, not a float"),
        ("1.0", "returned '1.0' of type str, not a float"),
    ],
)
def test_a_value_that_is_no_finite_float_is_refused(value: Any, why: str):
    with MathReward(num_workers=1, reward_fn=f"{MODULE}:faulty") as reward:
        with pytest.raises(RewardFunctionError, match="failed on answer 0") as info:
            reward.score(["ok"], [["-"]], rows_of(["p"], value=value))
        assert why in str(info.value)
        assert reward.score(["ok"], [["-"]], rows_of(["p"], value=3)) == [3.0]  # an int is fine


def test_a_function_that_ends_its_process_fails_the_step():
    reward = MathReward(num_workers=1, reward_fn=f"{MODULE}:faulty")
    with reward, pytest.raises(RewardFunctionError, match="ended its grading process .exit code 3"):
        reward.score([EXIT], [["-"]], rows_of(["p"], value=1.0))


def test_a_grading_process_that_cannot_import_the_function_fails_the_start():
    reward = MathReward(num_workers=1, reward_fn="no_such_module_xyz:fn")
    with reward, pytest.raises(RewardError) as info:
        reward.warm_up()
    text = str(info.value)
    assert "reward.reward_fn=no_such_module_xyz:fn" in text
    assert "No module named 'no_such_module_xyz'" in text and "PYTHONPATH" in text


# ---- the config and the request check --------------------------------------------------------


def test_a_value_without_the_form_is_refused_at_load_naming_the_key():
    for bad in ("my_rewards", "my_rewards:", ":fn", "my rewards:fn", "a.b:c d"):
        with pytest.raises(ConfigError) as info:
            load_config(overrides=[f"reward.reward_fn='{bad}'"])
        assert info.value.key == "reward.reward_fn" and info.value.value == bad
        assert "'package.module:function'" in info.value.rule


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' cannot be imported on"),
        ("json:no_such_function", "module 'json' (.*) has no attribute 'no_such_function'"),
        (f"{MODULE}:NOT_CALLABLE", "'NOT_CALLABLE' in module '.*' is a int, not a function"),
    ],
)
def test_a_function_that_does_not_resolve_is_refused_at_the_request_check(spec: str, why: str):
    """The load checks only the form (configs are loaded where the user's code is not); the
    request check imports it and raises a ConfigError naming the key, the value and the fix."""
    cfg = load_config(overrides=[f"reward.reward_fn={spec}"])  # the form is fine
    with pytest.raises(ConfigError, match=why) as info:
        resolve_request(None, [f"reward.reward_fn={spec}"], {}, for_run=False)
    assert info.value.key == "reward.reward_fn" and info.value.value == spec
    # The demo's check (input_problems) lists it with the other problems of the request.
    problems = input_problems(to_typed(cfg))
    assert any(p.startswith(f"config key 'reward.reward_fn' = '{spec}'") for p in problems)


def test_the_python_api_refuses_a_function_that_does_not_resolve_before_any_ray_call(
    tmp_path: Path,
):
    """run_grpo_two_worker imports reward.reward_fn on the caller's node before it connects
    to Ray or writes anything: the same ConfigError as the CLI's request check."""
    from rlinf_twoworker import run_grpo_two_worker

    cfg = load_config(
        overrides=[
            "reward.reward_fn=no_such_module_anywhere:f",
            f"runner.output_dir={tmp_path}",
            "runner.experiment_name=bad-fn",
        ]
    )
    with pytest.raises(ConfigError) as info:
        run_grpo_two_worker(cfg)
    assert info.value.key == "reward.reward_fn"
    assert not (tmp_path / "bad-fn").exists()


def test_a_good_function_passes_and_reward_type_stays_math():
    typed = to_typed(load_config(overrides=[f"reward.reward_fn={MODULE}:encode"]))
    assert typed.reward.reward_type == "math" and typed.reward.reward_fn == f"{MODULE}:encode"
    assert not any("reward.reward_fn" in p for p in input_problems(typed))
    with pytest.raises(RequestError) as info:  # only the inputs of the default config
        resolve_request(None, [f"reward.reward_fn={MODULE}:encode"], {}, for_run=False)
    assert "reward.reward_fn" not in str(info.value)


def test_reward_fn_and_grader_belong_to_the_lineage():
    plain = training_settings(to_typed(load_config()))
    assert plain["reward.reward_fn"] is None and plain["reward.grader"] == "rlinf"
    other = training_settings(to_typed(load_config(overrides=["reward.reward_fn=m:f"])))
    assert other["reward.reward_fn"] == "m:f"
    # What only changes how it runs stays out.
    assert not any(k in plain for k in ("reward.timeout_s", "reward.group_name"))


def test_rows_are_kept_only_when_asked(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    record = {"prompt": "p", "solutions": "s", "query_id": 7, "parity": "even", "n": [1, 2]}
    path.write_text(json.dumps(record) + "\n")
    assert load_jsonl([str(path)])[0].row is None
    assert load_jsonl([str(path)], keep_rows=True)[0].row == record


def test_the_math_path_sends_no_rows():
    from rlinf_twoworker.run.step import prompt_rows
    from rlinf_twoworker.storage.data import Sample

    samples = [Sample("p", ["s"], None, {"prompt": "p", "solutions": ["s"], "k": 1})]
    assert prompt_rows(to_typed(load_config()), samples) is None
    with_fn = to_typed(load_config(overrides=["reward.reward_fn=m:f"]))
    assert prompt_rows(with_fn, samples) == [PromptRow("p", samples[0].row)]  # type: ignore[arg-type]


# ---- a run on a real 2-node cluster ----------------------------------------------------------

REWARD_MODULE = '''
import json, os


def parity(prompt, answer, row):
    """1.0 when the answer's length has the parity the row asks for, else 0.0; every call is
    logged (to the file the row names) for the test to compare with the step's metrics."""
    assert prompt == row["prompt"], "the prompt is the row's"
    wanted = 0 if row["parity"] == "even" else 1
    value = 1.0 if len(answer) % 2 == wanted else 0.0
    line = json.dumps({"query_id": row["query_id"], "answer": answer, "value": value})
    fd = os.open(row["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\\n").encode())
    finally:
        os.close(fd)
    return value
'''


def _parity_inputs(root: Path, log: Path) -> Any:
    """The demo's model with a task that is no math: answer with a given parity of length."""
    from rlinf_twoworker.api.demo import ASSISTANT, DATA_NAME, USER, make_inputs
    from rlinf_twoworker.storage.manifest import write_manifest

    inputs = make_inputs(root / "inputs", num_samples=16)
    with open(inputs.data_path, "w") as fh:
        for i in range(16):
            parity = "even" if i % 2 else "odd"
            prompt = f"{USER}Answer with {parity} many characters.{ASSISTANT}"
            record = {
                "prompt": prompt,
                "solutions": ["-"],
                "query_id": f"q{i}",
                "parity": parity,
                "log": str(log),
            }
            fh.write(json.dumps(record) + "\n")
    write_manifest(inputs.data_path.parent, [DATA_NAME])
    return inputs


def test_a_run_rewards_with_the_function_and_its_values_reach_the_step_metrics(
    cluster_2x2, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A non-math task on a real 2 x 2 cluster: the function's module is importable only
    through PYTHONPATH in the environment the cluster's nodes started with (NODE_CODE), as on
    a platform; this process finds it on its sys.path (the request check imports it too)."""
    import ray

    from rlinf_twoworker import run_grpo_two_worker
    from rlinf_twoworker.api.demo import demo_config
    from rlinf_twoworker.api.request import check_inputs

    module = NODE_CODE / "parity_reward.py"
    module.write_text(REWARD_MODULE)
    monkeypatch.syspath_prepend(str(NODE_CODE))
    log = tmp_path / "calls.jsonl"
    overrides = [*ONE_RANK, "reward.reward_fn=parity_reward:parity", "runner.save_interval=-1"]
    cfg = demo_config(_parity_inputs(tmp_path, log), tmp_path / "runs", "reward-fn", overrides)
    try:
        check_inputs(to_typed(cfg))
        handle = run_grpo_two_worker(cfg)
        report = handle.result(timeout=600)
        steps = [ray.get(handle.step(n), timeout=60).metrics for n in (1, 2)]
    finally:
        module.unlink()
    assert report.passed, report.errors
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 16  # 8 prompts x 2 answers a step, no other call (the warm-up)
    for n, metrics in enumerate(steps):
        values = [c["value"] for c in calls[16 * n : 16 * (n + 1)]]  # step 2 grades after step 1
        assert metrics["rollout/reward_scores"] == pytest.approx(sum(values) / 16, abs=1e-6)
        positive = sum(v > 0 for v in values) / 16
        assert metrics["rollout/correct_fraction"] == pytest.approx(positive, abs=1e-6)
    assert {c["value"] for c in calls} == {0.0, 1.0}  # the answers' lengths differ


@pytest.mark.slow
def test_the_example_runs_the_demo_with_its_function_and_passes_the_postflight(
    cluster_2x2, tmp_path: Path
):
    """Run as a script on a running cluster: Ray puts the script's directory on its workers'
    path, so the grading processes import the function's module from it (`--local`, the same
    with a cluster of its own, is test_examples' driver test's)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "reward_function.py"), "--demo"]
        + ["--address", cluster_2x2.address, "--output-root", str(tmp_path)]
        + ONE_RANK,  # an override the example passes on: its subject is not the actor's ranks
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout.splitlines()
    steps = [line for line in out if "reward_function:palindrome mean reward" in line]
    assert [line.split(":")[0] for line in steps] == ["step 1/2", "step 2/2"], out
    assert "postflight: passed" in out
