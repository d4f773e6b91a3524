"""One thread per test process: the tiny models here are dominated by thread synchronisation
otherwise (a 2-core machine running other work makes that seconds per forward)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
