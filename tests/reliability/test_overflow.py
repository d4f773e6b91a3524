"""FP8 overflow reporting ([Note: overflow check] in fp8shard/nn/overflow.py): a cast that
saturates because the delayed scale (from past amaxes) is too large for this step's values is
reported with the layer's name and counted; normal steps report nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fp8shard as fs
from fp8shard.nn.overflow import OverflowMonitor
from fp8shard.train.config import load_config
from fp8shard.train.distributed import DistEnv
from fp8shard.train.loop import Trainer
from fp8shard.train.metrics import read_metrics
from tests.reliability.common import run_args

CPU = DistEnv(0, 1, 0, torch.device("cpu"), None)
RECIPE = fs.DelayedScaling(amax_history_len=4)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = fs.nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = fs.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def _step(net: Net, x: torch.Tensor) -> None:
    with fs.fp8_autocast(enabled=True, recipe=RECIPE):
        y = net(x)
    y.square().mean().backward()
    fs.nn.AmaxSync(net).step()  # what the training loop does after each backward


def test_a_spike_is_reported_by_layer_and_operand():
    torch.manual_seed(0)
    net = Net()
    with OverflowMonitor(net, factor=4.0) as mon:
        for _ in range(4):  # the histories fill with amaxes around 3-4
            _step(net, torch.randn(64, 16))
        assert mon.poll() == []  # small excursions are counted as saturation at most
        scale = float(net.fc1.fp8_scale[0])
        x = torch.randn(64, 16)
        x[3, 5] = 1000.0  # one outlier, far beyond 448 / scale
        _step(net, x)
        events = mon.poll()
        by_key = {(o.layer, o.operand): o for o in events}
        o = by_key[("fc1", "input")]
        assert o.amax == 1000.0 and o.scale == scale and o.fmt_max == 448.0 and o.count == 1
        assert not o.nonfinite and o.amax * o.scale > 4 * 448
        msg = o.message()
        assert msg.startswith("fp8 overflow in layer 'fc1' input: amax 1000 > 448 / scale ")
        assert f"= {448 / scale:.4g} (saturated; 1 reduction(s))" in msg
        assert mon.overflows == len(events) and mon.poll() == []  # polled once, then forgotten
        _step(net, torch.randn(64, 16))  # the window now holds the spike: the scale is small
        assert mon.poll() == []
    _step(net, x)  # closed: nothing is observed any more
    assert mon.poll() == []


def test_monitors_of_two_models_each_see_their_own_layers():
    """A monitor is held by the layers it watches, not by the process: a spike in one model is
    reported by that model's monitor only, and a closed monitor leaves no trace on the layers."""
    torch.manual_seed(0)
    a, b = Net(), Net()
    with OverflowMonitor(a, factor=4.0) as mon_a, OverflowMonitor(b, factor=4.0) as mon_b:
        assert a.fc1._fp8_monitors == (mon_a,) and b.fc1._fp8_monitors == (mon_b,)
        for _ in range(4):
            _step(a, torch.randn(64, 16))
            _step(b, torch.randn(64, 16))
        mon_a.poll(), mon_b.poll()
        x = torch.randn(64, 16)
        x[3, 5] = 1000.0
        _step(b, x)
        assert mon_a.poll() == [] and ("fc1", "input") in {(o.layer, o.operand) for o in mon_b.poll()}
    assert a.fc1._fp8_monitors == () and b.fc1._fp8_monitors == ()


def test_the_informed_first_call_is_not_an_overflow():
    """A layer's first delayed-scaling call casts as current scaling ([Note: informed first
    call] in nn/linear.py): it cannot saturate, so an amax far beyond 448 at the initial scale 1
    is no overflow there; the next call casts with the history's scale and can overflow."""
    torch.manual_seed(0)
    net = Net()
    with OverflowMonitor(net, factor=1.0) as mon:
        x = torch.randn(64, 16)
        x[3, 5] = 1000.0
        _step(net, x)
        assert mon.poll() == [] and mon.saturated == 0
        _step(net, 4 * x)  # 4000 against the scale 448 / 1000 of the history: clipped
        assert ("fc1", "input") in {(o.layer, o.operand) for o in mon.poll()}


def test_mild_saturation_is_counted_not_reported_and_non_finite_amaxes_are():
    torch.manual_seed(1)
    net = Net()
    mon = OverflowMonitor(net, factor=4.0).open()
    try:
        for _ in range(3):
            _step(net, torch.randn(64, 16))
        mon.poll()
        saturated = mon.saturated
        _step(net, 2.0 * torch.randn(64, 16))  # about twice the window's amax: saturates, < 4x
        assert mon.poll() == [] and mon.saturated > saturated and mon.overflows == 0
        x = torch.randn(64, 16)
        x[0, 0] = float("nan")
        _step(net, x)
        events = mon.poll()
        assert ("fc1", "input") in {(o.layer, o.operand) for o in events if o.nonfinite}
        nan = next(o for o in events if o.nonfinite and o.layer == "fc1" and o.operand == "input")
        assert math.isnan(nan.amax) and "fp8 non-finite amax in layer 'fc1' input: amax nan" in nan.message()
        assert mon.nonfinite >= 1
    finally:
        mon.close()
    with pytest.raises(ValueError, match="factor"):
        OverflowMonitor(net, factor=0.5)


def _spiked_run(tmp_path, spike_step: int | None, steps: int = 6) -> Trainer:
    """The tiny GPT in-process; ``blocks.1.mlp.fc1``'s input is multiplied by 1000 at ``spike_step``."""
    cfg = load_config(run_args(tmp_path / "run", f"trainer.max_steps={steps}",
                               "trainer.val_check_interval=50"))
    trainer = Trainer(cfg, CPU)
    layer = trainer.model.get_submodule("blocks.1.mlp.fc1")

    def spike(module, args):
        if trainer.step + 1 == spike_step and module.training:
            return (args[0] * 1000.0,)
        return None

    layer.register_forward_pre_hook(spike)
    trainer.fit()
    return trainer


def test_the_training_command_reports_a_spike_by_name(tmp_path, capsys):
    _spiked_run(tmp_path, spike_step=3)
    out = capsys.readouterr().out
    reports = [line for line in out.splitlines() if "fp8 overflow" in line]
    assert reports, out
    assert all(line.startswith("warning: step 3: fp8 overflow in layer '") for line in reports), reports
    # The worst first: the spiked input, then what it did downstream (gradients, the next layers).
    assert "layer 'blocks.1.mlp.fc1' input: amax" in reports[0], reports
    more = [line for line in out.splitlines() if line.startswith("warning: step 3: ... and ")]
    shown = len(reports) + (int(more[0].split()[5]) if more else 0)
    records = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    assert records[1]["fp8_overflows"] == records[2]["fp8_overflows"] == 0
    assert records[3]["fp8_overflows"] == shown == records[6]["fp8_overflows"]  # none after step 3


def test_a_normal_run_reports_no_overflow(tmp_path, capsys):
    trainer = _spiked_run(tmp_path, spike_step=None, steps=12)
    out = capsys.readouterr().out
    assert "fp8 overflow" not in out and "non-finite amax" not in out
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["fp8_overflows"] for r in records] == [0] * 12
    assert trainer.overflow is not None and trainer.overflow.overflows == 0
    print(f"\nsaturated (layer, operand, step) in 12 normal steps: {records[-1]['fp8_saturated']}")


def test_a_tiny_amax_overflow_reads_as_what_it_is():
    """A gradient amax of 4e-4 beyond a scale set from smaller ones: the line says values were
    clipped at the current scale (not an error), and the run explains it once, in plain words."""
    from fp8shard.nn.overflow import OVERFLOW_NOTE, Fp8Overflow

    o = Fp8Overflow("blocks.0.mlp.fc2", "grad_output", amax=4e-4, scale=57344 / 1e-4, fmt_max=57344.0,
                    count=1)
    msg = o.message()
    assert msg.startswith("fp8 overflow in layer 'blocks.0.mlp.fc2' grad_output: amax 0.0004 > 57344 / "
                          "scale ")
    assert "values up to 4x the largest this cast could represent at its scale from earlier steps were " \
           "clipped to it" in msg
    assert "error" not in msg.lower() and "error" not in OVERFLOW_NOTE.lower()
    assert "harmless" in OVERFLOW_NOTE and "model.fp8_margin=1" in OVERFLOW_NOTE
    mon = OverflowMonitor(nn.Linear(2, 2))
    assert mon.note_for([o]) == OVERFLOW_NOTE and mon.note_for([o]) is None  # once per run


def test_the_training_command_explains_an_overflow_once(tmp_path, capsys):
    _spiked_run(tmp_path, spike_step=3)
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("note: an FP8 overflow")]
    assert len(notes) == 1
