"""Random JSON-like values in every sampling field: a ValueError naming the problem or a valid result; never
another exception, never a hang, and the engine's bookkeeping stays whole."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import assert_pool_free
from furcate.grammars.spec import KINDS
from furcate.runtime.sampling.params import SamplingParams

# The request's fields: the dataclass's, less the grammar built from the constraint fields, plus those.
FIELDS = [name for name in SamplingParams.__dataclass_fields__ if name != "grammar"] + list(KINDS)
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-10**30, max_value=10**30)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON_LIKE = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=8)


def _costly(field: str, value) -> bool:
    """Valid values that would only make the test slow (long generations), not exercise validation."""
    return field in ("max_new_tokens", "min_new_tokens", "n") and isinstance(value, int) and value > 8


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=JSON_LIKE)
def test_any_value_in_any_field_is_a_value_error_or_a_result(engine, field, value):
    if _costly(field, value):
        return
    params = {"max_new_tokens": 2, field: value}
    try:
        out = engine.generate("fuzzing the fields", params)
    except ValueError as error:
        assert str(error)
        return
    results = out if isinstance(out, list) else [out]
    for result in results:
        assert result["meta_info"]["finish_reason"] is not None
        assert all(isinstance(t, int) for t in result["output_ids"])
    if isinstance(value, float) and not math.isfinite(value):
        raise AssertionError(f"{field}={value!r} was accepted")


def test_the_engine_is_whole_after_the_fuzzing(engine):
    assert_pool_free(engine)
