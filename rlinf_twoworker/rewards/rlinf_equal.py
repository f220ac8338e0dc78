"""RLinf's answer equivalence (math_equal and symbolic_equal of
rlinf/algorithms/rewards/math/math_verifier/verify.py at RLinf 7d07a42, timeout=False).

In order: the same text (case-insensitive); a multiple-choice letter; two numbers within a
relative 1e-4, the reference also read as a percentage either way; the same text without
brackets; element-wise tuples, intervals and pmatrix; equations; then sympy: each side parsed by
sympy's LaTeX parser, else sympy's expression parser, else latex2sympy2, and judged equal as
text, by simplification, as equations, numerically, or as matrices rounded to 3 decimals.
sympy and the parsers are imported on first use, in the grading process.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from rlinf_twoworker.rewards.rlinf_extract import choice_answer_clean

_CHOICES = ("A", "B", "C", "D", "E")
_PMATRIX_BEGIN, _PMATRIX_END = "\\begin{pmatrix}", "\\end{pmatrix}"
_BRACKETED = re.compile(r"(\(|\[).+(\)|\])")


def parse_digits(text: str) -> float | None:
    """A number with commas dropped (Python's float() syntax, so '1e8' and 'inf' too); 'x%' or
    'x\\%' is x/100. None when it is not one."""
    text = str(text).replace(",", "")
    try:
        return float(text)
    except ValueError:
        pass
    if text.endswith("%"):
        text = text[:-1].removesuffix("\\")
        try:
            return float(text) / 100
        except ValueError:
            pass
    return None


def numeric_equal(prediction: float, reference: float) -> bool:
    return math.isclose(reference, prediction, rel_tol=1e-4)


def _matrix_rows(text: str) -> list[str]:
    # RLinf cuts len("\\begin{pmatrix}") from each end, also from a bmatrix (the same length).
    body = text[len(_PMATRIX_BEGIN) : -len(_PMATRIX_END)]
    return [row.strip() for row in body.split("\\\\") if row.strip()]


def _is_matrix(text: str) -> bool:
    return text.startswith(("\\begin{pmatrix}", "\\begin{bmatrix}")) and text.endswith(
        ("\\end{pmatrix}", "\\end{bmatrix}")
    )


def _str_to_pmatrix(text: str) -> str:
    """'{1,2}' -> a pmatrix of those entries, for a reference compared with a pmatrix."""
    groups = re.findall(r"\{.*,.*\}", text.strip())
    return ", ".join(
        _PMATRIX_BEGIN + g.strip("{}").replace(",", "\\") + _PMATRIX_END for g in groups
    )


def _all_equal(predictions: list[str], references: list[str]) -> bool:
    return len(predictions) == len(references) and all(
        math_equal(p, r) for p, r in zip(predictions, references, strict=True)
    )


def _matrices_equal(prediction: str, reference: str) -> bool:
    pred_rows, ref_rows = _matrix_rows(prediction), _matrix_rows(reference)
    return len(pred_rows) == len(ref_rows) and all(
        _all_equal(p.split("&"), r.split("&")) for p, r in zip(pred_rows, ref_rows, strict=True)
    )


def _numbers_equal(prediction: str, reference: str) -> bool | None:
    """The numeric verdict when both sides are numbers; None when one is not."""
    pred, ref = parse_digits(prediction), parse_digits(reference)
    if pred is None or ref is None:
        return None
    return any(numeric_equal(pred, r) for r in (ref / 100, ref, ref * 100))


def _without_brackets(prediction: str, reference: str) -> bool:
    pred, ref = prediction, reference
    if (pred.startswith("[") and pred.endswith("]") and not ref.startswith("(")) or (
        pred.startswith("(") and pred.endswith(")") and not ref.startswith("[")
    ):
        pred, ref = pred.strip("[]()"), ref.strip("[]()")
    for bracket in "{}()":
        pred, ref = pred.replace(bracket, ""), ref.replace(bracket, "")
    return pred.lower() == ref.lower()


def _equations_equal(prediction: str, reference: str) -> bool:
    """Both equations: lhs - (rhs) equal up to sign. One 'v = x' against a plain x: x."""
    if prediction.count("=") == 1 and reference.count("=") == 1:
        pred_l, pred_r = (s.strip() for s in prediction.split("="))
        ref_l, ref_r = (s.strip() for s in reference.split("="))
        pred, ref = f"{pred_l} - ({pred_r})", f"{ref_l} - ({ref_r})"
        return symbolic_equal(pred, ref) or symbolic_equal(f"-({pred})", ref)
    if prediction.count("=") == 1 and len(prediction.split("=")[0].strip()) <= 2:
        return "=" not in reference and math_equal(prediction.split("=")[1], reference)
    if reference.count("=") == 1 and len(reference.split("=")[0].strip()) <= 2:
        return "=" not in prediction and math_equal(prediction, reference.split("=")[1])
    return False


def math_equal(prediction: str, reference: str) -> bool:
    """RLinf's math_equal(prediction, reference) with its defaults (percentages, is_close)."""
    if prediction.strip().lower() == reference.strip().lower():
        return True
    if reference in _CHOICES and choice_answer_clean(prediction) == reference:
        return True
    numbers = _numbers_equal(prediction, reference)
    if numbers is not None:
        return numbers  # two numbers are never compared symbolically
    if not prediction:
        return False
    reference, prediction = reference.strip(), prediction.strip()
    if "pmatrix" in prediction and "pmatrix" not in reference:
        reference = _str_to_pmatrix(reference)
    if _without_brackets(prediction, reference):
        return True
    if (
        _BRACKETED.match(prediction)
        and _BRACKETED.match(reference)
        and _all_equal(prediction[1:-1].split(","), reference[1:-1].split(","))
    ):
        return True
    if _is_matrix(prediction) and _is_matrix(reference) and _matrices_equal(prediction, reference):
        return True
    if _equations_equal(prediction, reference):
        return True
    return symbolic_equal(prediction, reference)


@cache
def _parsers() -> tuple[Callable[[str], Any], ...]:
    """sympy's LaTeX parser (antlr4 4.11), sympy's expression parser, latex2sympy2: RLinf's
    order. Imported here so that only the grading process pays for sympy."""
    from latex2sympy2 import latex2sympy
    from sympy.parsing.latex import parse_latex
    from sympy.parsing.sympy_parser import parse_expr

    return (parse_latex, parse_expr, latex2sympy)


def _to_sympy(text: str) -> Any:
    """The first parser's result (tried with '\\\\' made '\\', then as written); else the text."""
    for parser in _parsers():
        for candidate in (text.replace("\\\\", "\\"), text):
            try:
                return parser(candidate)
            except Exception:  # this parser cannot read it: RLinf tries the next
                pass
    return text


def symbolic_equal(prediction: str, reference: str) -> bool:
    """Each test's failure (any exception, sympy's included) only moves on to the next test."""
    from sympy import N, simplify

    a, b = _to_sympy(prediction), _to_sympy(reference)
    tests: tuple[Callable[[], Any], ...] = (
        lambda: str(a) == str(b) or a == b,
        lambda: a.equals(b) or simplify(a - b) == 0,
        lambda: abs(a.lhs - a.rhs).equals(abs(b.lhs - b.rhs)),
        lambda: numeric_equal(float(N(a)), float(N(b))),
        lambda: (
            a.shape == b.shape
            and a.applyfunc(lambda x: round(x, 3)).equals(b.applyfunc(lambda x: round(x, 3)))
        ),
    )
    for test in tests:
        try:
            if test():
                return True
        except Exception:  # sympy raises for what it cannot compare: RLinf moves on
            pass
    return False
