"""Override values read by Hydra's grammar (config/hydra_grammar.py), against what Hydra 1.3's
own parser gives for each (its OverrideLexer/OverrideParser and visitor: expected values written
from those rules), and through load_config as a user passes them."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

from rlinf_twoworker.config import load_config, to_typed
from rlinf_twoworker.config.hydra_grammar import HydraSyntaxError, parse_value
from rlinf_twoworker.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # typed primitives: one token
        ("1", 1),
        ("-20", -20),
        ("1_000_000", 1_000_000),
        ("3.14", 3.14),
        ("1e-3", 1e-3),
        (".5", 0.5),
        ("1.", 1.0),
        ("true", True),
        ("TrUe", True),
        ("false", False),
        ("null", None),
        ("NULL", None),
        # strings: several tokens, or a token that is not a number, bool or null
        ("0123", "0123"),
        ("12:30", "12:30"),
        ("2024-01-01", "2024-01-01"),
        ("true1", "true1"),
        ("no", "no"),
        ("on", "on"),
        ("foo-bar_10", "foo-bar_10"),
        ("hello world", "hello world"),
        ("  padded  ", "padded"),
        ("/mnt/shared/runs", "/mnt/shared/runs"),
        ("http://host:8080/path", "http://host:8080/path"),
        ("-", "-"),
        ("?", "?"),
        ("a|b", "a|b"),
        ("50%", "50%"),
        # escapes: undone in unquoted strings; a lone backslash is kept
        ("a\\,b", "a,b"),
        ("a\\ b", "a b"),
        ("a\\=b", "a=b"),
        ("a\\b", "a\\b"),
        # quoted strings
        ("'a,b=c'", "a,b=c"),
        ('"1"', "1"),
        ("'null'", "null"),
        ('"a\\"b"', 'a"b'),
        ("'tail\\\\'", "tail\\"),
        # interpolations stay as written (OmegaConf resolves them)
        ("${a.b}", "${a.b}"),
        ("${oc.env:USER,me}", "${oc.env:USER,me}"),
        ("'${f:${a},${b}}'", "${f:${a},${b}}"),
        ("xyz_${a.b}", "xyz_${a.b}"),
        # containers
        ("[]", []),
        ("[1, a, [2, 3]]", [1, "a", [2, 3]]),
        ("{}", {}),
        ("{a:1,b: [x, y]}", {"a": 1, "b": ["x", "y"]}),
        ("[/data/a.jsonl,/data/b.jsonl]", ["/data/a.jsonl", "/data/b.jsonl"]),
        # cast functions
        ("str(1)", "1"),
        ("int(3.7)", 3),
        ("float(2)", 2.0),
        ("bool(false)", False),
        ("str([1, 2])", ["1", "2"]),
        # `key=` sets the empty string
        ("", ""),
    ],
)
def test_a_value_means_what_it_means_to_hydra(text, expected):
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_inf_and_nan_are_floats():
    assert parse_value("inf") == math.inf and parse_value("-inf") == -math.inf
    assert math.isnan(parse_value("nan"))


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("#/tmp/x", "'#' at column 1 is not allowed"),
        ("&x", "'&' at column 1 is not allowed"),
        ("a!b", "'!' at column 2 is not allowed"),
        ("/tmp/a=b", "'=' at column 7"),
        ("a,b", "is a Hydra sweep"),
        ("${f:${a},${b}}", "an interpolation with a ',' in it is quoted"),
        ("range(1,3)", "range(...) in 'range(1,3)' is a Hydra sweep function"),
        ("choice(a,b)", "is a Hydra sweep function"),
        ("frob(1)", "is not a function Hydra's grammar knows"),
        ("[1, 2", "ends too early"),
        ("{a 1}", "expected ':' after a dict key"),
        ("'open", "close the quote"),
        ("int(abc)", "cannot be cast"),
    ],
)
def test_what_hydra_refuses_is_refused_saying_where(text, said):
    with pytest.raises(HydraSyntaxError) as refused:
        parse_value(text)
    assert said in str(refused.value)


def test_through_load_config_a_refused_value_is_a_config_error_naming_the_key(tmp_path):
    """The cases that used to be read silently otherwise: resume silently off (`#`, `&`), a
    path with '=' kept, '-' as a list, '?' as a map, a backslash kept."""
    for value in ("#/tmp/x", "&x", "/tmp/a=b"):
        with pytest.raises(ConfigError, match=r"config key 'runner\.resume_dir'"):
            load_config(overrides=[f"runner.resume_dir={value}"])
    typed = to_typed(load_config(overrides=["runner.output_dir=/runs/a\\,b"]))
    assert typed.runner.output_dir == "/runs/a,b"
    assert to_typed(load_config(overrides=["runner.output_dir=-"])).runner.output_dir == "-"


# --- against hydra-core itself ------------------------------------------------------------------
# hydra-core pins antlr4 4.9 and so cannot share the library's environment (module docstring of
# config/hydra_grammar.py); .ci/run installs it in a venv of its own and names that venv's
# Python in RLINF_HYDRA_PYTHON. Each value below is read there by Hydra's own OverridesParser.
HYDRA_PYTHON = os.environ.get("RLINF_HYDRA_PYTHON", "")
_HYDRA_READS = r"""
import json, math, sys
from hydra.core.override_parser.overrides_parser import OverridesParser
parser = OverridesParser.create()
out = []
for value in json.loads(sys.stdin.read()):
    try:
        override = parser.parse_override("k=" + value)
    except Exception as exc:
        out.append(["refused", type(exc).__name__])
        continue
    if override.is_sweep_override():
        out.append(["sweep", None])
    else:
        out.append(["value", override.value()])
print(json.dumps(out))
"""
AGAINST_HYDRA = [
    # numbers, bools, null
    "1",
    "-7",
    "+3",
    "1_000",
    "0123",
    "1.5",
    "-.5",
    "5.",
    "1e-3",
    "1E5",
    "-2.5e+3",
    "inf",
    "-inf",
    "nan",
    "NaN",
    "true",
    "False",
    "TRUE",
    "null",
    "NULL",
    # strings, quotes, escapes, special characters
    "abc",
    "a b",
    "  padded  ",
    "12:30",
    "2024-01-01",
    "/data/a.jsonl",
    "a\\,b",
    "a\\ b",
    "\\[x\\]",
    "'x y'",
    '"x, y"',
    "'it\\'s'",
    '"say \\"hi\\""',
    "'a=b'",
    "~/x",
    "a-b_c.d",
    "$HOME/x",
    "%p",
    "*.json",
    "a@b",
    "x?y",
    "a|b",
    "a+b",
    # interpolations
    "${a.b}",
    "${oc.env:USER,me}",
    "'${f:${a},${b}}'",
    "xyz_${a.b}",
    "${a}${b}",
    # containers
    "[]",
    "[1, a, [2, 3]]",
    "{}",
    "{a:1,b: [x, y]}",
    "[/data/a.jsonl,/data/b.jsonl]",
    "{a: null, b: 'q'}",
    "[true, 1.5, x]",
    "['a,b', c]",
    # cast functions
    "str(1)",
    "int(3.7)",
    "float(2)",
    "bool(false)",
    "str([1, 2])",
    "int('5')",
    # what Hydra refuses, and its sweeps
    "#/tmp/x",
    "&x",
    "a!b",
    "/tmp/a=b",
    "[1, 2",
    "{a 1}",
    "'open",
    "frob(1)",
    "a,b",
    "range(1,3)",
    "choice(a,b)",
]


def _library_reads(value: str) -> list:
    try:
        read = parse_value(value)
    except HydraSyntaxError as exc:
        return ["sweep", None] if "sweep" in str(exc) else ["refused", "HydraSyntaxError"]
    return ["value", read]


def _same(ours: object, theirs: object) -> bool:
    if isinstance(ours, float) and isinstance(theirs, float):
        return (math.isnan(ours) and math.isnan(theirs)) or ours == theirs
    if isinstance(ours, list | tuple) and isinstance(theirs, list | tuple):
        return len(ours) == len(theirs) and all(map(_same, ours, theirs))
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(_same(ours[k], theirs[k]) for k in ours)
    return type(ours) is type(theirs) and ours == theirs


@pytest.mark.skipif(
    not HYDRA_PYTHON,
    reason="RLINF_HYDRA_PYTHON is unset: .ci/run makes a venv with hydra-core and sets it",
)
def test_every_value_reads_as_hydra_core_reads_it():
    """70 values of every kind, read by hydra-core 1.3's own parser and by the library: the
    same value and type, the same refusals, the same sweeps (which the library refuses)."""
    done = subprocess.run(
        [HYDRA_PYTHON, "-c", _HYDRA_READS],
        input=json.dumps(AGAINST_HYDRA),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    hydra = json.loads(done.stdout)
    assert len(hydra) == len(AGAINST_HYDRA) >= 30
    ours = [_library_reads(value) for value in AGAINST_HYDRA]
    differ = [
        (value, theirs, mine)
        for value, theirs, mine in zip(AGAINST_HYDRA, hydra, ours, strict=True)
        if not (theirs[0] == mine[0] and (theirs[0] != "value" or _same(mine[1], theirs[1])))
    ]
    assert not differ, differ
    kinds = {kind for kind, _ in hydra}
    assert kinds == {"value", "refused", "sweep"}, kinds
