"""Checkpointing through the real training command (subprocesses, torchrun with 2 ranks).

A 20-step run against one stopped at step 10 (``model.optim.sched.max_steps=20``) and resumed
to 20: every logged loss and every checkpointed tensor equal. The same checkpoint resumed on 1
rank: within the resharding tolerance. A run SIGKILLed while it saves: resumes from the
previous checkpoint and still ends exactly where the uninterrupted run does. Records are logged
every 2 steps, so a resume from an odd step must restore the half-filled loss window.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from fp8shard.checkpoint import latest_checkpoint, list_checkpoints, read_manifest
from tests.reliability.common import checkpoint_tensors
from tests.train.helpers import TINY, cpu_env, kill_pids, process_tree, read_metrics, run_train, train_command

FAST = [*TINY, "model.hidden_size=32", "data.num_train_tokens=60000", "data.num_val_tokens=8000",
        "trainer.limit_val_batches=1", "trainer.log_every_n_steps=2", "trainer.val_check_interval=20",
        "model.optim.sched.warmup_steps=3"]
STEPS, STOP = 20, 10


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run)]


def _assert_same_final_state(run_a: Path, run_b: Path) -> None:
    last_a, last_b = latest_checkpoint(run_a / "checkpoints"), latest_checkpoint(run_b / "checkpoints")
    assert last_a.name == last_b.name == f"step_{STEPS:08d}"
    ta, tb = checkpoint_tensors(last_a), checkpoint_tensors(last_b)
    assert ta.keys() == tb.keys()
    # Python's and NumPy's global generators are seeded from the OS at process start and unused
    # by training: they differ between any two runs. Everything else must be equal.
    keys = [k for k in ta if not k.rsplit("/", 1)[1].startswith(("python_", "numpy_"))]
    assert any(k.startswith("rng/1/torch_cpu") for k in keys) and any(":fp8_bytes" in k for k in keys)
    differ = [k for k in keys if not torch.equal(ta[k], tb[k])]
    assert differ == []  # FP8 bytes, scales, amax histories, masters, moments, torch RNG states


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "straight"
    run_train(run, [*FAST, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=10"], nproc=2)
    return run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """Stopped at step 10 of a 20-step schedule, then resumed to 20 (trainer.resume=auto)."""
    run = tmp_path_factory.mktemp("runs") / "stopped"
    common = [*FAST, "checkpoint.every_n_steps=10", "model.optim.sched.max_steps=20"]
    run_train(run, [*common, f"trainer.max_steps={STOP}"], nproc=2)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_00000010"]
    run_train(run, [*common, f"trainer.max_steps={STEPS}", "trainer.resume=auto"], nproc=2)
    return run


def test_stop_and_resume_is_the_same_run(straight, stopped):
    assert [s for s, _ in _losses(straight)] == list(range(2, STEPS + 1, 2))
    assert _losses(stopped) == _losses(straight)  # every logged loss, bit for bit
    a = read_metrics(straight)
    b = read_metrics(stopped)
    assert [(r["lr"], r["grad_norm"], r["consumed_samples"]) for r in a] == \
        [(r["lr"], r["grad_norm"], r["consumed_samples"]) for r in b]
    assert a[-1]["val_loss"] == b[-1]["val_loss"]  # the stopped run's extra validation changed nothing
    _assert_same_final_state(straight, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["resumed_from"].endswith("step_00000010")


def test_resume_on_one_rank_reshards(straight, stopped, tmp_path):
    run = tmp_path / "one_rank"
    ck = stopped / "checkpoints" / "step_00000010"
    run_train(run, [*FAST, f"trainer.max_steps={STEPS}", f"trainer.resume={ck}"], nproc=1)
    mine, ref = _losses(run), _losses(straight)
    assert [s for s, _ in mine] == list(range(STOP + 2, STEPS + 1, 2))
    diff = max(abs(a - b) for (_, a), (_, b) in zip(mine, ref[STOP // 2:], strict=True))
    print(f"\n2 -> 1 ranks through the training command: max |loss diff| {diff:.3g} over "
          f"{STEPS - STOP} steps")
    assert diff < 2e-2


def _kill_during_a_save(args: list[str], root: Path) -> list[str] | None:
    """Start the run; SIGKILL torchrun and both ranks as soon as the save of an even step from 6
    on is in progress (its temporary directory exists), so the newest complete checkpoint is of
    an odd step, inside a log window. Returns what was being written, or None."""
    env = cpu_env()
    proc = subprocess.Popen([*train_command(2), *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, tree, deadline = None, [], time.monotonic() + 120
    try:
        while seen is None and proc.poll() is None and time.monotonic() < deadline:
            if not root.is_dir():
                time.sleep(0.01)
                continue
            tree = tree or process_tree(proc.pid)  # the ranks run once the first save began
            tmps = [p.name for p in root.glob(".tmp-step_*")]
            if any(int(n.rsplit("_", 1)[1]) >= 6 and int(n.rsplit("_", 1)[1]) % 2 == 0 for n in tmps):
                kill_pids(tree)  # both ranks and torchrun, mid-save
                seen = tmps
            time.sleep(0.002)
    finally:
        if proc.poll() is None:  # not killed above (timeout, or an error in this loop)
            kill_pids(process_tree(proc.pid))
        proc.wait()
    return seen


def test_sigkill_during_save_then_resume(straight, tmp_path):
    for attempt in range(3):  # a save takes milliseconds: the poll may miss every one of them
        run = tmp_path / f"killed{attempt}"
        args = [*FAST, f"trainer.max_steps={STEPS}", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2",
                f"exp_manager.exp_dir={run.parent}", f"exp_manager.name={run.name}"]
        root = run / "checkpoints"
        seen = _kill_during_a_save(args, root)
        if seen is not None:
            break
    assert seen is not None, "three runs ended before a save could be interrupted"
    before = latest_checkpoint(root)
    assert before is not None and read_manifest(before)["step"] >= 5
    print(f"\nkilled while writing {seen}; newest complete: {before.name}; left: "
          f"{sorted(p.name for p in root.iterdir())}")
    run_train(run, args, nproc=2)  # trainer.resume=auto is the default
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith(before.name)
    assert _losses(run) == _losses(straight)  # the killed-and-resumed run is the same run
    _assert_same_final_state(straight, run)
    assert not list(root.glob(".tmp-*"))


def test_resume_modes_refuse_to_mix_runs(tmp_path):
    """trainer.resume=never (or a path elsewhere) must not save beside an earlier run's
    checkpoints (auto-resume and keep_last would mix the two); auto takes the newest."""
    from fp8shard.train.config import ConfigError, load_config
    from fp8shard.train.resume import resume_candidates

    root = tmp_path / "run" / "checkpoints"
    other = tmp_path / "other" / "step_00000003"
    for ck in (root / "step_00000002", root / "step_00000004", other):
        ck.mkdir(parents=True)
        manifest = {"format": "fp8shard.checkpoint", "step": int(ck.name[5:])}
        (ck / "manifest.json").write_text(json.dumps(manifest))

    def cfg(mode: str):
        return load_config([f"trainer.resume={mode}"], world_size=1)

    assert resume_candidates(cfg("auto"), root) == [root / "step_00000004", root / "step_00000002"]
    assert resume_candidates(cfg("auto"), tmp_path / "fresh") == []
    assert resume_candidates(cfg("never"), tmp_path / "fresh") == []
    assert resume_candidates(cfg(str(root / "step_00000002")), root) == [root / "step_00000002"]
    assert resume_candidates(cfg(str(other.parent)), tmp_path / "fresh") == [other]
    for mode in ("never", str(other)):
        with pytest.raises(ConfigError, match=r"holds checkpoints of an earlier run \(newest: step_0+4\)"):
            resume_candidates(cfg(mode), root)


def test_a_resumed_cpu_run_keeps_the_gemm_path_it_began_with(tmp_path, monkeypatch):
    """[Note: resumed GEMM path]: model.fp8_gemm=auto measures the faster CPU path per process;
    a resumed run takes the one its checkpoint was trained with (the other sums in another order,
    so the continuation would not be bit for bit), and an explicit setting wins."""
    from fp8shard.fp8 import gemm
    from fp8shard.train import loop
    from fp8shard.train.config import load_config
    from fp8shard.train.distributed import DistEnv
    from tests.reliability.common import run_args

    cpu = DistEnv(0, 1, 0, torch.device("cpu"), None)
    monkeypatch.setattr(gemm, "_setting", gemm._setting)  # restored after the test
    run = tmp_path / "run"
    common = ["checkpoint.every_n_steps=2", "trainer.val_check_interval=100", "exp_manager.plots=false"]

    def trainer(steps: int, *extra: str, measured: str) -> loop.Trainer:
        other = "scaled_mm" if measured == "emulated" else "emulated"
        monkeypatch.setattr(gemm, "_cpu_auto", {"path": measured, f"{measured}_ms": 1.0, f"{other}_ms": 2.0})
        cfg = load_config(run_args(run, *common, f"trainer.max_steps={steps}", *extra), world_size=1)
        return loop.Trainer(cfg, cpu)

    first = trainer(2, measured="emulated")
    first.fit()
    first.close()
    last = latest_checkpoint(run / "checkpoints")
    assert read_manifest(last)["extra"]["fp8_gemm"] == {"device": "cpu", "path": "emulated"}

    resumed = trainer(3, measured="scaled_mm")  # this process would pick the other path
    assert resumed.step == 2
    assert resumed.compute["fp8_gemm_path"] == "emulated" and gemm.resolved_gemm_path("cpu") == "emulated"
    resumed.close()

    chosen = trainer(3, "model.fp8_gemm=scaled_mm", measured="emulated")  # the setting wins
    assert chosen.step == 2 and chosen.compute["fp8_gemm_path"] == "scaled_mm"
    chosen.close()
