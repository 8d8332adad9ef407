"""The hypothesis settings every fuzzing test shares: a thousand examples, the same ones every
run (derandomized, no example database), so a failure seen in CI is seen again on any machine;
and any JSON value, for a body or a chunk where JSON of the wrong shape stands."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES = 1000
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example],
)

leaves = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats() | st.text(max_size=12))
json_values = st.recursive(
    leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=8,
)
