"""Every test starts without delayed-scaling layers pending from an earlier test."""

import pytest

from fp8shard.nn import autocast


@pytest.fixture(autouse=True)
def _no_pending_amaxes():
    autocast._pending.clear()
    yield
    autocast._pending.clear()
