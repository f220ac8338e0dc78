"""RLinf's answer extraction and normalisation (rlinf/algorithms/rewards/math/math_verifier/parser.py
at RLinf 7d07a42, the 'math' data set, use_last_number=False).

The steps and their order are RLinf's, quirks included (the unit words are regular expressions
matched unescaped, "and" is deleted anywhere, a lone "j" becomes "i"): a training reward must
agree with the run it reproduces, not with what a cleaner grader would judge.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

# RLinf's unit words (mostly from MathQA), in its order: they are removed one after another, so
# the order decides what is left. Each is also tried with an "s" appended.
# fmt: off
_UNIT_WORDS = (
    "east", "degree", "mph", "kmph", "ft", "m square", " m east", "sq m", "deg", "mile", "q .",
    "monkey", "prime", "ratio", "profit of rs", "rd", "o", "gm", "p . m", "lb", "tile", "per",
    "dm", "lt", "gain", "ab", "way", "west", "a .", "b .", "c .", "d .", "e .", "f .", "g .",
    "h .", "t", "a", "h", "no change", "men", "soldier", "pie", "bc", "excess", "st", "inches",
    "noon", "percent", "by", "gal", "kmh", "c", "acre", "rise", "a . m", "th", "π r 2", "sq",
    "mark", "l", "toy", "coin", "sq . m", "gallon", "° f", "profit", "minw", "yr", "women", "feet",
    "am", "pm", "hr", "cu cm", "square", "v â € ™", "are", "rupee", "rounds", "cubic", "cc", "mtr",
    "s", "ohm", "number", "kmph", "day", "hour", "minute", "min", "second", "man", "woman", "sec",
    "cube", "mt", "sq inch", "mp", "∏ cm ³", "hectare", "more", "sec", "unit", "cu . m", "cm 2",
    "rs .", "rs", "kg", "g", "month", "km", "m", "cm", "mm", "apple", "liter", "loss", "yard",
    "pure", "year", "increase", "decrease", "d", "less", "Surface", "litre", "pi sq m", "s .",
    "metre", "meter", "inch",
)
# fmt: on
UNIT_TEXTS: tuple[str, ...] = _UNIT_WORDS + tuple(word + "s" for word in _UNIT_WORDS)

# Text after which RLinf takes the rest of the answer as the final answer, tried in this order.
_ANSWER_IS = ("he answer is", "final answer is")


@cache
def _unit_patterns() -> tuple[re.Pattern[str], ...]:
    # Unescaped on purpose: RLinf builds the pattern from the word as is ("q ." matches "q x").
    return tuple(re.compile(r"(^|\W)" + word + r"($|\W)") for word in UNIT_TEXTS)


def _word_to_number(text: str) -> str:
    """RLinf's convert_word_number: the whole text as a number when word2number reads it so."""
    from word2number import w2n  # imported in the grading process only

    try:
        return str(w2n.word_to_num(text))
    except Exception:  # not a number in words: RLinf keeps the text as it is
        return text


def _fix_fracs(text: str) -> str:
    """\\frac12 -> \\frac{1}{2}, \\frac1{72} -> \\frac{1}{72}; the text unchanged when a \\frac
    has fewer than two characters after it."""
    head, *tails = text.split("\\frac")
    out = head
    for tail in tails:
        out += "\\frac"
        if tail.startswith("{"):
            out += tail
            continue
        if len(tail) < 2:
            return text
        a, b, rest = tail[0], tail[1], tail[2:]
        out += "{" + a + "}" + (b + rest if b == "{" else "{" + b + "}" + rest)
    return out


def _fix_a_slash_b(text: str) -> str:
    """An integer slash integer (either may be a sqrt) -> \\frac{a}{b}."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        a: Any = parts[0] if "sqrt" in parts[0] else int(parts[0])
        b: Any = parts[1] if "sqrt" in parts[1] else int(parts[1])
    except ValueError:
        return text
    if text != f"{a}/{b}":  # int() accepted something that is not plainly written ("+3", "1_0")
        return text
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _strip_latex_wrappers(text: str) -> str:
    """Whitespace, trailing dots, \\! spacing, array/bmatrix -> pmatrix, tfrac/dfrac, \\left and
    \\right, escaped braces, a trailing \\text{unit}."""
    text = str(text).strip().replace("\n", "").rstrip(".").replace("\\!", "")
    text = re.sub(r"\\begin\{array\}\{.*?\}", r"\\begin{pmatrix}", text)
    text = re.sub(r"\\end\{array\}", r"\\end{pmatrix}", text).replace("bmatrix", "pmatrix")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\neq", "\\ne").replace("\\leq", "\\le").replace("\\geq", "\\ge")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("\\{", "{").replace("\\}", "}")
    without_unit = re.sub(r"\\text{.*?}$", "", text).strip()
    if without_unit not in ("", text):
        text = without_unit
    return text


def _remove_units(text: str) -> str:
    for _ in range(2):
        for pattern in _unit_patterns():
            removed = pattern.sub(r"\1\2", text)
            if removed != "":
                text = removed
    return text


def _normalise_symbols(text: str) -> str:
    """Degrees, dollars, \\( \\), number words, \\text{}, variable prefixes, sets, percent."""
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "").replace("$", "").replace("\\(", "").replace("\\)", "")
    text = _word_to_number(text)
    text = re.sub(r"\\text\{(.*?)\}", r"\1", text)
    for prefix in ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to"):
        text = text.replace(prefix, "")
    text = text.replace("\\emptyset", r"{}").replace("(-\\infty,\\infty)", "\\mathbb{R}")
    text = text.replace("\\%", "").replace("%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    # (RLinf's strip of {x}, (x), [x] around an alphanumeric text never applies: a text that
    # starts with a bracket is not alphanumeric.)
    text = text.replace("infinity", "\\infty")
    if "\\infty" not in text:
        text = text.replace("inf", "\\infty")
    text = text.replace("+\\inity", "\\infty")
    text = text.replace("and", "").replace("\\mathbf", "")
    text = re.sub(r"\\mbox{.*?}", "", text)
    if "j" in text and "i" not in text:
        text = text.replace("j", "i")
    # 2.000x -> 2x, 3.0 -> 3
    text = re.sub(r"(\d+)\.0*([^\d])", r"\1\2", text)
    return re.sub(r"(\d+)\.0*$", r"\1", text)


def strip_string(text: str, skip_unit: bool = False) -> str:
    """RLinf's strip_string: the normal form both sides of a comparison are put in."""
    text = _strip_latex_wrappers(text)
    if not skip_unit:
        text = _remove_units(text)
    text = _normalise_symbols(text)
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    # "k = 5" -> "5": a left side of at most two characters is a name
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        text = sides[1]
    text = re.sub(r"\\sqrt(\w+)", r"\\sqrt{\1}", text).replace(" ", "")
    return _fix_a_slash_b(_fix_fracs(text))


def _boxed_content(text: str) -> str:
    """What follows the LAST 'boxed': the brace-balanced group (to the end when unclosed), or,
    without a brace, the text up to the next '$'."""
    after = text.split("boxed")[-1]
    if not after.startswith("{"):
        return after.split("$")[0].strip()
    depth, content = 1, []
    for char in after[1:]:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            break
        content.append(char)
    return "".join(content)


def extract_answer(text: str, must_match_pattern: bool = True) -> str:
    """RLinf's extract_answer(text, 'math', use_last_number=False), normalised by strip_string.

    A minerva 'final answer is $...$. I hope' wins, then the last \\boxed, then the text after
    the last 'he answer is' / 'final answer is', then after the first '答案是'. With none of them
    the answer is empty (wrong), or, with must_match_pattern=False (how RLinf reads a gold
    solution), the whole text.
    """
    text = text.replace("\u043a\u0438", "")  # the step tag "ки" of step-level data sets
    if "final answer is $" in text and "$. I hope" in text:
        pred = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0].strip()
    elif "boxed" in text:
        if not text.split("boxed")[-1]:
            return ""
        pred = _boxed_content(text)
    elif anchor := next((a for a in _ANSWER_IS if a in text), None):
        pred = text.split(anchor)[-1].strip()
    elif "答案是" in text:
        pred = text.split("答案是")[1].strip().split("\n\n")[0].strip()
    else:
        pred = "" if must_match_pattern else text
    pred = re.sub(r"\n\s*", "", pred)
    pred = pred.removeprefix(":")
    pred = pred[:-1] if pred.endswith(".") else pred
    pred = pred[:-1] if pred.endswith("/") else pred
    return strip_string(pred)


def choice_answer_clean(pred: str) -> str:
    """The last standalone letter A-E of a multiple-choice answer, else the answer trimmed."""
    pred = pred.strip("\n").rstrip(".").rstrip("/").strip(" ").lstrip(":")
    letters = re.findall(r"\b(A|B|C|D|E)\b", pred.upper())
    last = letters[-1] if letters else pred.strip().strip(".")
    return str(last).rstrip(".").rstrip("/")
