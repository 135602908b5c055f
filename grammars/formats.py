"""String formats: exact regexes for date and date-time, and strings each format forbids, to test a backend's grammar
for a format by trying it.

Measured (tests/test_grammar_fidelity.py pins it): llguidance's date accepts February 29 of every year; xgrammar's
also February 30 and 31 and April 31; outlines-core's likewise. So before a schema reaches any backend, `date` and
`date-time` become patterns that know the days of each month and the leap years; every other format a backend
implements is tried on the strings it forbids, and one it lets through makes the grammar an approximation.

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

try:
    from .schema_keywords import schemas_in
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from schema_keywords import schemas_in

_MONTH_DAY = (r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              r"|02-(?:0[1-9]|1[0-9]|2[0-8]))")
# Leap years: divisible by 4, except centuries not divisible by 400.
_LEAP_DAY = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)-02-29"
DATE = rf"(?:[0-9]{{4}}-{_MONTH_DAY}|{_LEAP_DAY})"
# RFC 3339 full-time; the second may be 60 (a leap second), and T and Z may be lowercase.
TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
EXACT_PATTERNS = {"date": f"^{DATE}$", "date-time": f"^{DATE}[Tt]{TIME}$"}

# Strings each format forbids (RFC 3339, 1123, 2673, 4291, 4122, 5321, 3986, 6570, the JSON Schema Test Suite's
# optional format tests). A grammar for the format that accepts one of them only approximates the format.
PROBES = {
    "date": ("2021-02-29", "2022-02-31", "2022-04-31", "2022-13-01", "2022-1-01"),
    "date-time": ("2021-02-29T10:00:00Z", "2022-01-01T10:00:00", "2022-01-01T24:00:00Z"),
    "time": ("24:00:00Z", "10:60:00Z", "10:00:00"),
    "duration": ("P", "PT1D", "P1DT", "1D"),
    "ipv4": ("256.1.1.1", "1.1.1", "01.1.1.1"),
    "ipv6": ("1:2:3:4:5:6:7:8:9", "1::2::3", "12345::"),
    "uuid": ("123e4567-e89b-12d3-a456-42661417400g", "123e4567e89b12d3a456426614174000"),
    "hostname": ("-a.com", "a_b.com", "a" * 64 + ".com"),
    "email": ("a@", "@b.com", "a b@c.com", "a..b@c.com"),
    "uri": ("a b", "//a.com", "x"),
    "uri-reference": ("a b", "\\\\a"),
    "uri-template": ("/a/{b", "/a/}"),
    "relative-json-pointer": ("/a", "-1/a"),
    "json-pointer": ("a", "/~2"),
}
# The formats JSON Schema defines (draft 7 and 2020-12). Any other format is an annotation: the spec has validators
# ignore it, and so does `jsonschema`, which checks finished outputs.
SPEC_FORMATS = frozenset({
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6", "uri",
    "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer", "relative-json-pointer",
    "regex"})


def without_annotation_formats(schema: Any) -> Any:
    """A copy of the schema without the formats JSON Schema does not define ("phone", "byte", ...): they constrain
    nothing, and a backend that does not know them would otherwise report, refuse or guess at them."""
    result = copy.deepcopy(schema)
    for node in schemas_in(result):
        if isinstance(node.get("format"), str) and node["format"] not in SPEC_FORMATS:
            del node["format"]
    return result


def with_exact_dates(schema: Any) -> Any:
    """A copy of the schema where `format: date` and `format: date-time` are exact patterns (added beside a pattern
    the subschema already has, through allOf: both must match)."""
    result = copy.deepcopy(schema)
    for node in schemas_in(result):
        pattern = EXACT_PATTERNS.get(node.get("format")) if isinstance(node.get("format"), str) else None
        if pattern is None:
            continue
        del node["format"]
        if "pattern" in node:
            node["allOf"] = [*node.get("allOf", []), {"pattern": pattern}]
        else:
            node["pattern"] = pattern
    return result


def formats_used(schema: Any) -> list[str]:
    return list(dict.fromkeys(node["format"] for node in schemas_in(schema) if isinstance(node.get("format"), str)))


def format_departures(schema: Any, tester: Callable[[str], Callable[[str], bool] | None]) -> list[str]:
    """For each format in the schema, `tester(format)` is the backend's grammar for `{"type": "string", "format":
    format}` as a function from a string to whether it takes that string as a JSON string, or None when the backend
    does not implement the format (it then reports that itself: an error or an ignored keyword)."""
    departures = []
    for fmt in formats_used(schema):
        accepts = tester(fmt)
        if accepts is None:
            continue
        if fmt not in PROBES:
            departures.append(f"format {fmt!r}: implemented, but not tried against strings it forbids")
        elif wrong := [probe for probe in PROBES[fmt] if accepts(probe)]:
            departures.append(f"format {fmt!r}: accepts {wrong[0]!r}, which it forbids")
    return departures


def regex_accepts(regex: str, text: str) -> bool:
    """Whole-string match with Python's re, for backends that lower a format to a regex."""
    try:
        return re.fullmatch(regex, text) is not None
    except re.error:
        return False
