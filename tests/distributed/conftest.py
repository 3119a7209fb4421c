"""Two tensor-parallel ranks (gloo, CPU) started once for the tests of this folder."""

from __future__ import annotations

import pytest

from fixtures.tensor_parallel import RankPool


@pytest.fixture(scope="session")
def tp_ranks():
    pool = RankPool(2)
    yield pool
    pool.close()
