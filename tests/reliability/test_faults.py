"""Faults during a run: non-finite steps are skipped (and too many stop the run), a hung rank
becomes an error within the collective timeout, a truncated metrics line is tolerated.

Faults are injected with fp8shard.testing.faults.Faults: passed to the loop in one process, or
through ``python -m fp8shard.testing.faults`` for the command.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from fp8shard.checkpoint import list_checkpoints
from fp8shard.testing.faults import Faults, parse_steps
from fp8shard.train.__main__ import main
from fp8shard.train.config import load_config
from fp8shard.train.distributed import DistEnv
from fp8shard.train.loop import Trainer
from fp8shard.train.metrics import read_metrics
from tests.reliability.common import run_args, tree_digest, weights_and_state_digest
from tests.train.helpers import TINY, run_train

CPU = DistEnv(0, 1, 0, __import__("torch").device("cpu"), None)


def test_parse_steps():
    assert parse_steps("3,4") == {3, 4}
    assert parse_steps(" 2-4, 7 ") == {2, 3, 4, 7}
    assert parse_steps("") == set()
    assert parse_steps("all") is None
    assert parse_steps([3, 5]) == {3, 5} and parse_steps(7) == {7} and parse_steps(None) == set()
    with pytest.raises(ValueError, match="'3,4', '3-5' or 'all'"):
        parse_steps("three")


@pytest.mark.parametrize("optim", ["distributed_fused_adam", "adamw"])
def test_nan_steps_are_skipped_change_nothing_and_the_run_continues(tmp_path, optim):
    extra = [] if optim == "distributed_fused_adam" else ["model.fp8_params=false"]
    cfg = load_config(run_args(tmp_path / "run", "trainer.max_steps=6", f"model.optim.name={optim}", *extra))
    trainer = Trainer(cfg, CPU, faults=Faults(nan_steps="3,4"))
    digests = {0: weights_and_state_digest(trainer.model, trainer.opt)}
    step = trainer.train_step

    def recorded():
        out = step()
        digests[trainer.step] = weights_and_state_digest(trainer.model, trainer.opt)
        return out

    trainer.train_step = recorded
    summary = trainer.fit()
    # Steps 3 and 4 change no weight, moment or step count; the others do.
    assert digests[2] == digests[3] == digests[4]
    assert len({digests[i] for i in (0, 1, 2, 5, 6)}) == 5
    records = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert [s for s, r in records.items() if r["skipped"]] == [3, 4]
    assert records[6]["skipped_steps"] == 2 and math.isfinite(records[6]["loss"])
    assert summary["skipped_steps"] == 2 and summary["steps"] == 6
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["skipped_steps"] == 2
    assert math.isfinite(summary["val_loss"])


def test_nan_at_every_step_stops_with_one_line(tmp_path, capsys):
    code = main(run_args(tmp_path / "run", "trainer.max_steps=20", "trainer.max_consecutive_skips=3"),
                faults=Faults(nan_steps="all"))
    err = capsys.readouterr().err
    assert code == 1
    assert "3 steps in a row (steps 1-3) were skipped" in err and "not finite" in err
    assert "trainer.max_consecutive_skips=3" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "summary.json").exists()


def test_too_many_skips_keep_the_last_good_checkpoint(tmp_path):
    """As a subprocess: exit code 1, one line, no traceback; the checkpoints stay."""
    run_dir = tmp_path / "run"
    proc = run_train(run_dir, [*TINY, "data.num_train_tokens=40000", "trainer.max_steps=10",
                               "checkpoint.every_n_steps=2", "checkpoint.keep_last=5",
                               "trainer.max_consecutive_skips=3", "trainer.limit_val_batches=1"],
                     check=False, timeout=120, faults=Faults(nan_steps="3-20"))
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "steps 3-5" in lines[0], lines
    assert "the newest checkpoint" in lines[0] and "step_00000004 is kept" in lines[0], lines
    names = sorted(p.name for p in list_checkpoints(run_dir / "checkpoints"))
    # Steps 2 and 4 (the weights of step 2: 3 and 4 were skipped); nothing after the stop.
    assert names == ["step_00000002", "step_00000004"], names
    assert not (run_dir / "summary.json").exists()


def test_nan_on_one_of_two_ranks_skips_the_step_on_both(tmp_path):
    """torchrun, 2 ranks, DistributedFusedAdam: rank 1 alone sees a NaN loss at step 3; the
    skip is global (the ranks would deadlock or diverge otherwise) and the run finishes."""
    run_train(tmp_path / "run", [*TINY, "data.num_train_tokens=40000", "trainer.max_steps=5",
                                 "trainer.log_every_n_steps=1", "trainer.limit_val_batches=1"],
              nproc=2, timeout=120, faults=Faults(nan_steps="3", nan_rank=1))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if r["skipped"]] == [3]
    assert records[-1]["step"] == 5 and records[-1]["skipped_steps"] == 1
    assert math.isfinite(records[-1]["loss"]) and math.isfinite(records[-1]["val_loss"])


def test_a_stalled_rank_becomes_an_error_within_the_timeout(tmp_path):
    """2 ranks under torchrun; rank 1 sleeps forever at step 3; collective_timeout_s=5."""
    start = time.perf_counter()
    proc = run_train(tmp_path / "run", [*TINY, "data.num_train_tokens=40000", "trainer.max_steps=6",
                                        "trainer.collective_timeout_s=5", "trainer.log_every_n_steps=1"],
                     nproc=2, check=False, timeout=90, faults=Faults(stall_rank=1, stall_step=3))
    elapsed = time.perf_counter() - start
    print(f"stalled rank -> error after {elapsed:.1f}s (whole torchrun job)")
    assert proc.returncode != 0
    assert elapsed < 60
    ours = [line for line in proc.stderr.splitlines() if line.startswith("fp8shard.train: error (rank 0)")]
    assert len(ours) == 1, proc.stderr[-3000:]
    assert "timed out after 5s" in ours[0] and "a rank stopped participating" in ours[0]
    assert "at step 3" in ours[0] and "gradient reduce-scatter" in ours[0]
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")]
    assert steps == [1, 2]


def test_truncated_metrics_line_is_tolerated_by_report_and_resume(tmp_path):
    run_dir = tmp_path / "run"
    assert main(run_args(run_dir, "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                         "trainer.val_check_interval=2")) == 0
    metrics = run_dir / "metrics.jsonl"
    # A crash while writing step 5's record: the checkpoint of step 4 is the newest.
    with metrics.open("a") as f:
        f.write('{"step": 5, "loss": 4.1, "l')
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4]
    cmd = [sys.executable, "-m", "fp8shard.report", str(run_dir), "--out", str(tmp_path / "rep")]
    report = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "Traceback" not in report.stderr and len(list((tmp_path / "rep").glob("*.png"))) == 4
    # Resuming keeps the whole lines up to the checkpoint and drops the cut one.
    before = tree_digest(run_dir / "checkpoints")
    assert main(run_args(run_dir, "trainer.max_steps=6", "checkpoint.every_n_steps=2",
                         "trainer.val_check_interval=2")) == 0
    assert before  # the resumed run started from them (keep_last prunes the older later)
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    # A damaged line that is not the last one is an error, not silently skipped.
    metrics.write_text(lines[0] + "\n{oops\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(metrics)


def test_faults_are_built_from_json_and_bad_input_names_the_fix():
    faults = Faults.from_json('{"nan_steps": "3,4", "nan_rank": 1}')
    assert faults.nan_at(3, 1) and faults.nan_at(4, 1)
    assert not faults.nan_at(3, 0) and not faults.nan_at(5, 1)
    assert Faults.from_json(faults.to_json()) == faults
    with pytest.raises(ValueError, match=r"unknown field\(s\) nan_step; the fields are: nan_steps"):
        Faults.from_json('{"nan_step": 3}')
    with pytest.raises(ValueError, match="not valid JSON"):
        Faults.from_json("{nan_steps: 3}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        Faults.from_json("[3]")
    with pytest.raises(ValueError, match=r"save_error='ENOENT': choose one of ENOSPC, EACCES"):
        Faults(save_error="ENOENT")
    with pytest.raises(ValueError, match="kill_step='soon': give a step"):
        Faults(kill_step="soon")


def test_the_fault_command_refuses_bad_faults_before_training(tmp_path, capsys):
    from fp8shard.testing.faults import main as faults_main

    with pytest.raises(SystemExit) as e:
        faults_main(["--faults", '{"stall": 1}', *run_args(tmp_path / "run", "trainer.max_steps=2")])
    assert e.value.code == 2
    assert "unknown field(s) stall" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_default_hooks_inject_nothing():
    from fp8shard.train.faults import FaultHooks

    hooks = FaultHooks()
    hooks.maybe_stall(3, 0)  # returns
    hooks.maybe_kill(3, 0, 10)  # returns
    assert not any(hooks.nan_at(step, 0) for step in range(1, 10))
    with hooks.save_fault(4, 0):
        entered = True
    assert entered
