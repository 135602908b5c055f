"""The schema a backend compiles: the user's, rewritten into an equivalent one it can enforce exactly (each
rewrite's module says what it changes and why). The user's own schema is what outputs are validated against.

Standard library only, with no package-relative imports: the outlines compile child imports this file by path.
"""

from __future__ import annotations

from typing import Any

try:
    from .exclusive import disjoint_one_of
    from .formats import with_exact_dates
    from .negation import without_negations
except ImportError:  # run by path in the outlines compile child, with this folder on sys.path
    from exclusive import disjoint_one_of
    from formats import with_exact_dates
    from negation import without_negations


def equivalent_schema(schema: Any) -> Any:
    return with_exact_dates(disjoint_one_of(without_negations(schema)))
