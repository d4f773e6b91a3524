"""SIGKILL in the middle of a save leaves the previous checkpoint loadable (or the new one
complete); the next save clears the leftovers. See [Note: atomic checkpoints]."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fp8shard.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests.checkpoint import cases
from tests.checkpoint.kill_child import PHASES

# Where the kill falls -> the step of the newest complete checkpoint afterwards.
EXPECTED_STEP = {"dcp_write": 1, "hashing": 1, "manifest": 1, "after_rename": 2, "prune": 2}
# What the kill left on disk (so we know it fell where it was meant to).
LEFT = {
    "dcp_write": lambda r: (r / ".tmp-step_2").is_dir() and not (r / ".tmp-step_2" / ".metadata").exists(),
    "hashing": lambda r: (r / ".tmp-step_2" / ".metadata").exists()
    and not (r / ".tmp-step_2" / "manifest.json").exists(),
    "manifest": lambda r: any((r / ".tmp-step_2").glob(".manifest.json.tmp-*"))
    and not (r / ".tmp-step_2" / "manifest.json").exists(),
    "after_rename": lambda r: (r / "step_2" / "manifest.json").exists()
    and (r / "latest").read_text().strip() == "step_1",
    "prune": lambda r: any(r.glob(".trash-step_1-*")) and not (r / "step_1").exists(),
}


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("killed")
    out = subprocess.run([sys.executable, "-m", "tests.checkpoint.kill_child", str(root), *PHASES],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    signals = {x["phase"]: x["signal"] for x in lines}
    assert signals == dict.fromkeys(PHASES, signal.SIGKILL), out.stderr[-3000:]
    return root


@pytest.mark.parametrize("phase", PHASES)
def test_killed_save_leaves_a_loadable_checkpoint(killed, phase):
    root = killed / phase
    digests = json.loads((root / "digests.json").read_text())
    assert LEFT[phase](root), sorted(str(p.relative_to(root)) for p in root.rglob("*"))
    newest = latest_checkpoint(root)
    step = EXPECTED_STEP[phase]
    assert newest == root / f"step_{step}"
    model, opt = cases.build(seed=5)
    info = load_checkpoint(root, model, opt)  # the root: resume picks the newest complete one
    assert info.step == step
    assert cases.optimizer_digest(opt) == digests[step - 1]
    if step == 1:
        assert not (root / "step_2").exists()
        assert (root / "latest").read_text().strip() == "step_1"
    # The next save clears what the killed one left behind and publishes normally.
    save_checkpoint(root / "step_3", model, opt, step=3, keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["digests.json", "latest", "step_3"]
    assert latest_checkpoint(root) == root / "step_3"
