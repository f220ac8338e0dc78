"""The default math grader (reward.grader=rlinf) against RLinf's own code, on generated pairs.

    python -m benchmarks grader --rlinf /path/to/RLinf [--cases 3000] [--seed 1]

Imports RLinf's math verifier from a checkout of RLinf (rlinf/algorithms/rewards/math/
math_verifier: verify.py and parser.py; nothing of it is copied here) and judges the same
generated (answer, solution) pairs with its process_results and with the library's
rlinf_grader.verdict: the verdict and both extracted strings must agree. The pairs are drawn
from groups of equal and unequal values written in many notations (fractions, percentages,
degrees, units, thousands separators, intervals, tuples, sets, matrices, choices, words,
equations, scientific notation), each inside one of many answer forms (last \\boxed{}, \\fbox,
'the answer is', Minerva's 'Final Answer', no answer at all) and solution forms (bare, boxed,
phrased). Each pair is judged in a worker process with a time limit on each side (sympy can
run for minutes); a pair that runs out of time on either side is counted, not compared.
Prints the counts and every disagreement; writes benchmarks/results/grader-vs_rlinf-cpu.json.
The reference verdicts of tests/unit/test_rlinf_grader.py (RLinf's own, computed at the pinned
commit) are the test; this is the wider sweep behind it.
"""

from __future__ import annotations

import argparse
import importlib
import multiprocessing as mp
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

VERIFIER = Path("rlinf/algorithms/rewards/math/math_verifier")

# Each group: one value's notations first, then neighbours that are close but not equal.
VALUES: list[list[str]] = [
    ["3", "3.0", "03", "3.00", "\\frac{6}{2}", "\\sqrt{9}", "three", "+3", "3\\%", "3^\\circ"],
    ["3", "3 \\text{ cm}", "\\$3", "3 dollars", "{3}", "x=3", "x = 3", "(3)", "\\mathbf{3}", "3."],
    ["-2", "-2.0", "- 2", "\\frac{-4}{2}", "-\\frac{4}{2}", "\u22122", "2"],
    ["\\frac{1}{2}", "\\frac12", "\\dfrac{1}{2}", "\\tfrac{1}{2}", "1/2", "0.5", ".5", "50\\%"],
    [
        "\\frac{1}{2}",
        "50",
        "\\frac{2}{4}",
        "\\frac{1}{2}\\%",
        "0.50",
        "\\left(\\frac{1}{2}\\right)",
    ],
    ["1000", "1,000", "1{,}000", "10^3", "1e3", "1 000", "1000.0", "1\\,000", "\\num{1000}"],
    [
        "\\sqrt{2}",
        "\\sqrt2",
        "2^{1/2}",
        "1.41421356",
        "1.414",
        "\\frac{2}{\\sqrt{2}}",
        "\\sqrt{8}/2",
    ],
    ["\\pi", "3.14159", "\\frac{\\pi}{1}", "180^\\circ", "\\pi \\text{ radians}", "3.14"],
    ["2\\pi", "6.283185", "\\frac{4\\pi}{2}", "360^\\circ"],
    ["(1,2)", "(1, 2)", "\\left(1,2\\right)", "1,2", "\\{1,2\\}", "[1,2]", "(2,1)", "x=1, y=2"],
    ["[0,1)", "[0, 1)", "0\\le x<1", "\\left[0,1\\right)", "(0,1]", "[0,1]"],
    ["(-\\infty, 3]", "(-\\infty,3]", "x \\le 3", "(-inf, 3]"],
    ["\\infty", "\\inf", "infinity", "oo"],
    ["x^2+2x+1", "(x+1)^2", "x^2 + 2x + 1", "1+2x+x^2", "(x+1)(x+1)", "x^2+1"],
    ["2x", "2 x", "x\\cdot 2", "2*x", "x+x", "2y"],
    [
        "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        "(1,2)",
        "\\begin{bmatrix} 1 \\\\ 2 \\end{bmatrix}",
    ],
    ["A", "(A)", "\\text{(A)}", "A)", "a", "\\textbf{(A)}", "B", "\\text{A}"],
    ["\\text{Monday}", "Monday", "monday", "\\text{monday}", "Tuesday"],
    [
        "5",
        "5\\text{ m}",
        "5 \\mbox{ meters}",
        "5m",
        "5\\ \\text{m}^2",
        "5 units",
        "5\\text{ inches}",
    ],
    ["12", "12.0", "12 \\text{ hours}", "twelve", "12:00", "\\boxed{12}"],
    ["1.5", "\\frac{3}{2}", "1\\frac{1}{2}", "1 \\frac{1}{2}", "3/2", "150\\%"],
    ["0.333", "\\frac{1}{3}", "0.\\overline{3}", "0.3333333", "1/3"],
    ["10\\sqrt{3}", "10 \\sqrt{3}", "\\sqrt{300}", "17.3205", "10\\sqrt3"],
    ["2, 3", "3, 2", "2 \\text{ and } 3", "\\{2, 3\\}", "x=2 \\text{ or } x=3", "2,3"],
    ["\\emptyset", "\\varnothing", "\\{\\}", "none", "None"],
    ["6.02 \\times 10^{23}", "6.02e23", "602000000000000000000000", "6.02\\cdot10^{23}"],
    ["y = 2x + 1", "2x+1", "y=2x+1", "y - 2x = 1"],
    ["45^\\circ", "45", "45^{\\circ}", "\\frac{\\pi}{4}", "45 \\text{ degrees}", "45\u00b0"],
    ["4+3i", "4 + 3i", "3i+4", "4-3i", "4+3\\mathrm{i}", "(4+3i)", "4+3j"],
    ["3", "\\log_28", "\\log_2 8", "\\log_{2}{8}", "\\ln(e^3)", "\\log 1000"],
    [
        "\\begin{pmatrix}7&3\\\\2&1\\end{pmatrix}",
        "\\begin{pmatrix} 7 & 3 \\\\ 2 & 1 \\end{pmatrix}",
        "\\begin{pmatrix}7&2\\\\3&1\\end{pmatrix}",
        "\\begin{bmatrix}7&3\\\\2&1\\end{bmatrix}",
    ],
    ["9^{9^{9}}", "9^{9^9}", "9^9^9", "387420489"],
    ["\\mathbb{R}", "(-\\infty,\\infty)", "\\text{all real numbers}", "\\mathbb R"],
    ["(2,5]", "x\\in(2,5]", "2<x\\le5", "(2, 5]", "\\left(2,5\\right]", "(2,5)"],
    ["-3", "\u2212" + "3", "\u2013" + "3", "-\\frac{9}{3}", "- 3", "(-3)", "-3.0"],
    ["4000", "4\\,000", "4{,}000", "4.000", "4 000", "4,000", "4\\ 000", "4e3"],
    ["yes", "Yes", "\\text{yes}", "YES", "no", "\\text{Yes}", "true"],
    ["no solution", "\\text{no solution}", "No solution", "nosolution", "\\emptyset", "\\{\\}"],
    ["even", "Even", "\\text{even}", "\\text{Even}", "odd"],
    ["0.25", "25\\%", "25", "\\frac{1}{4}", "25 \\text{ percent}", "0.25\\%", "1/4"],
    ["9\\pi", "28.27", "28.274", "28.2743", "9 \\pi", "\\pi \\cdot 9", "9\\pi \\text{ cm}^2"],
    ["\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", "0.7071", "\\sqrt{2}/2", "\\frac{\\sqrt2}2"],
    ["1.2\\times10^8", "120000000", "120,000,000", "1.2e8", "1.2 \\cdot 10^{8}", "12 \\times 10^7"],
    ["300", "3 0 0", "300.0", "0300", "300 \\text{ miles}", "\\$300", "300.", "299.99"],
]
ANSWER_FORMS = [
    "The answer is $\\boxed{{{v}}}$.",
    "so we get \\boxed{{{v}}}",
    "\\boxed{{{v}}}",
    "First \\boxed{{7}} then finally \\boxed{{{v}}}",
    "The answer is {v}",
    "the final answer is ${v}$. I hope it is correct.",
    "Final Answer: The final answer is ${v}$. I hope it is correct.",
    "Therefore, the answer is {v}.",
    "We find {v}",
    "\\fbox{{{v}}}",
    "\\boxed {{{v}}}",
    "$\\boxed{{{v}}}$ and some text after",
    "<answer>{v}</answer>",
    "boxed{{{v}}}",
    "\\boxed{{\\text{{{v}}}}}",
    "<think>so \\boxed{{{v}}}</think>",
    "<think>maybe \\boxed{{1}}</think>\n\nThus, the answer is \\(\\boxed{{{v}}}\\).",
    "\\boxed{{\n{v}\n}}",
    "\\boxed {v}",
    "\\boxed{{{v}",
    "**Final Answer**\n\\[\n\\boxed{{{v}}}\n\\]",
    "The answer is: $\\boxed{{{v}}}$ (approximately)",
    "$x = {v}$",
    "\\boxed{{x = {v}}}",
    "\\boxed{{{v}}} or \\boxed{{{v}}}",
]
SOLUTION_FORMS = [
    "{v}",
    "{v}",
    "{v}",
    "so the answer is $\\boxed{{{v}}}$.",
    "The answer is {v}",
    "\\boxed{{{v}}}",
    "The value is {v} as shown above",
]


def pairs(n: int, seed: int) -> list[tuple[str, str]]:
    """n (answer, solution) pairs: mostly two notations of one group (equal or a neighbour),
    sometimes values of two groups."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        group = rng.choice(VALUES)
        value = rng.choice(group) if rng.random() < 0.85 else rng.choice(rng.choice(VALUES))
        answer = rng.choice(ANSWER_FORMS).format(v=value)
        out.append((answer, rng.choice(SOLUTION_FORMS).format(v=rng.choice(group))))
    return out


_RLINF: Any = None


def _init(rlinf: str) -> None:
    """A worker's RLinf verifier, imported as a package of its own from the checkout."""
    global _RLINF
    sys.path.insert(0, str(Path(rlinf) / VERIFIER.parent))
    _RLINF = importlib.import_module(f"{VERIFIER.name}.verify")


def judge(pair: tuple[str, str], side: str) -> tuple[bool, str, str]:
    if side == "library":
        from rlinf_twoworker.rewards.rlinf_grader import verdict

        return verdict(*pair)
    ok, (extracted, gold) = _RLINF.process_results(*pair)
    return bool(ok), extracted, gold


def judge_all(
    cases: list[tuple[str, str]], side: str, rlinf: str, timeout_s: float
) -> list[tuple[bool, str, str] | None]:
    """Each pair's judgement on one side, None where it ran out of time (the worker is then
    replaced, as RLinf replaces its pool). A killed worker leaves the semaphores of what it
    had made (RLinf's verify.py makes a process pool on import) to the resource tracker,
    which cleans them up at the end and says how many with a warning."""
    ctx = mp.get_context("spawn")
    out: list[tuple[bool, str, str] | None] = []
    pool = ctx.Pool(1, initializer=_init, initargs=(rlinf,))
    try:
        for i, pair in enumerate(cases):
            job = pool.apply_async(judge, (pair, side))
            try:
                out.append(job.get(timeout=timeout_s))
            except mp.TimeoutError:
                out.append(None)
                pool.terminate()
                pool.join()
                pool = ctx.Pool(1, initializer=_init, initargs=(rlinf,))
            if (i + 1) % 500 == 0:
                print(f"[grader] {side}: {i + 1}/{len(cases)}", flush=True)
    finally:
        pool.terminate()
        pool.join()
    return out


def compare(cases, library, reference) -> dict[str, Any]:
    """The counts, the pairs whose judgements differ, and the pairs that ran out of time on
    one side only (a slow pair is wrong on both sides in a run: RLinf's time limit and
    reward.timeout_s; one side slow where the other judged it right would differ there)."""
    differ, timed_out, one_side = [], 0, []
    for pair, mine, theirs in zip(cases, library, reference, strict=True):
        if mine is None or theirs is None:
            timed_out += 1
            if (mine is None) != (theirs is None):
                one_side.append(
                    {"answer": pair[0], "solution": pair[1], "library": mine, "rlinf": theirs}
                )
            continue
        if tuple(mine) != tuple(theirs):
            differ.append(
                {"answer": pair[0], "solution": pair[1], "library": mine, "rlinf": theirs}
            )
    judged = len(cases) - timed_out
    correct = sum(1 for r in reference if r is not None and r[0])
    return {
        "pairs": len(cases),
        "judged_by_both": judged,
        "timed_out": timed_out,
        "timed_out_on_one_side": one_side[:200],
        "rlinf_correct": correct,
        "disagreements": len(differ),
        "disagreeing_pairs": differ[:200],
    }


def main() -> None:
    from record import write_result

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rlinf", required=True, help="a checkout of RLinf (its repository root)")
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per pair and side")
    args = parser.parse_args()
    if not (Path(args.rlinf) / VERIFIER / "verify.py").is_file():
        raise SystemExit(
            f"--rlinf {args.rlinf}: no {VERIFIER}/verify.py there; give the root of an RLinf "
            "checkout (git clone https://github.com/RLinf/RLinf)"
        )
    cases = pairs(args.cases, args.seed)
    with ThreadPoolExecutor(2) as sides:  # a worker process each, side by side
        library_job, reference_job = (
            sides.submit(judge_all, cases, side, args.rlinf, args.timeout_s)
            for side in ("library", "rlinf")
        )
        library, reference = library_job.result(), reference_job.result()
    result = compare(cases, library, reference)
    for d in result["disagreeing_pairs"]:
        print(f"differs: {d}")
    for d in result["timed_out_on_one_side"]:
        print(f"out of time on one side only: {d}")
    print(
        f"[grader] {result['judged_by_both']} of {result['pairs']} pairs judged by both "
        f"({result['timed_out']} ran out of time, {len(result['timed_out_on_one_side'])} of them "
        f"on one side only), RLinf called {result['rlinf_correct']} "
        f"correct; {result['disagreements']} disagreements (verdict or extracted strings)"
    )
    payload = {"seed": args.seed, "timeout_s": args.timeout_s, "grader": result}
    print(write_result("grader", "vs_rlinf", "cpu", payload))


if __name__ == "__main__":
    main()
