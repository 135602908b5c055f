"""Our EBNF (xgrammar's GBNF dialect: `root ::= ...`) translated into the Lark syntax llguidance reads.

llguidance splits a Lark grammar into lexemes and lexes greedily: a multi-character lexeme never ends early to let
the next one match (`a ::= [a-z]+` then `b ::= [a-z]` rejects "abc" once `a` is one lexeme, and so does
`("a" | "ab") "bc"`). llguidance's own GBNF converter makes such rules lexemes, so it changes the language. Here
every lexeme is one character: each string literal becomes a sequence of one-character literals, each character
class a one-character regex, and every rule a (lowercase) Lark rule, so the Earley parser sees exactly the EBNF's
context-free language. The price is speed: a mask costs ~1 ms per token instead of ~10 us (measured on a list of
strings), so the auto backend prefers xgrammar for EBNF.

What the translation cannot keep (xgrammar's lookahead assertions and its other extensions) raises ValueError.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
RULE_START = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*)\s*::=")
SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", "[": "[", "]": "]", "-": "-",
                  "/": "/", "^": "^", "b": "\b", "f": "\f", "v": "\v", "0": "\0"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


@dataclass
class Cursor:
    text: str
    pos: int = 0

    def skip_space(self) -> None:
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "#":
                end = self.text.find("\n", self.pos)
                self.pos = len(self.text) if end < 0 else end
            elif char.isspace():
                self.pos += 1
            else:
                return

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos: self.pos + 1]

    def at_rule_start(self) -> bool:
        self.skip_space()
        return RULE_START.match(self.text, self.pos) is not None

    def error(self, message: str) -> ValueError:
        line = self.text.count("\n", 0, self.pos) + 1
        return ValueError(f"{message} at line {line}: {self.text[self.pos:self.pos + 20]!r}")


def ebnf_to_lark(ebnf: str) -> str:
    """The Lark grammar of the same language; ValueError naming what cannot be translated or parsed."""
    cursor = Cursor(ebnf)
    bodies: dict[str, str] = {}
    while cursor.peek():
        match = RULE_START.match(cursor.text, cursor.pos)
        if match is None:
            raise cursor.error("expected `name ::=`")
        cursor.pos = match.end()
        if match.group(1) in bodies:
            raise cursor.error(f"rule {match.group(1)!r} is defined twice")
        bodies[match.group(1)] = alternatives(cursor, top_level=True)
    if "root" not in bodies:
        raise ValueError("the grammar has no `root` rule")
    names = {name: f"r{index}_{re.sub(r'[^a-z0-9_]', '_', name.lower())}" for index, name in enumerate(bodies)}
    lines = ["start: " + names["root"]]
    for name, body in bodies.items():
        lines.append(f"{names[name]}: {rename_refs(body, names)}")
    return "\n".join(lines) + "\n"


def rename_refs(body: str, names: dict[str, str]) -> str:
    """Rule references are written as NUL name NUL while parsing (rules may be used before they are defined); NUL
    appears nowhere else in the output, as json.dumps and regex_char escape every control character."""

    def lark_name(match: re.Match) -> str:
        if match.group(1) not in names:
            raise ValueError(f"rule {match.group(1)!r} is used but never defined")
        return names[match.group(1)]

    return re.sub("\0([^\0]+)\0", lark_name, body)


def alternatives(cursor: Cursor, top_level: bool) -> str:
    options = [sequence(cursor, top_level)]
    while cursor.peek() == "|":
        cursor.pos += 1
        options.append(sequence(cursor, top_level))
    return " | ".join(options)


def sequence(cursor: Cursor, top_level: bool) -> str:
    items = []
    while (char := cursor.peek()) and char not in "|)" and not (top_level and cursor.at_rule_start()):
        items.append(quantified(cursor, atom(cursor)))
    return " ".join(items) if items else '""'


def atom(cursor: Cursor) -> str:
    char = cursor.peek()
    if char == '"':
        return literal(cursor)
    if char == "[":
        return char_class(cursor)
    if char == "(":
        cursor.pos += 1
        if cursor.peek() == "=":
            raise cursor.error("lookahead assertions `(= ...)` are not supported by the llguidance backend")
        inner = alternatives(cursor, top_level=False)
        if cursor.peek() != ")":
            raise cursor.error("expected `)`")
        cursor.pos += 1
        return f"({inner})"
    match = NAME.match(cursor.text, cursor.pos)
    if match is None:
        raise cursor.error("unexpected character")
    cursor.pos = match.end()
    if cursor.text.startswith("(", cursor.pos):  # TagDispatch(...), Regex(...): xgrammar's own extensions
        raise cursor.error(f"{match.group()}(...) is an xgrammar extension the llguidance backend does not support")
    return f"\0{match.group()}\0"


def quantified(cursor: Cursor, item: str) -> str:
    char = cursor.peek()
    if char in ("*", "+", "?"):
        cursor.pos += 1
        return f"({item}){char}"
    match = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}").match(cursor.text, cursor.pos)
    if char != "{" or match is None:
        return item
    cursor.pos = match.end()
    low, comma, high = match.groups()
    if not comma:
        return f"({item}){{{low}}}"
    return f"({item}){{{low or 0},{high}}}"


def read_char(cursor: Cursor) -> str:
    """One character of a literal or class, escapes decoded."""
    text = cursor.text
    if cursor.pos >= len(text):
        raise cursor.error("unterminated literal or character class")
    char = text[cursor.pos]
    cursor.pos += 1
    if char != "\\":
        return char
    escape = text[cursor.pos: cursor.pos + 1]
    cursor.pos += 1
    if escape in HEX_ESCAPES:
        digits = text[cursor.pos: cursor.pos + HEX_ESCAPES[escape]]
        if len(digits) != HEX_ESCAPES[escape] or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise cursor.error(f"bad \\{escape} escape")
        cursor.pos += len(digits)
        return chr(int(digits, 16))
    if escape not in SIMPLE_ESCAPES:
        raise cursor.error(f"unknown escape \\{escape}")
    return SIMPLE_ESCAPES[escape]


def literal(cursor: Cursor) -> str:
    cursor.pos += 1  # the opening quote
    chars = []
    while cursor.text[cursor.pos: cursor.pos + 1] != '"':
        chars.append(read_char(cursor))
    cursor.pos += 1
    # One lexeme per character keeps llguidance's greedy lexer from changing the language (see the module doc).
    return " ".join(json.dumps(char, ensure_ascii=False) for char in chars) if chars else '""'


def char_class(cursor: Cursor) -> str:
    cursor.pos += 1  # the opening bracket
    negated = cursor.text[cursor.pos: cursor.pos + 1] == "^"
    cursor.pos += negated
    parts = []
    while cursor.text[cursor.pos: cursor.pos + 1] != "]":
        low = read_char(cursor)
        if cursor.text[cursor.pos: cursor.pos + 1] == "-" and cursor.text[cursor.pos + 1: cursor.pos + 2] != "]":
            cursor.pos += 1
            high = read_char(cursor)
            if ord(high) < ord(low):
                raise cursor.error(f"empty range {low!r}-{high!r}")
            parts.append(f"{regex_char(low)}-{regex_char(high)}")
        else:
            parts.append(regex_char(low))
    cursor.pos += 1
    return f"/[{'^' if negated else ''}{''.join(parts)}]/"


def regex_char(char: str) -> str:
    """A character inside a Rust regex class, written so that no character is special there or in Lark's /.../."""
    return char if char.isalnum() and char.isascii() else f"\\x{{{ord(char):X}}}"
