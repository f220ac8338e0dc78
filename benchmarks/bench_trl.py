"""The baseline: TRL's GRPOTrainer on the library's full-step workload, in its own process.

    python benchmarks/bench_trl.py --model DIR --data FILE [--out trl.json] [--cycles 3]
        [--no-checkpointing]

Same model directory, same prompts (the data file's first prompts, shuffled by the trainer),
the same shape as the starting config: 8 prompts x 2 answers a step, 768 new tokens at most,
temperature 1.0, four optimiser updates of 4 answers each per generation (TRL's
per_device_train_batch_size=4, steps_per_generation=4), learning rate 2e-5, no KL term. TRL's
own defaults otherwise: transformers `generate` for the rollout, float32 weights under bf16
autocast, gradient checkpointing (`--no-checkpointing` turns it off: the faster setting when
the GPU has the memory). One "GRPO step" here is one generation plus its four
updates, timed from the end of the previous one (CUDA-synchronised). The reward is a substring
check (cheaper than the library's math-verify grader, which favours TRL).
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the process's start, before its imports: TRL's call to step 1

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
from record import write_result  # noqa: E402  (benchmarks/ is the script's path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument(
        "--out", default=None, help="default: benchmarks/results/trl-<config>-<hardware>.json"
    )
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=768)
    parser.add_argument("--workdir", default="/tmp/rlinf-bench/trl")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="train without gradient checkpointing"
    )
    args = parser.parse_args(argv)

    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlinf_twoworker.storage.data import load_jsonl

    samples = load_jsonl([args.data])[:64]
    dataset = Dataset.from_list([{"prompt": s.prompt, "answer": s.solutions[0]} for s in samples])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [float(a in c) for c, a in zip(completions, answer)]

    updates_per_generation = 4
    marks: list[float] = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    class Clock(TrainerCallback):
        def on_train_begin(self, *_: object, **__: object) -> None:
            sync()
            marks.append(time.perf_counter())

        def on_step_end(self, _args, state, *__: object, **___: object) -> None:
            if state.global_step % updates_per_generation == 0:
                sync()
                marks.append(time.perf_counter())

    # transformers renamed gradient_checkpointing to activation_checkpointing in 5.2x.
    fields = GRPOConfig.__dataclass_fields__
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    config = GRPOConfig(
        **{checkpointing: not args.no_checkpointing},
        output_dir=args.workdir,
        per_device_train_batch_size=4,
        steps_per_generation=updates_per_generation,
        num_generations=2,
        max_completion_length=args.max_new,
        temperature=1.0,
        learning_rate=2e-5,
        beta=0.0,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # a CPU run only checks the script
        use_vllm=False,
        max_steps=updates_per_generation * args.cycles,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=1234,
        disable_tqdm=True,
    )
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[Clock()],
    )
    load_s = time.perf_counter() - start
    trainer.train()
    cycles = [b - a for a, b in zip(marks, marks[1:])]
    lengths = [
        row["completions/mean_length"]
        for row in trainer.state.log_history
        if "completions/mean_length" in row
    ]
    result = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "gradient_checkpointing": not args.no_checkpointing,
        "setup_s": load_s,
        # From the process's start (imports included) to the end of the first step, and to
        # the end of the second: TRL's "call to step 1" and "2-step job".
        "process_to_step1_s": marks[1] - STARTED if len(marks) > 1 else None,
        "process_to_step2_s": marks[2] - STARTED if len(marks) > 2 else None,
        "step_s": cycles,
        "first_step_s": cycles[0] if cycles else None,
        "median_step_s": statistics.median(cycles[1:] or cycles) if cycles else None,
        "completion_mean_length": lengths,
        "answers_per_step": 16,
        "updates_per_step": updates_per_generation,
    }
    configuration = "no_checkpointing" if args.no_checkpointing else "checkpointing"
    write_result("trl", configuration, None, result, args.out)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
