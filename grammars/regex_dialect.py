"""The regex kind's dialect: Python's `re` syntax, with `\\d` and `\\w` the ASCII classes `[0-9]` and
`[0-9A-Za-z_]`, as in JSON Schema's patterns (ECMA-262) and in xgrammar.

ASCII classes are what a user of a constrained regex means by `\\d{3}`: a model let loose on Unicode digits writes
`༣3🯸`, which no downstream parser takes, and every ASCII output still matches under Python's Unicode classes.
Backends whose classes are Unicode (llguidance, outlines-core) get the regex rewritten with explicit ASCII classes.
"""

from __future__ import annotations

ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}
NEGATED = {"D": "d", "W": "w"}


def with_ascii_classes(regex: str) -> tuple[str, list[str]]:
    """`regex` with `\\d`, `\\w` (and outside brackets `\\D`, `\\W`) spelled as ASCII classes, and the constructs
    left as they were that a Unicode engine reads differently (`\\D`, `\\W` inside brackets)."""
    out: list[str] = []
    departures: list[str] = []
    in_class = False
    class_start = 0  # index in `out` where the current bracket's members begin
    i = 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            escape = regex[i + 1]
            i += 2
            if escape in ASCII_CLASSES:
                out.append(ASCII_CLASSES[escape] if in_class else f"[{ASCII_CLASSES[escape]}]")
            elif escape in NEGATED and not in_class:
                out.append(f"[^{ASCII_CLASSES[NEGATED[escape]]}]")
            else:
                if escape in NEGATED:
                    departures.append(f"\\{escape} inside brackets: excludes every Unicode "
                                      f"{'digit' if escape == 'D' else 'letter or digit'}, not ASCII ones only")
                out.append(char + escape)
            continue
        if not in_class and char == "[":
            in_class = True
            out.append(char)
            i += 1
            if i < len(regex) and regex[i] == "^":
                out.append("^")
                i += 1
            class_start = len(out)
            continue
        # A `]` right after `[` or `[^` is a member, not the end (Python's rule).
        if in_class and char == "]" and len(out) > class_start:
            in_class = False
        out.append(char)
        i += 1
    return "".join(out), list(dict.fromkeys(departures))
