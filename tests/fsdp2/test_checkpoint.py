"""Checkpoints of the two engines are one format: flat -> FSDP2 at another world size, and back.

After a load the full model-space state (every parameter's master, moments, FP8 bytes and scale)
hashes the same as when it was saved, and training goes on with the losses of the run that
never stopped (to the rounding of a gradient average over another number of ranks).
"""

from __future__ import annotations

import pytest

from tests.conftest import pools_fixture
from tests.fsdp2 import cases

dist_pools = pools_fixture("gloo")


@pytest.mark.parametrize(("src", "src_world", "dst", "dst_world"), [
    ("flat", 2, "fsdp2", 4),
    ("fsdp2", 4, "flat", 2),
    ("fsdp2", 2, "fsdp2", 4),
    ("hsdp", 4, "flat", 2),
])
def test_cross_resume(dist_pools, tmp_path, src, src_world, dst, dst_world):
    path = str(tmp_path / "step_00000003")
    saved, cont = dist_pools(src_world).run(cases.save_after, src, path, 3, 3)[0]
    loaded, resumed, written_by = dist_pools(dst_world).run(cases.load_and_continue, dst, path, 3)[0]
    assert written_by == src_world
    assert any(k.endswith("/scale") for k in saved)
    assert loaded == saved  # bit-exact model-space state
    assert resumed == pytest.approx(cont, rel=5e-3)
