"""The short runs whose loss curves are kept in tests/train/golden/ (torchtitan's loss_compare).

Regenerate after an intended change of numerics (and say why in the commit):

    python tests/train/golden_runs.py            # rewrites tests/train/golden/*.json

Each golden file holds the overrides, the training loss at every logged step and the final
validation loss; tests/train/test_convergence.py runs the same overrides and compares.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.train.helpers import TINY, read_metrics, read_summary, run_train

GOLDEN_DIR = Path(__file__).with_name("golden")
STEPS = 120
COMMON = [*TINY, f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=10",
          f"trainer.val_check_interval={STEPS}", "model.optim.sched.warmup_steps=20"]

RUNS: dict[str, list[str]] = {
    # fp8shard's configuration: FP8 GEMMs, FP8 weights, DistributedFusedAdam.
    "fp8_params_dfa": [*COMMON, "model.fp8=true", "model.fp8_params=true",
                       "model.optim.name=distributed_fused_adam"],
    # The baseline: bf16 autocast, fp32 weights, torch AdamW.
    "bf16_adamw": [*COMMON, "model.fp8=false", "model.fp8_params=false", "model.optim.name=adamw"],
}


def curve(run_dir: Path) -> dict[str, object]:
    metrics = read_metrics(run_dir)
    return {"loss": {str(r["step"]): r["loss"] for r in metrics},
            "val_loss": read_summary(run_dir)["val_loss"]}


def regenerate() -> None:
    import torch

    GOLDEN_DIR.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in RUNS.items():
            run_dir = Path(tmp) / name
            run_train(run_dir, overrides)
            data = {"overrides": overrides, "torch": torch.__version__, **curve(run_dir)}
            path = GOLDEN_DIR / f"{name}.json"
            path.write_text(json.dumps(data, indent=1) + "\n")
            print(f"wrote {path}: final val loss {data['val_loss']:.4f}")


if __name__ == "__main__":
    regenerate()
