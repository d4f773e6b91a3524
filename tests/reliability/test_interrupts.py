"""Issue 19: starting over with trainer.overwrite."""

from __future__ import annotations

import json
from pathlib import Path

from fp8shard.train.__main__ import main
from fp8shard.train.rundir import LOCK_NAME
from tests.reliability.common import run_args, tree_digest


def _records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl parsed (a cut line would raise)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _leftovers(run_dir: Path) -> list[str]:
    """Partial saves, temporary files and the lock: nothing of these may stay after a run."""
    return [str(p) for p in run_dir.rglob("*") if ".tmp-" in p.name or p.name.startswith(".trash-")
            or p.name == LOCK_NAME]


# ---------------------------------------------------------------------------- overwrite
def test_overwrite_starts_over_where_never_alone_refuses(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(run_args(run_dir, "trainer.max_steps=1", "checkpoint.every_n_steps=1")) == 0
    (run_dir / "checkpoints" / "step_00000001" / "manifest.json").unlink()  # only an incomplete one
    capsys.readouterr()
    before = tree_digest(run_dir)
    assert main(run_args(run_dir, "trainer.max_steps=1", "trainer.resume=never")) == 2
    assert "incomplete checkpoint directories" in capsys.readouterr().err
    assert tree_digest(run_dir) == before
    args = run_args(run_dir, "trainer.max_steps=1", "trainer.resume=never", "trainer.overwrite=true")
    assert main(args) == 0
    out = capsys.readouterr().out
    deleted = "trainer.overwrite=true: deleted the earlier run's checkpoints/, metrics.jsonl, summary.json"
    assert deleted in out
    assert not (run_dir / "checkpoints").exists() and [r["step"] for r in _records(run_dir)] == [1]
    assert _leftovers(run_dir) == []
