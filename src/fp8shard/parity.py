"""Loss parity of FP8 recipes against bf16: the statistics and reading the runs' curves.

No torch import: ``benchmarks/parity.py`` runs the training command as subprocesses and only
reads what they wrote (``metrics.jsonl``, ``summary.json``, ``config.yaml``).

[Note: parity verdict]
    Each recipe trains with the same seeds as the reference (bf16). For the reference, the
    seed-to-seed spread is the sample standard deviation (n - 1) of its final validation
    losses, ``sd_ref``. A recipe's gap is ``mean(recipe) - mean(ref)`` (positive: FP8 is worse),
    given in % of ``mean(ref)`` and in units of ``sd_ref``. The recipe is **within noise** when
    ``|gap| <= max(sd_ref, 0.3% of mean(ref))``: the floor of 0.3% keeps a verdict meaningful
    when a few seeds happen to agree closely. The gap is taken in absolute value because parity
    means neither worse nor suspiciously better. The paired differences (same seed, recipe minus
    reference) are reported too: seeds share the initial weights and the batches, so they show
    the gap with less of the seed-to-seed noise.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REFERENCE = "bf16"
RELATIVE_FLOOR = 0.003
"""The tolerance is at least this fraction of the reference's mean loss ([Note: parity verdict])."""


class ParityError(ValueError):
    """Inputs the parity statistics cannot use; the message names the problem and the fix."""


# ---------------------------------------------------------------------------- statistics
def mean(xs: Sequence[float]) -> float:
    if not xs:
        raise ParityError("the mean of no values: every recipe needs at least one finished run")
    return math.fsum(xs) / len(xs)


def sample_sd(xs: Sequence[float]) -> float:
    """Standard deviation with Bessel's correction (n - 1); needs two values or more."""
    if len(xs) < 2:
        raise ParityError(f"a seed-to-seed spread needs at least 2 seeds, got {len(xs)}: "
                          "pass more with --seeds (e.g. --seeds 1,2,3)")
    m = mean(xs)
    return math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@dataclasses.dataclass
class RecipeStats:
    """One recipe's final validation losses and how they compare with the reference's."""

    recipe: str
    seeds: list[int]
    losses: list[float]
    """Final validation loss of each seed, in the order of ``seeds``."""
    mean: float
    sd: float | None
    """Sample standard deviation over the seeds (None with one seed)."""
    gap: float
    """mean - reference mean (nats/token); 0 for the reference."""
    gap_pct: float
    """gap in % of the reference mean."""
    gap_in_sd: float
    """gap in units of the reference's seed-to-seed sd (inf when that sd is 0 and the gap is not)."""
    paired_gaps: list[float]
    """Per seed: this recipe's loss - the reference's loss with the same seed."""
    tolerance: float
    """max(reference sd, 0.3% of the reference mean)."""
    within_noise: bool
    """|gap| <= tolerance ([Note: parity verdict])."""


@dataclasses.dataclass
class ParityReport:
    reference: str
    reference_mean: float
    reference_sd: float
    tolerance: float
    recipes: list[RecipeStats]

    @property
    def all_within_noise(self) -> bool:
        return all(r.within_noise for r in self.recipes)

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.reference, "reference_mean": self.reference_mean,
                "reference_sd": self.reference_sd, "tolerance": self.tolerance,
                "relative_floor": RELATIVE_FLOOR, "all_within_noise": self.all_within_noise,
                "recipes": [dataclasses.asdict(r) for r in self.recipes]}


def _gap_in_sd(gap: float, sd: float) -> float:
    if sd > 0:
        return gap / sd
    return 0.0 if gap == 0 else math.copysign(math.inf, gap)


def compare(losses: Mapping[str, Mapping[int, float]], reference: str = REFERENCE) -> ParityReport:
    """``losses[recipe][seed]``: final validation losses. Every recipe must have the reference's
    seeds (the comparison is paired); the reference needs two seeds or more (its spread)."""
    if reference not in losses:
        raise ParityError(f"no {reference} runs to compare with: the recipes are {sorted(losses)}; "
                          f"add {reference} to --recipes")
    ref = losses[reference]
    seeds = sorted(ref)
    for name, by_seed in losses.items():
        missing = [s for s in seeds if s not in by_seed]
        extra = [s for s in by_seed if s not in ref]
        if missing or extra:
            raise ParityError(f"recipe {name} has seeds {sorted(by_seed)} but {reference} has {seeds}: "
                              "the comparison is per seed, so run every recipe with the same --seeds")
        bad = [s for s in seeds if not math.isfinite(by_seed[s])]
        if bad:
            raise ParityError(f"recipe {name}: the validation loss of seed(s) {bad} is not finite "
                              f"({[by_seed[s] for s in bad]}): that run diverged; look at its metrics.jsonl")
    ref_losses = [ref[s] for s in seeds]
    ref_mean, ref_sd = mean(ref_losses), sample_sd(ref_losses)
    tolerance = max(ref_sd, RELATIVE_FLOOR * abs(ref_mean))
    order = [reference] + [n for n in losses if n != reference]
    stats = []
    for name in order:
        xs = [losses[name][s] for s in seeds]
        m = mean(xs)
        gap = m - ref_mean
        stats.append(RecipeStats(
            recipe=name, seeds=seeds, losses=xs, mean=m, sd=sample_sd(xs) if len(xs) > 1 else None,
            gap=gap, gap_pct=100.0 * gap / ref_mean, gap_in_sd=_gap_in_sd(gap, ref_sd),
            paired_gaps=[x - r for x, r in zip(xs, ref_losses, strict=True)],
            tolerance=tolerance, within_noise=abs(gap) <= tolerance))
    return ParityReport(reference, ref_mean, ref_sd, tolerance, stats)


def format_table(report: ParityReport) -> str:
    """The table the benchmark prints (one row per recipe, the reference first)."""
    head = (f"{'recipe':<14} {'seeds':>5} {'mean val loss':>13} {'sd':>8} {'gap':>9} {'gap %':>8} "
            f"{'gap / sd':>8}  verdict")
    lines = [head, "-" * len(head)]
    for r in report.recipes:
        sd = f"{r.sd:.4f}" if r.sd is not None else "-"
        if r.recipe == report.reference:
            cells, verdict = f"{'':>9} {'':>8} {'':>8}", "reference"
        else:
            cells = f"{r.gap:>+9.4f} {r.gap_pct:>+7.2f}% {r.gap_in_sd:>+8.2f}"
            verdict = "within noise" if r.within_noise else "OUTSIDE noise"
        lines.append(f"{r.recipe:<14} {len(r.seeds):>5} {r.mean:>13.4f} {sd:>8} {cells}  {verdict}")
    lines.append(f"tolerance: max({report.reference} sd {report.reference_sd:.4f}, "
                 f"{100 * RELATIVE_FLOOR:.1f}% of {report.reference_mean:.4f} = "
                 f"{RELATIVE_FLOOR * report.reference_mean:.4f}) = {report.tolerance:.4f} nats/token")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- run directories
def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON records of a metrics.jsonl; a last line cut short by a crash is left out, a
    damaged line elsewhere is an error. A step logged twice (a resumed run) keeps its last record."""
    lines = path.read_text().splitlines()
    by_step: dict[int, dict[str, Any]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise ParityError(f"{path}: line {i + 1} is not JSON ({line[:60]!r}): the file is damaged; "
                              "delete that run directory and run it again") from None
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def read_val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of every validation the run logged, by step."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ParityError(f"{run_dir} is not a finished training run (no metrics.jsonl): "
                          "run the benchmark without --reuse, or pass the directory of a training run")
    curve = [(r["step"], float(r["val_loss"])) for r in read_records(path) if r.get("val_loss") is not None]
    if not curve:
        raise ParityError(f"{path} has no validation loss: the run validates every "
                          "trainer.val_check_interval steps and after the last; was it cut short?")
    return curve


@dataclasses.dataclass
class RunResult:
    """What the benchmark keeps of one finished run."""

    run_dir: str
    steps: int
    val_loss: float
    val_bpb: float | None
    entropy_floor: float | None
    wall_s: float | None
    curve: list[tuple[int, float]]


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json, or None when the run has not finished (none written)."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError:
        raise ParityError(f"{path} is not JSON: delete {run_dir} and run it again") from None


def read_run(run_dir: Path, max_steps: int) -> RunResult:
    """A finished run's final validation loss (summary.json) and curve (metrics.jsonl).

    A run that stopped before ``max_steps`` (no summary, or a summary of fewer steps) is an error
    naming the directory: it has to be resumed or rerun first."""
    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    if summary is None or summary.get("steps") != max_steps:
        done = "no summary.json" if summary is None else f"it stopped at step {summary.get('steps')}"
        raise ParityError(f"{run_dir} has not finished {max_steps} steps ({done}): run the benchmark "
                          "again with --reuse, which resumes it (from its newest checkpoint, if any)")
    val = summary.get("val_loss")
    if not isinstance(val, (int, float)):
        raise ParityError(f"{run_dir}/summary.json has no validation loss (val_loss={val!r}): "
                          "set trainer.limit_val_batches > 0")
    return RunResult(run_dir=str(run_dir), steps=max_steps, val_loss=float(val),
                     val_bpb=summary.get("val_bpb"), entropy_floor=summary.get("entropy_floor"),
                     wall_s=summary.get("wall_s"), curve=read_val_curve(run_dir))


def config_mismatches(run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The ``key=value`` overrides whose value differs from the run's config.yaml, as
    ``key: run has X, asked Y`` (a reused run must be the run the benchmark would make); of a
    key given twice, the last value counts, as in the training command.
    Keys without a dot (``config=...``, a preset file) are not in config.yaml and are skipped."""
    import yaml  # a dependency of fp8shard; imported here so the statistics need nothing

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return [f"{path} is missing"]
    cfg = yaml.safe_load(path.read_text()) or {}
    last = dict(item.partition("=")[::2] for item in overrides)  # later overrides win
    out = []
    for key, text in last.items():
        if "." not in key:
            continue
        node: Any = cfg
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        want = yaml.safe_load(text)
        if node != want and not (isinstance(node, list) and list(node) == want):
            out.append(f"{key}: the run has {node!r}, the benchmark asks {want!r}")
    return out
