"""The value of a command-line override, read by Hydra's override grammar (hydra-core 1.3).

hydra-core cannot be installed beside the library: it pins antlr4 4.9, and sympy's LaTeX parser
(RLinf's grader) needs 4.11. This module reads the value side of `key=value` by the rules of
Hydra's OverrideLexer.g4 / OverrideParser.g4 and its visitor, so a value means what it means on
Hydra's (and RLinf's) command line:

- tokens are matched longest first, ties going to the earlier rule, as ANTLR's lexer does;
- a primitive of one token is typed: `null`, `true`/`false` (any case), ints (`1_000`),
  floats (`1.5`, `1e-3`, `inf`, `nan`); anything else is the string of its tokens with the
  whitespace around it dropped and escapes undone (`a\\,b` is `a,b`; `0123`, `12:30` and
  `2024-01-01` stay strings);
- `'...'` and `"..."` are strings (a backslash run before a quote is unescaped, as Hydra does);
- `[a, b]` is a list and `{a: 1, b: 2}` a dict (keys are strings);
- `int(...)`, `float(...)`, `str(...)`, `bool(...)` cast as Hydra's cast functions do.

What Hydra itself refuses is refused (HydraSyntaxError names the character and where):
characters outside the grammar (`#`, `&`, `!`, an unquoted `=` ...), an unclosed bracket or
quote. A sweep (`a,b`) or a sweep function (`range`, `choice`, `glob`, ...) is Hydra's multirun,
which the library does not run: refused with what to write instead.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

_INT_UNSIGNED = r"(?:0|[1-9](?:_?[0-9])*)"
_DIGITS = r"[0-9](?:_?[0-9])*"
_POINT_FLOAT = rf"(?:{_INT_UNSIGNED}?\.{_DIGITS}|{_INT_UNSIGNED}\.)"
_EXPONENT_FLOAT = rf"(?:(?:{_POINT_FLOAT}|{_INT_UNSIGNED})[eE][+-]?{_DIGITS})"
_WS = r"[ \t]"

# (name, pattern) in the lexer's rule order (VALUE_MODE); the longest match wins, then the
# earlier rule. Each pattern is written so that Python's greedy match is that rule's longest.
_TOKENS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.DOTALL))
    for name, pattern in (
        ("POPEN", rf"{_WS}*\({_WS}*"),
        ("COMMA", rf"{_WS}*,{_WS}*"),
        ("PCLOSE", rf"{_WS}*\)"),
        ("BRACKET_OPEN", rf"\[{_WS}*"),
        ("BRACKET_CLOSE", rf"{_WS}*\]"),
        ("BRACE_OPEN", rf"\{{{_WS}*"),
        ("BRACE_CLOSE", rf"{_WS}*\}}"),
        ("COLON", rf"{_WS}*:{_WS}*"),
        ("EQUAL", rf"{_WS}*={_WS}*"),
        ("FLOAT", rf"[+-]?(?:{_EXPONENT_FLOAT}|{_POINT_FLOAT}|[Ii][Nn][Ff]|[Nn][Aa][Nn])"),
        ("INT", rf"[+-]?{_INT_UNSIGNED}"),
        ("BOOL", r"(?:[Tt][Rr][Uu][Ee]|[Ff][Aa][Ll][Ss][Ee])"),
        ("NULL", r"[Nn][Uu][Ll][Ll]"),
        ("UNQUOTED_CHAR", r"[/\-\\+.$%*@?|]"),
        ("ID", r"[A-Za-z_][A-Za-z0-9_\-]*"),
        ("ESC", r"(?:\\\\|\\\(|\\\)|\\\[|\\\]|\\\{|\\\}|\\:|\\=|\\,|\\ |\\\t)+"),
        ("WS", rf"{_WS}+"),
        ("QUOTED_VALUE", r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'"),
        ("INTERPOLATION", r"\$\{[^}]+\}"),
    )
)
_PRIMITIVE_PARTS = {
    "ID",
    "NULL",
    "INT",
    "FLOAT",
    "BOOL",
    "INTERPOLATION",
    "UNQUOTED_CHAR",
    "COLON",
    "ESC",
    "WS",
}
_DICT_KEY_PARTS = _PRIMITIVE_PARTS - {"COLON", "INTERPOLATION"}
CAST_FUNCTIONS = ("int", "float", "str", "bool")
SWEEP_FUNCTIONS = ("choice", "range", "interval", "tag", "sort", "shuffle", "glob", "extend_list")
_QUOTE_ESCAPES = {"'": re.compile(r"(\\)+'"), '"': re.compile(r'(\\)+"')}


class HydraSyntaxError(ValueError):
    """The value breaks Hydra's override grammar, or asks for a multirun."""


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    at: int


def _tokens(value: str) -> list[_Token]:
    out, at = [], 0
    while at < len(value):
        best: tuple[int, str] | None = None
        for name, pattern in _TOKENS:
            found = pattern.match(value, at)
            if found and found.end() > at and (best is None or found.end() > best[0]):
                best = (found.end(), name)
        if best is None:
            char = value[at]
            hint = (
                "quote the value ('...' or \"...\") to use it"
                if char not in "'\""
                else "close the quote"
            )
            raise HydraSyntaxError(
                f"{char!r} at column {at + 1} is not allowed in a Hydra override value; {hint}"
            )
        out.append(_Token(best[1], value[at : best[0]], at))
        at = best[0]
    return out


def parse_value(value: str) -> Any:
    """The value of an override, as Hydra's grammar and visitor read it (module docstring).
    The empty string is the empty string, as `key=` is in Hydra."""
    text = value.lstrip(" \t")  # Hydra's EQUAL token takes the whitespace after '='
    if not text:
        return ""
    parser = _Parser(_tokens(text), text)
    element = parser.element()
    if parser.peek("COMMA"):
        raise HydraSyntaxError(
            f"{text!r} is a Hydra sweep (values separated by ','), which only Hydra's multirun "
            "runs; give one value: a list is [a,b], and a ',' inside a string is \\, or quoted"
            + (" (an interpolation with a ',' in it is quoted: '${...}')" if "${" in text else "")
        )
    parser.expect_end()
    return element


class _Parser:
    def __init__(self, tokens: list[_Token], text: str) -> None:
        self.tokens, self.text, self.i = tokens, text, 0

    def peek(self, *kinds: str) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i].kind in kinds

    def take(self, kind: str, what: str) -> _Token:
        if not self.peek(kind):
            raise self.error(f"expected {what}")
        self.i += 1
        return self.tokens[self.i - 1]

    def error(self, expected: str) -> HydraSyntaxError:
        if self.i >= len(self.tokens):
            return HydraSyntaxError(f"{self.text!r} ends too early: {expected}")
        token = self.tokens[self.i]
        return HydraSyntaxError(
            f"{token.text.strip()!r} at column {token.at + 1} of {self.text!r}: {expected}"
        )

    def expect_end(self) -> None:
        if self.i < len(self.tokens):
            raise self.error("expected the end of the value (quote the value to keep it whole)")

    def element(self) -> Any:
        if self.peek("BRACKET_OPEN"):
            return self.list_()
        if self.peek("BRACE_OPEN"):
            return self.dict_()
        if (
            self.peek("ID")
            and self.i + 1 < len(self.tokens)
            and self.tokens[self.i + 1].kind == "POPEN"
        ):
            return self.function()
        return self.primitive()

    def list_(self) -> list[Any]:
        self.take("BRACKET_OPEN", "'['")
        items: list[Any] = []
        if not self.peek("BRACKET_CLOSE"):
            items.append(self.element())
            while self.peek("COMMA"):
                self.i += 1
                items.append(self.element())
        self.take("BRACKET_CLOSE", "',' or ']'")
        return items

    def dict_(self) -> dict[str, Any]:
        self.take("BRACE_OPEN", "'{'")
        items: dict[str, Any] = {}
        if not self.peek("BRACE_CLOSE"):
            while True:
                key = self.dict_key()
                self.take("COLON", "':' after a dict key")
                items[key] = self.element()
                if not self.peek("COMMA"):
                    break
                self.i += 1
        self.take("BRACE_CLOSE", "',' or '}'")
        return items

    def dict_key(self) -> str:
        parts = self._run(_DICT_KEY_PARTS)
        if not parts:
            raise self.error("expected a dict key")
        return str(_join(parts))

    def function(self) -> Any:
        name = self.take("ID", "a function name").text
        if name in SWEEP_FUNCTIONS:
            raise HydraSyntaxError(
                f"{name}(...) in {self.text!r} is a Hydra sweep function, which only Hydra's "
                "multirun runs; give one value"
            )
        if name not in CAST_FUNCTIONS:
            raise HydraSyntaxError(
                f"{name}(...) in {self.text!r} is not a function Hydra's grammar knows here; "
                f"the cast functions are {', '.join(CAST_FUNCTIONS)} (quote the value to "
                "give it as a string)"
            )
        self.take("POPEN", "'('")
        arg = self.element()
        self.take("PCLOSE", "')' (a cast function takes one value)")
        return _cast(name, arg, self.text)

    def primitive(self) -> Any:
        if self.peek("QUOTED_VALUE"):
            token = self.tokens[self.i]
            self.i += 1
            return _unquote(token.text)
        parts = self._run(_PRIMITIVE_PARTS)
        if not parts:
            raise self.error("expected a value")
        return _join(parts)

    def _run(self, kinds: set[str]) -> list[_Token]:
        start = self.i
        while self.peek(*kinds):
            self.i += 1
        return self.tokens[start : self.i]


def _join(parts: list[_Token]) -> Any:
    """A primitive's value from its tokens (Hydra's _createPrimitive)."""
    while parts and parts[0].kind == "WS":
        parts = parts[1:]
    while parts and parts[-1].kind == "WS":
        parts = parts[:-1]
    if not parts:
        raise HydraSyntaxError("a value made only of whitespace")
    if len(parts) > 1:
        return "".join(p.text[1::2] if p.kind == "ESC" else p.text for p in parts)
    token = parts[0]
    if token.kind == "INT":
        return int(token.text)
    if token.kind == "FLOAT":
        return float(token.text)
    if token.kind == "NULL":
        return None
    if token.kind == "BOOL":
        return token.text.lower() == "true"
    if token.kind == "ESC":
        return token.text[1::2]
    return token.text


def _unquote(text: str) -> str:
    """A quoted value's string: backslash runs before the enclosing quote character halved
    (Hydra's _unescape_quoted_string); other backslashes are kept."""
    quote, body = text[0], text[1:]
    out = []
    pattern = _QUOTE_ESCAPES[quote]
    found = pattern.search(body)
    while found is not None:
        start, stop = found.span()
        out.append(body[:start])
        out.append(body[start + 1 : stop : 2])
        body = body[stop:]
        found = pattern.search(body)
    if len(body) > 1:
        out.append(body[:-1])
    return "".join(out)


def _cast(name: str, value: Any, text: str) -> Any:
    """Hydra's cast functions, element by element through lists and dicts."""
    if isinstance(value, list):
        return [_cast(name, v, text) for v in value]
    if isinstance(value, dict):
        return {k: _cast(name, v, text) for k, v in value.items()}
    try:
        if name == "str":
            if value is None or isinstance(value, bool):
                return {None: "null", True: "true", False: "false"}[value]
            return str(value)
        if name == "bool":
            if isinstance(value, str):
                lowered = value.lower()
                if lowered in ("true", "false"):
                    return lowered == "true"
                raise ValueError(value)
            return bool(value)
        if name == "int":
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(value)
            return int(float(value)) if isinstance(value, str) else int(value)
        return float(value)
    except (TypeError, ValueError):
        raise HydraSyntaxError(f"{name}({value!r}) in {text!r} cannot be cast") from None
