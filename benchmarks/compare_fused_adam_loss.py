"""Does the fused optimizer step change the loss curve? The training command on the CPU twice:
with the fused step's Triton kernels run by Triton's interpreter (``model.optim.fused=true``),
and on the PyTorch path (``model.optim.fused=false``); no GPU needed.

    python benchmarks/compare_fused_adam_loss.py [--out FILE.json] [key=value ...]

The ``key=value`` arguments are the training command's (``python -m fp8shard.train``); the runs
go to ``exp_manager.exp_dir`` (default runs/) as ``<name>_fused`` and ``<name>_pytorch``. Only
the optimizer's fused step is interpreted (``optim/triton_adam.py``, about 10 s per step for a
125 k-parameter model on 2 cores); the layers' FP8 casts take their reference path as on any CPU
run. The interpreter is given the GPU's fp32 -> bf16 / FP8 rounding
(``fp8shard.testing.triton_interp``). Needs the ``interp`` extra (``triton==3.9.0``). Prints the
logged losses of both runs side by side and writes them as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton


def _run(argv: list[str], fused: bool) -> list[dict]:
    from fp8shard.train.__main__ import main as train_main
    from fp8shard.train.config import load_config
    from fp8shard.train.metrics import read_metrics

    cfg = load_config(argv, validate_cfg=False)
    name = f"{cfg.exp_manager.name}_{'fused' if fused else 'pytorch'}"
    args = [*argv, f"model.optim.fused={str(fused).lower()}", f"exp_manager.name={name}",
            "trainer.resume=never", "trainer.overwrite=true", "exp_manager.plots=false"]
    code = train_main(args)
    if code != 0:
        raise SystemExit(f"the {name} run failed (exit {code})")
    return read_metrics(Path(cfg.exp_manager.exp_dir) / name / "metrics.jsonl")


def main(argv: list[str]) -> int:
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    from fp8shard.testing.triton_interp import interpret_fused_adam

    interpret_fused_adam()
    runs = {"fused": _run(argv, True), "pytorch": _run(argv, False)}
    print("\n| step | loss, fused (interpreted) | loss, PyTorch path | relative difference |")
    print("|---|---|---|---|")
    rows = []
    for a, b in zip(runs["fused"], runs["pytorch"], strict=True):
        for key in ("loss", "val_loss"):
            if key in a and key in b:
                rel = abs(a[key] - b[key]) / abs(b[key])
                rows.append({"step": a["step"], "what": key, "fused": a[key], "pytorch": b[key], "rel": rel})
                label = a["step"] if key == "loss" else f"{a['step']} (validation)"
                print(f"| {label} | {a[key]:.4f} | {b[key]:.4f} | {rel:.1e} |")
    if out:
        result = {"benchmark": "fused_adam_loss", "argv": argv, "rows": rows}
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
