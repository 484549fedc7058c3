"""gpuflat._src.identity: recognising the same arrays again."""
from __future__ import annotations

import numpy as np
import pytest

from gpuflat._src.identity import BYTES_COMPARED_UP_TO, equal_facts


@pytest.mark.parametrize("n", [0, 1, 900, BYTES_COMPARED_UP_TO, BYTES_COMPARED_UP_TO + 1, 60_000])
def test_equal_facts_agrees_with_numpy_on_either_side_of_the_switch(n):
    rng = np.random.default_rng(n)
    facts = rng.integers(-(2**62), 2**62, n, dtype=np.int64)
    assert equal_facts(facts, facts.copy())
    for at in {0, n // 2, n - 1} if n else ():
        other = facts.copy()
        other[at] ^= 1  # one bit of one word
        assert not equal_facts(other, facts)
    assert not equal_facts(facts, np.append(facts, 0))
