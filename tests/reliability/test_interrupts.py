"""Issue 19: signals, a second job on one run directory, a data file changed under a run,
validation with fewer windows than ranks, and starting over with trainer.overwrite.

In-process runs (one rank) inject the event at a chosen step (deterministic); the torchrun runs
(2 gloo ranks) send real signals to the launcher once the run has logged a few steps.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp

from fp8shard.train.__main__ import main
from fp8shard.train.data import DataFileChanged, TokenFile
from fp8shard.train.loop import Trainer
from fp8shard.train.rundir import LOCK_NAME
from tests.reliability.common import SMALL, kill_tree, run_args, tree_digest
from tests.train.helpers import cpu_env, read_summary


def _records(run_dir: Path) -> list[dict]:
    """Every line of metrics.jsonl parsed (a cut line would raise)."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _leftovers(run_dir: Path) -> list[str]:
    """Partial saves, temporary files and the lock: nothing of these may stay after a run."""
    return [str(p) for p in run_dir.rglob("*") if ".tmp-" in p.name or p.name.startswith(".trash-")
            or p.name == LOCK_NAME]


def _at_step(monkeypatch, step: int, action) -> None:
    """Run ``action()`` at the start of optimizer step ``step`` (1-based) of the in-process run."""
    orig = Trainer.train_step

    def train_step(self):
        if self.step + 1 == step:
            action()
        return orig(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def _token_file(path: Path, n: int = 40000) -> Path:
    (np.arange(n) * 7 % 256).astype(np.uint16).tofile(path)
    return path


# ---------------------------------------------------------------------------- the data file changes
def _truncate(path: Path) -> None:
    os.truncate(path, 1000)


def _replace(path: Path) -> None:
    other = path.with_name("other.bin")
    _token_file(other, 40000)
    os.replace(other, path)


def _rewrite(path: Path) -> None:
    st = os.stat(path)
    data = bytearray(path.read_bytes())
    data[100] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a coarse clock cannot hide it


@pytest.mark.parametrize("change,what", [(_truncate, "its size went from 80000 to 1000 bytes"),
                                         (_replace, "it was replaced by another file"),
                                         (_rewrite, "it was rewritten")])
def test_token_file_changed_during_the_run_stops_with_one_line(tmp_path, monkeypatch, capsys, change, what):
    """[Note: token file reads]: read with pread, never memory-mapped, so a truncated file is an
    error line (exit 1), not SIGBUS; a replaced or rewritten one is caught at the next step."""
    data = _token_file(tmp_path / "tokens.bin")
    run_dir = tmp_path / "run"
    _at_step(monkeypatch, 2, lambda: change(data))
    code = main(run_args(run_dir, "data.source=tokens", f"data.path={data}", "data.vocab_size=256",
                         "trainer.max_steps=3", "checkpoint.every_n_steps=1"))
    err = capsys.readouterr().err
    assert code == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"fp8shard.train: error: data.path: {data} changed while the run was reading it")
    assert what in err
    assert [r["step"] for r in _records(run_dir)] == [1]
    assert (run_dir / "checkpoints" / "step_00000001" / "manifest.json").exists()
    assert _leftovers(run_dir) == []


def test_a_read_past_the_end_of_a_truncated_token_file_is_an_error_not_sigbus(tmp_path):
    path = _token_file(tmp_path / "t.bin", 1000)
    f = TokenFile(str(path), np.uint16)
    assert f.read(990, 1000).tolist() == (np.arange(990, 1000) * 7 % 256).tolist()
    os.truncate(path, 100)
    with pytest.raises(DataFileChanged, match="size went from 2000 to 100 bytes"):
        f.read(990, 1000)
    f.close()


# ---------------------------------------------------------------------------- signals, one process
def test_sigterm_stops_the_run_with_one_line_and_complete_files(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    _at_step(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGTERM))
    before = signal.getsignal(signal.SIGTERM)
    code = main(run_args(run_dir, "trainer.max_steps=3", "checkpoint.every_n_steps=1"))
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("fp8shard.train: stopped by SIGTERM at step 1; the newest complete checkpoint ")
    assert "step_00000001 is kept: run the same command to resume" in err
    assert [r["step"] for r in _records(run_dir)] == [1]
    assert _leftovers(run_dir) == []
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the command's only


def test_sigint_during_a_checkpoint_save_leaves_no_partial_checkpoint(tmp_path, monkeypatch, capsys):
    """The signal lands after DCP wrote the step-2 files into .tmp-step_00000002, before it is
    published: the partial directory goes, step 1 stays whole, and a rerun resumes from it."""
    run_dir = tmp_path / "run"
    orig = dcp.save

    def save(*args, **kwargs):
        result = orig(*args, **kwargs)
        if "step_00000002" in str(kwargs["storage_writer"].path):
            os.kill(os.getpid(), signal.SIGINT)
        return result

    monkeypatch.setattr(dcp, "save", save)
    args = run_args(run_dir, "trainer.max_steps=3", "checkpoint.every_n_steps=1", "checkpoint.keep_last=3")
    code = main(args)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGINT, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "stopped by SIGINT at step 2; the newest complete checkpoint" in err and "step_00000001" in err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_00000001"]
    assert [r["step"] for r in _records(run_dir)] == [1, 2]
    assert _leftovers(run_dir) == []
    monkeypatch.setattr(dcp, "save", orig)
    assert main(args) == 0  # the same command resumes from step 1 and finishes
    out = capsys.readouterr().out
    assert "resumed from" in out and "step_00000001" in out
    assert [r["step"] for r in _records(run_dir)] == [1, 2, 3]


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


# ---------------------------------------------------------------------------- torchrun, 2 ranks
LONG = [*SMALL, "trainer.max_steps=100000", "checkpoint.every_n_steps=1", "trainer.val_check_interval=100000"]


def _launch(run_dir: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "fp8shard.train", *overrides, f"exp_manager.exp_dir={run_dir.parent}",
           f"exp_manager.name={run_dir.name}"]
    env = cpu_env()
    with log.open("w") as f:  # a file, not a pipe: nobody reads while it runs
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)


def _wait(p: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        p.wait()
        raise AssertionError(f"torchrun did not end within {timeout}s:\n{log.read_text()[-3000:]}") from None
    return log.read_text()


def _wait_for_records(run_dir: Path, p: subprocess.Popen, log: Path, n: int, timeout: float = 90) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise AssertionError(f"the run ended early ({p.returncode}):\n{log.read_text()[-3000:]}")
        if metrics.exists() and metrics.read_text().count("\n") >= n:
            return
        time.sleep(0.2)
    kill_tree(p.pid)
    raise AssertionError(f"no {n} records within {timeout}s:\n{log.read_text()[-3000:]}")


def _ours(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("fp8shard.train: ")]


def _no_traceback_of_ours(text: str) -> None:
    assert "KeyboardInterrupt" not in text
    assert not [line for line in text.splitlines() if line.startswith("  File ") and "fp8shard" in line], text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_torchrun_stops_every_rank_with_one_line(tmp_path, sig):
    run_dir = tmp_path / "run"
    log = tmp_path / "a.log"
    a = _launch(run_dir, LONG, log)
    _wait_for_records(run_dir, a, log, 2)  # a checkpoint of step 1 is complete by now
    if sig == signal.SIGTERM:
        # A second job on the same run directory stops at once: one line per rank naming the
        # directory and the holder; the first job goes on untouched.
        log_b = tmp_path / "b.log"
        text_b = _wait(_launch(run_dir, LONG, log_b), log_b, timeout=90)
        ours_b = _ours(text_b)
        assert sorted(line[:32] for line in ours_b) == ["fp8shard.train: error (rank 0): ",
                                                        "fp8shard.train: error (rank 1): "], text_b
        assert all(f"{run_dir} is in use by another training job (held by pid " in line for line in ours_b)
        _no_traceback_of_ours(text_b)
        assert a.poll() is None  # still training
    os.kill(a.pid, sig)
    text = _wait(a, log, timeout=60)
    assert a.returncode != 0
    ours = [line for line in _ours(text) if not line.startswith("fp8shard.train: 1")]  # the start-up line
    name = signal.Signals(sig).name
    prefix = f"fp8shard.train: stopped by {name}"
    heads = sorted(line[:len(prefix) + 9] for line in ours)
    assert heads == [f"{prefix} (rank 0)", f"{prefix} (rank 1)"], text[-3000:]
    assert all("the newest complete checkpoint" in line for line in ours), ours
    _no_traceback_of_ours(text)
    records = _records(run_dir)  # every line parses: none cut
    assert len(records) >= 2 and [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert _leftovers(run_dir) == []


def test_validation_with_fewer_windows_than_ranks_covers_them(tmp_path):
    """One validation window, two ranks: both evaluate (rank 1 a padding forward) and the loss
    is that window's, not 0.0 (what a rank without windows used to contribute)."""
    data = _token_file(tmp_path / "tokens.bin")
    args = [*SMALL, "data.source=tokens", f"data.path={data}", "data.vocab_size=256",
            "data.val_fraction=0.001", "trainer.max_steps=1"]  # 40 held-out tokens -> one window of 65
    run_dir = tmp_path / "two"
    text = _wait(_launch(run_dir, args, tmp_path / "two.log"), tmp_path / "two.log", timeout=120)
    val2 = read_summary(run_dir)["val_loss"]
    assert main([*args, f"exp_manager.exp_dir={tmp_path}", "exp_manager.name=one"]) == 0
    val1 = read_summary(tmp_path / "one")["val_loss"]
    assert math.isfinite(val2) and val2 > 4.0, text[-2000:]  # about ln 256 after one step
    assert abs(val2 - val1) < 0.05 * val1
