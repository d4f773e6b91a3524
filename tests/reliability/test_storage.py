"""Storage faults ([Note: storage faults]): a checkpoint save that fails (disk full, permission
denied) says so in one line, publishes nothing, leaves the previous checkpoint untouched, and
the run stops (``checkpoint.on_save_error=stop``) or trains on (``continue``); resuming from the
checkpoint left behind gives the run that never failed.

Two injections: ``Faults(save_error_steps=...)`` (fp8shard.testing.faults) makes DCP's write of
the shard file raise ``OSError`` (ENOSPC by default) after part of it is on disk; ``chmod``
makes the checkpoint directory read-only mid-run. Root ignores mode bits, so when the tests run
as root (as in CI) the chmod case runs the training in a forked child that has become the user
``nobody``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from fp8shard.checkpoint import list_checkpoints, load_checkpoint
from fp8shard.testing.faults import Faults
from fp8shard.train.__main__ import main
from fp8shard.train.builders import build_model, build_optimizer
from fp8shard.train.config import load_config
from fp8shard.train.distributed import DistEnv
from fp8shard.train.loop import Trainer
from fp8shard.train.metrics import read_metrics
from tests.reliability.common import SMALL, differing_tensors, run_args, torchrun, tree_digest

ARGS = ("trainer.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2",
        "trainer.val_check_interval=100")
CPU = DistEnv(0, 1, 0, torch.device("cpu"), None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same run, never failing."""
    run = tmp_path_factory.mktemp("ref") / "run"
    assert main(run_args(run, *ARGS)) == 0
    return run


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("fp8shard.train: error")]


NOBODY = 65534


def _main_captured(args: list[str], as_nobody: bool, faults: Faults | None = None) -> tuple[int, str, str]:
    """``main(args, faults)`` with its output captured: (exit code, stdout, stderr). ``as_nobody``: in a
    forked child that runs as the unprivileged user ``nobody`` (root ignores mode bits, so a
    read-only directory refuses only such a process), reporting back through a pipe. The child
    reads no new files: the modules it needs were imported by the ``reference`` run."""
    if not as_nobody:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args, faults=faults)
        return code, out.getvalue(), err.getvalue()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest; single-threaded (see the caller)
        status = 1
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = _main_captured(args, as_nobody=False, faults=faults)
            os.write(w, json.dumps(result).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert status == 0 and data, f"the child running as nobody failed (wait status {status})"
    code, out, err = json.loads(data)
    return code, out, err


@pytest.mark.parametrize("how", ["inject-enospc", "chmod-read-only"])
def test_a_failed_save_stops_and_keeps_the_previous_checkpoint(how, tmp_path, monkeypatch, reference):
    as_nobody = how == "chmod-read-only" and os.geteuid() == 0
    threads = torch.get_num_threads()
    if as_nobody:
        # A forked child must run single-threaded (the parent's OpenMP pool does not survive a
        # fork: it hangs), and the thread count changes the sums' rounding: the whole case, and
        # its own reference run, run on one thread. pytest's tmp_path is private to root: the
        # run goes in a folder nobody may write in.
        torch.set_num_threads(1)
        # The command would set the CPU count, and measure its GEMM path in each process, otherwise.
        one_thread = ["trainer.num_threads=1", "model.fp8_gemm=emulated"]
        reference = tmp_path / "ref1" / "run"
        assert main(run_args(reference, *ARGS, *one_thread)) == 0
        tmp_path = Path(tempfile.mkdtemp(prefix="fp8shard-ro-"))
        os.chown(tmp_path, NOBODY, NOBODY)
    run = tmp_path / "run"
    root = run / "checkpoints"
    save = Trainer.save

    def recording_save(self: Trainer):
        # The tree as it is before each save, written beside the run (the child's memory is lost).
        (run / f"before_{self.step}.json").write_text(json.dumps(tree_digest(self.ckpt_root)))
        if how == "chmod-read-only" and self.step == 4:
            os.chmod(self.ckpt_root, 0o555)
        return save(self)

    monkeypatch.setattr(Trainer, "save", recording_save)
    faults = Faults(save_error_steps="4") if how == "inject-enospc" else None
    try:
        code, out, err = _main_captured(run_args(run, *ARGS, *(one_thread if as_nobody else [])), as_nobody,
                                        faults)
    finally:
        if root.exists():
            os.chmod(root, 0o755)
    try:
        _check_failed_save(how, run, code, out, err, monkeypatch, save, reference,
                           one_thread if as_nobody else [])
    finally:
        if as_nobody:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp_path, ignore_errors=True)


def _check_failed_save(how: str, run: Path, code: int, out: str, err: str, monkeypatch, save,
                       reference: Path, extra: list[str]) -> None:
    root = run / "checkpoints"
    assert code == 1, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in out
    lines = _error_lines(err)
    assert len(lines) == 1, err
    cause = "No space left on device" if how == "inject-enospc" else "Permission denied"
    assert f"saving checkpoint {root / 'step_00000004'} failed: " in lines[0] and cause in lines[0]
    assert f"the newest complete checkpoint {root / 'step_00000002'} is intact (sizes and SHA-256 verified)" \
        in lines[0]
    assert lines[0].endswith("stopping (checkpoint.on_save_error=stop)")

    # Nothing was published and nothing changed: no leftovers, step 2 and `latest` as they were.
    assert tree_digest(root) == json.loads((run / "before_4.json").read_text())
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    assert not (run / "summary.json").exists()
    cfg = load_config(run_args(run, *ARGS))
    model = build_model(cfg, 256, CPU.device)
    opt, _ = build_optimizer(cfg, model, CPU)
    assert load_checkpoint(root, model, opt).step == 2  # it loads

    # Resuming from it (trainer.resume=auto) is the run that never failed.
    monkeypatch.setattr(Trainer, "save", save)
    assert main(run_args(run, *ARGS, *extra)) == 0  # as the failed run and its reference ran
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(root / "step_00000002") and summary["steps"] == 6
    assert summary["checkpoint_save_errors"] == 0  # the failed save was after step 2's checkpoint
    ref = [(r["step"], r["loss"]) for r in read_metrics(reference / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == ref
    assert differing_tensors(root / "step_00000006", reference / "checkpoints" / "step_00000006") == []


def test_continue_mode_trains_on_but_a_failed_last_save_stops(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    code = main(run_args(run, *ARGS, "checkpoint.on_save_error=continue"),
                faults=Faults(save_error_steps="2,6", save_error="EACCES"))
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err
    warnings = [line for line in err.splitlines() if line.startswith("fp8shard.train: warning")]
    assert len(warnings) == 1, err
    assert "step_00000002 failed: [Errno 13] Permission denied" in warnings[0]
    assert "there is no earlier checkpoint; training continues (checkpoint.on_save_error=continue, " \
           "1 failed save(s) so far)" in warnings[0]
    (line,) = _error_lines(err)
    assert "step_00000006 failed: [Errno 13]" in line and "step_00000004 is intact" in line
    assert line.endswith("stopping (it was the save after the last step)")
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000004"]
    assert not list((run / "checkpoints").glob(".tmp-*"))
    counts = {r["step"]: r["checkpoint_save_errors"] for r in read_metrics(run / "metrics.jsonl")}
    assert counts == {1: 0, 2: 0, 3: 1, 4: 1, 5: 1, 6: 1}  # records come before the step's save
    assert "checkpoint: " in out  # step 4 was saved


def test_a_save_failing_on_one_rank_fails_on_every_rank(tmp_path):
    """2 ranks under torchrun; only rank 1's write fails. Both ranks leave the save together
    (no rank waits in a collective), rank 0 names rank 1's error, the previous checkpoint stays."""
    run = tmp_path / "run"
    faults = Faults(save_error_steps="4", save_error_rank=1)
    proc = torchrun(run, [*SMALL, "trainer.max_steps=6", "checkpoint.every_n_steps=2",
                          "trainer.collective_timeout_s=60"], faults=faults, timeout=90)
    assert proc.returncode != 0
    lines = _error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("fp8shard.train: error (rank 0): saving checkpoint ")
    assert "step_00000004 failed on rank 1: [Errno 28] No space left on device" in lines[0]
    assert "step_00000002 is intact" in lines[0] and "timed out" not in lines[0]
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000002"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


class _FullDiskFile:
    """metrics.jsonl's file object, refusing (ENOSPC) the record of ``step`` and all writes after."""

    def __init__(self, f, step: int) -> None:
        self._f, self._step, self.full = f, step, False

    def write(self, text: str) -> int:
        if self.full or json.loads(text).get("step") == self._step:
            self.full = True
            raise OSError(28, "No space left on device")
        return self._f.write(text)

    def __getattr__(self, name: str):
        if self.full and name in ("flush", "close"):
            def refuse() -> None:
                self._f.close()
                raise OSError(28, "No space left on device")
            return refuse
        return getattr(self._f, name)


def test_a_full_disk_while_writing_metrics_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capsys,
                                                                           reference):
    """Disk full at step 5's metrics record (after step 4's checkpoint): exit 1 with one line naming
    metrics.jsonl and the cause, no traceback; rerunning resumes from step 4 and ends as the run
    that never failed."""
    from fp8shard.train import metrics

    run = tmp_path / "run"
    init = metrics.RunRecorder.__init__

    def full_at_step_5(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if self._file is not None:
            self._file = _FullDiskFile(self._file, 5)

    monkeypatch.setattr(metrics.RunRecorder, "__init__", full_at_step_5)
    code = main(run_args(run, *ARGS))
    out, err = capsys.readouterr()
    assert code == 1 and "Traceback" not in err + out, err[-3000:]
    (line,) = _error_lines(err)
    assert f"writing {run / 'metrics.jsonl'} failed: [Errno 28] No space left on device" in line
    assert "rerun the same command, which resumes from the newest one (trainer.resume=auto)" in line
    assert sorted(p.name for p in list_checkpoints(run / "checkpoints")) == ["step_00000002", "step_00000004"]

    monkeypatch.setattr(metrics.RunRecorder, "__init__", init)
    assert main(run_args(run, *ARGS)) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"] == str(run / "checkpoints" / "step_00000004")
    ref = [(r["step"], r["loss"]) for r in read_metrics(reference / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in read_metrics(run / "metrics.jsonl")] == ref
    assert differing_tensors(run / "checkpoints" / "step_00000006",
                             reference / "checkpoints" / "step_00000006") == []
