"""Single-process round trips: the torch AdamW baseline, the `latest` pointer and keep_last."""

from __future__ import annotations

import torch

from fp8shard.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from tests.checkpoint import cases


def _adamw_run(seed: int = 0):
    model = cases.build_model(seed=seed, fp8=False).float()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def _train(model, opt, first: int, last: int) -> list[float]:
    out = []
    for step in range(first, last):
        x, y = cases.batch(step)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def test_torch_adamw_resume_is_bit_identical(tmp_path):
    """The DDP baseline's optimizer (full, replicated per-parameter states) resumes exactly."""
    model, opt = _adamw_run()
    ref = _train(model, opt, 0, 4)
    model, opt = _adamw_run()
    _train(model, opt, 0, 2)
    path = save_checkpoint(tmp_path / "step_2", model, opt, step=2)
    model, opt = _adamw_run(seed=9)
    load_checkpoint(path, model, opt)
    assert isinstance(opt.state_dict()["state"][0]["step"], torch.Tensor)
    assert _train(model, opt, 2, 4) == ref[2:]


def test_latest_pointer_and_keep_last(tmp_path):
    model, opt = cases.build()
    for step in (1, 2, 3, 4):
        save_checkpoint(checkpoint_path(tmp_path, step), model, opt, step=step, keep_last=2)
        assert (tmp_path / "latest").read_text().strip() == f"step_{step:08d}"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    assert latest_checkpoint(tmp_path / "none") is None


def test_save_runs_no_amax_reduction(tmp_path):
    """The delayed-scaling amaxes belong to AmaxSync ([Note: amax reduction]): a save neither
    reduces nor rolls them (it used to run the reduction fp8_autocast entry did), and what it
    wrote loads back as it was, an informed history ([Note: informed first call])."""
    import fp8shard as fs

    model = cases.build_model(seed=0, fp8=True)
    x, y = cases.batch(0)
    with fs.fp8_autocast(recipe=fs.DelayedScaling(amax_history_len=4)):
        model(x, y).backward()
    layers = [m for m in model.modules() if isinstance(m, fs.nn.Linear) and m._amax_state is not None]
    before = [(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in layers]
    assert layers and all(bool((h[0] > 0).any()) for h, _ in before)  # recorded, not reduced
    save_checkpoint(tmp_path / "step_1", model, step=1)
    for m, (hist, scale) in zip(layers, before, strict=True):
        assert torch.equal(m.fp8_amax_history, hist) and torch.equal(m.fp8_scale, scale)
    fresh = cases.build_model(seed=5, fp8=True)
    load_checkpoint(tmp_path / "step_1", fresh)
    loaded = [m for m in fresh.modules() if isinstance(m, fs.nn.Linear) and hasattr(m, "fp8_amax_history")]
    assert [torch.equal(m.fp8_amax_history, h) for m, (h, _) in zip(loaded, before, strict=True)] == \
        [True] * len(before)
    assert not any(m._fp8_history_empty for m in loaded)
