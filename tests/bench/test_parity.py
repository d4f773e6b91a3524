"""The loss-parity benchmark (issue 17): its statistics on known inputs, reading run directories,
the errors on bad input, and one small run of benchmarks/parity.py end to end, resumed."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8shard.parity import (
    ParityError,
    compare,
    config_mismatches,
    format_table,
    mean,
    read_run,
    read_val_curve,
    sample_sd,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "parity.py"


def _bench():
    spec = importlib.util.spec_from_file_location("parity_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------- statistics
def test_mean_and_sample_sd():
    assert mean([1.0, 2.0, 3.0]) == 2.0
    assert sample_sd([1.0, 2.0, 3.0]) == pytest.approx(1.0)  # n - 1: sqrt(2 / 2)
    assert sample_sd([2.0, 4.0]) == pytest.approx(math.sqrt(2.0))
    with pytest.raises(ParityError, match=r"at least 2 seeds.*--seeds"):
        sample_sd([1.0])


def test_gap_in_percent_and_in_sd():
    r = compare({"bf16": {1: 1.00, 2: 1.02, 3: 1.04},
                 "fp8-delayed": {1: 1.01, 2: 1.03, 3: 1.05},   # +0.01 = 0.5 sd
                 "fp8-current": {1: 1.03, 2: 1.05, 3: 1.07}})  # +0.03 = 1.5 sd
    assert r.reference_mean == pytest.approx(1.02) and r.reference_sd == pytest.approx(0.02)
    assert r.tolerance == pytest.approx(0.02)  # the sd beats 0.3% of 1.02
    ref, delayed, current = r.recipes
    assert ref.recipe == "bf16" and ref.gap == 0 and ref.within_noise
    assert delayed.gap == pytest.approx(0.01)
    assert delayed.gap_pct == pytest.approx(100 * 0.01 / 1.02)
    assert delayed.gap_in_sd == pytest.approx(0.5)
    assert delayed.paired_gaps == pytest.approx([0.01, 0.01, 0.01])
    assert delayed.sd == pytest.approx(0.02)
    assert delayed.within_noise
    assert current.gap_in_sd == pytest.approx(1.5) and not current.within_noise
    assert not r.all_within_noise
    table = format_table(r)
    assert "fp8-delayed" in table and "within noise" in table and "OUTSIDE noise" in table
    assert "+0.50" in table and "+1.50" in table
    assert r.to_dict()["recipes"][2]["within_noise"] is False


def test_the_tolerance_is_at_least_a_third_of_a_percent():
    # Seeds that agree exactly give sd 0: the floor of 0.3% of the mean decides.
    close = compare({"bf16": {1: 2.0, 2: 2.0}, "fp8": {1: 2.005, 2: 2.005}})
    far = compare({"bf16": {1: 2.0, 2: 2.0}, "fp8": {1: 2.007, 2: 2.007}})
    assert close.tolerance == pytest.approx(0.006)
    assert close.recipes[1].within_noise and close.recipes[1].gap_in_sd == math.inf
    assert not far.recipes[1].within_noise
    # A recipe far better than bf16 is not parity either (|gap| counts).
    better = compare({"bf16": {1: 2.0, 2: 2.0}, "fp8": {1: 1.9, 2: 1.9}})
    assert not better.recipes[1].within_noise and better.recipes[1].gap_in_sd == -math.inf


def test_compare_refuses_what_it_cannot_compare():
    with pytest.raises(ParityError, match=r"no bf16 runs.*add bf16 to --recipes"):
        compare({"fp8": {1: 1.0, 2: 1.1}})
    with pytest.raises(ParityError, match=r"recipe fp8 has seeds \[1\] but bf16 has \[1, 2\].*same --seeds"):
        compare({"bf16": {1: 1.0, 2: 1.1}, "fp8": {1: 1.0}})
    with pytest.raises(ParityError, match="at least 2 seeds"):
        compare({"bf16": {1: 1.0}})
    with pytest.raises(ParityError, match=r"seed\(s\) \[2\] is not finite.*diverged"):
        compare({"bf16": {1: 1.0, 2: 1.1}, "fp8": {1: 1.0, 2: float("nan")}})


# ---------------------------------------------------------------------------- run directories
def _fake_run(d: Path, steps: int = 30, finished: bool = True) -> Path:
    d.mkdir(parents=True)
    recs = [{"step": 10, "loss": 3.0, "val_loss": 2.9}, {"step": 20, "loss": 2.5},
            {"step": 20, "loss": 2.4, "val_loss": 2.2, "start_step": 10},  # a resume redid step 20
            {"step": 30, "loss": 2.0, "val_loss": 1.9}]
    text = "".join(json.dumps(r) + "\n" for r in recs) + '{"step": 40, "lo'  # cut by a crash
    (d / "metrics.jsonl").write_text(text)
    (d / "config.yaml").write_text("trainer:\n  max_steps: 30\nmodel:\n  fp8: false\n  optim:\n"
                                   "    betas: [0.9, 0.95]\n")
    if finished:
        (d / "summary.json").write_text(json.dumps({"steps": steps, "val_loss": 1.9, "val_bpb": None,
                                                    "entropy_floor": 0.73, "wall_s": 5.0}))
    return d


def test_curve_and_final_loss_of_a_run_directory(tmp_path):
    d = _fake_run(tmp_path / "bf16-s1")
    assert read_val_curve(d) == [(10, 2.9), (20, 2.2), (30, 1.9)]  # last record of a step wins
    r = read_run(d, 30)
    assert r.val_loss == 1.9 and r.steps == 30 and r.entropy_floor == 0.73 and r.curve[-1] == (30, 1.9)


def test_unfinished_damaged_or_missing_runs_are_errors(tmp_path):
    with pytest.raises(ParityError, match=r"not a finished training run.*no metrics\.jsonl"):
        read_val_curve(tmp_path / "nothing")
    with pytest.raises(ParityError, match=r"has not finished 30 steps.*no summary\.json.*--reuse"):
        read_run(_fake_run(tmp_path / "a", finished=False), 30)
    with pytest.raises(ParityError, match=r"has not finished 30 steps.*stopped at step 20"):
        read_run(_fake_run(tmp_path / "b", steps=20), 30)
    d = _fake_run(tmp_path / "c")
    (d / "metrics.jsonl").write_text('{"step": 10}\nnot json\n{"step": 20, "val_loss": 1.0}\n')
    with pytest.raises(ParityError, match="line 2 is not JSON"):
        read_val_curve(d)
    (d / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    with pytest.raises(ParityError, match=r"no validation loss.*val_check_interval"):
        read_val_curve(d)


def test_config_mismatches_name_the_differing_keys(tmp_path):
    d = _fake_run(tmp_path / "r")
    same = ["config=gpt_125m", "trainer.max_steps=30", "model.optim.betas=[0.9,0.95]"]
    assert config_mismatches(d, same) == []
    assert config_mismatches(d, ["trainer.max_steps=99", "trainer.max_steps=30"]) == []  # last wins
    wrong = config_mismatches(d, ["trainer.max_steps=40", "model.fp8=true"])
    assert wrong == ["trainer.max_steps: the run has 30, the benchmark asks 40",
                     "model.fp8: the run has False, the benchmark asks True"]


# ---------------------------------------------------------------------------- the script's checks
@pytest.mark.parametrize("argv, message", [
    (["--recipes", "bf16,fp8-magic"],
     "unknown recipe(s) fp8-magic in --recipes: choose among bf16, fp8-delayed, fp8-current, "
     "fp8-rowwise, fp8-blockwise"),
    (["--recipes", "fp8-delayed,fp8-current"], "--recipes must include bf16"),
    (["--seeds", "1"], "--seeds needs at least 2 different seeds"),
    (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
    (["model.seed=3"], "the benchmark sets model.seed itself"),
    (["trainer.max_steps"], "is not an override: extra arguments are key=value"),
    (["--data", "/no/such/text"], "--data /no/such/text: no such file or folder"),
])
def test_bad_arguments_stop_with_one_line(tmp_path, capsys, argv, message):
    rc = _bench().main(["--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err and err.startswith("parity: error: ") and err.count("\n") == 1
    assert not (tmp_path / "out" / "runs").exists()


def test_text_data_is_prepared_once_with_the_bpe(tmp_path):
    pytest.importorskip("tokenizers")  # in the dev extra; a BPE needs it
    text = tmp_path / "texts"
    text.mkdir()
    line = "Now is the winter of our discontent made glorious summer by this sun of York. "
    (text / "a.txt").write_text(line * 40)
    (text / "b.txt").write_text("And all the clouds that lour'd upon our house in the deep bosom. " * 40)
    bench = _bench()
    args = bench.parse_args(["--data", str(text), "--vocab-size", "300", "--out", str(tmp_path / "out")])
    overrides, desc = bench.data_overrides(args)
    meta = json.loads((tmp_path / "out" / "data" / "tokens.json").read_text())
    assert meta["tokenizer"] == "tokenizer.json" and meta["vocab_size"] == 300 and meta["documents"] == 2
    tokens = (tmp_path / "out" / "data" / "tokens.bin").resolve()
    assert overrides == [f"data.path={tokens}", "data.vocab_size=300"]
    assert "vocabulary 300" in desc
    # A prepared folder is used as it is, not prepared again.
    again = bench.parse_args(["--data", str(tmp_path / "out" / "data"), "--out", str(tmp_path / "o2")])
    assert bench.data_overrides(again)[0] == overrides and not (tmp_path / "o2" / "data").exists()


# ---------------------------------------------------------------------------- end to end
TINY = ["--recipes", "bf16,fp8-delayed", "--seeds", "1,2", "trainer.max_steps=20",
        "trainer.val_check_interval=10", "trainer.limit_val_batches=2", "checkpoint.every_n_steps=10",
        "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64",
        "model.num_attention_heads=2", "model.encoder_seq_length=32", "model.micro_batch_size=8",
        "model.global_batch_size=8", "trainer.num_threads=1"]


def _run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


def test_benchmark_end_to_end_and_resumed(tmp_path):
    out = tmp_path / "parity"
    proc = _run_script("--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4 run(s) to do, 0 reused" in proc.stdout
    assert "fp8-delayed" in proc.stdout and "gap / sd" in proc.stdout  # the table is printed
    doc = json.loads((out / "parity.json").read_text())
    assert [(r["recipe"], r["seed"]) for r in doc["runs"]] == [
        ("bf16", 1), ("bf16", 2), ("fp8-delayed", 1), ("fp8-delayed", 2)]
    # The statistics are those of the runs' own summaries.
    def summary(name: str) -> dict:
        return json.loads((out / "runs" / name / "summary.json").read_text())

    val = {(r["recipe"], r["seed"]): summary(f"{r['recipe']}-s{r['seed']}")["val_loss"] for r in doc["runs"]}
    p = doc["parity"]
    assert p["reference_mean"] == pytest.approx((val["bf16", 1] + val["bf16", 2]) / 2)
    assert p["reference_sd"] == pytest.approx(abs(val["bf16", 1] - val["bf16", 2]) / math.sqrt(2))
    fp8 = p["recipes"][1]
    assert fp8["recipe"] == "fp8-delayed"
    fp8_mean = (val["fp8-delayed", 1] + val["fp8-delayed", 2]) / 2
    assert fp8["gap"] == pytest.approx(fp8_mean - p["reference_mean"])
    assert [c[0] for c in doc["runs"][0]["curve"]] == [10, 20]
    # The FP8 runs really ran FP8 (and bf16 did not), with the recipe asked for.
    for name, fp8_on in (("bf16-s1", False), ("fp8-delayed-s2", True)):
        fp8_cfg = summary(name)["fp8"]
        assert fp8_cfg["fp8"] is fp8_on and fp8_cfg["fp8_params"] is fp8_on
    assert summary("fp8-delayed-s1")["fp8"]["fp8_recipe"] == "delayed"
    if importlib.util.find_spec("matplotlib"):
        assert (out / "parity.png").stat().st_size > 10_000
    else:
        assert "no plot: matplotlib is not installed" in proc.stdout

    # A second call needs --reuse; with it, finished runs are read and an interrupted one resumes.
    again = _run_script("--out", str(out), *TINY)
    assert again.returncode == 2 and "pass --reuse" in again.stderr
    run = out / "runs" / "fp8-delayed-s2"
    first = json.loads((run / "summary.json").read_text())["val_loss"]
    (run / "summary.json").unlink()  # as if it had been stopped after its step-10 checkpoint
    shutil.rmtree(run / "checkpoints" / "step_00000020")
    (run / "checkpoints" / "latest").write_text("step_00000010\n")
    resumed = _run_script("--out", str(out), "--reuse", *TINY)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "1 run(s) to do, 3 reused" in resumed.stdout
    assert "start fp8-delayed-s2 (resuming)" in resumed.stdout
    assert json.loads((run / "summary.json").read_text())["resumed_from"] is not None
    assert json.loads((out / "parity.json").read_text())["runs"][3]["val_loss"] == first  # bit-identical
    # Other settings in the same folder are refused, not mixed in.
    other = _run_script("--out", str(out), "--reuse", *TINY, "trainer.max_steps=30")
    assert other.returncode == 2
    assert "other settings (trainer.max_steps: the run has 20, the benchmark asks 30)" in other.stderr
