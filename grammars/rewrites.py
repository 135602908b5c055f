"""The schema a backend compiles: the user's, rewritten into an equivalent one it can enforce exactly (each
rewrite's module says what it changes and why). The user's own schema is what outputs are validated against.

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

from typing import Any

try:
    from .dependencies import with_dependencies_spelled_out
    from .exclusive import disjoint_one_of
    from .formats import with_exact_dates, without_annotation_formats
    from .negation import without_negations
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from dependencies import with_dependencies_spelled_out
    from exclusive import disjoint_one_of
    from formats import with_exact_dates, without_annotation_formats
    from negation import without_negations


def equivalent_schema(schema: Any) -> Any:
    schema = disjoint_one_of(without_negations(with_dependencies_spelled_out(schema)))
    return with_exact_dates(without_annotation_formats(schema))
