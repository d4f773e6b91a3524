"""[Note: memory budget] in a container: the run's memory is bounded by its control group's limit
where that is below the machine's RAM (a container sees the host's RAM in ``os.sysconf``, and
the OOM killer acts at the group's limit). Fake cgroup trees, v1 and v2."""

from __future__ import annotations

import pytest

from fp8shard.train import budget
from fp8shard.train.config import ConfigError, load_config

GIB = 2**30


def _tree(tmp_path, files: dict[str, str], proc: str):
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    pc = tmp_path / "proc_cgroup"
    pc.write_text(proc)
    return str(root), str(pc)


def test_v2_the_smallest_limit_on_the_way_up_holds(tmp_path):
    root, pc = _tree(tmp_path, {"memory.max": "max", "a/memory.max": str(3 * GIB),
                                "a/b/memory.max": "max"}, "0::/a/b\n")
    assert budget.cgroup_memory_limit(root, pc) == 3 * GIB


def test_v1_memory_controller_and_no_limit(tmp_path):
    root, pc = _tree(tmp_path, {"memory/memory.limit_in_bytes": "9223372036854771712",
                                "memory/job/memory.limit_in_bytes": str(2 * GIB)},
                     "5:devices:/\n4:memory:/job\n1:cpu:/\n")
    assert budget.cgroup_memory_limit(root, pc) == 2 * GIB
    root, pc = _tree(tmp_path / "none", {"memory/memory.limit_in_bytes": "9223372036854771712"},
                     "4:memory:/not/mounted/here\n")
    assert budget.cgroup_memory_limit(root, pc) is None  # v1's "no limit", the group unseen
    assert budget.cgroup_memory_limit(str(tmp_path / "missing"), str(tmp_path / "missing")) is None


def test_a_config_over_the_container_limit_is_refused_naming_it(tmp_path, monkeypatch):
    """A CPU config that fits the machine's RAM but not its container's limit is refused, and the
    message names the limit (it would otherwise end in the OOM killer)."""
    root, pc = _tree(tmp_path, {"memory.max": str(GIB)}, "0::/\n")
    real = budget.cgroup_memory_limit
    monkeypatch.setattr(budget, "cgroup_memory_limit", lambda: real(root, pc))
    monkeypatch.setattr(budget, "physical_memory", lambda: 64 * GIB)
    cfg = load_config(["model.hidden_size=2048", "model.ffn_hidden_size=8192", "model.num_layers=8",
                       "model.num_attention_heads=16"], validate_cfg=False)
    with pytest.raises(ConfigError, match=r"more than this machine's 1\.0 GiB of memory limit of this "
                                          r"container \(cgroup\)"):
        budget.check_memory(cfg, world_size=1, env={})
    monkeypatch.setattr(budget, "cgroup_memory_limit", lambda: None)
    assert budget.check_memory(cfg, world_size=1, env={}).device_total > GIB  # fits the RAM alone
