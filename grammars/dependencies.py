"""Property dependencies spelled out with `anyOf`: `dependencies: {"a": ["b"]}` (and 2019-09's `dependentRequired`)
means an object that has "a" also has "b", which is `anyOf: [{"properties": {"a": false}}, {"required": ["a", "b"]}]`.
llguidance refuses the keyword and xgrammar and outlines-core ignore it; all three enforce the anyOf. Dependencies
on a schema (`dependencies: {"a": {...}}`) stay as they are.

`dependencies` exists up to draft 7 and `dependentRequired` from 2019-09 on; each is rewritten only where the
schema's draft defines it (a schema that names no draft is read as 2020-12, as `jsonschema` reads it).

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

import copy
from typing import Any

try:
    from .schema_keywords import schemas_in
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from schema_keywords import schemas_in

OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


def with_dependencies_spelled_out(schema: Any) -> Any:
    """A copy of the schema where each property dependency on other properties is an anyOf."""
    result = copy.deepcopy(schema)
    if not isinstance(result, dict):
        return result
    declared = result.get("$schema") if isinstance(result.get("$schema"), str) else ""
    keyword = "dependencies" if any(draft in declared for draft in OLD_DRAFTS) else "dependentRequired"
    for node in schemas_in(result):
        rules = node.get(keyword)
        if not isinstance(rules, dict) or not all(_names(needed) for needed in rules.values()):
            continue
        del node[keyword]
        branches = [{"anyOf": [{"properties": {key: False}}, {"required": [key, *needed]}]}
                    for key, needed in rules.items() if needed]
        if len(branches) == 1 and "anyOf" not in node:
            node.update(branches[0])
        elif branches:
            node["allOf"] = [*node.get("allOf", []), *branches]
    return result


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(name, str) for name in value)
