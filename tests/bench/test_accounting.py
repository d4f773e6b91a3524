"""benchmarks/accounting.py's replay of a CUDA memory trace, on a trace written by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from accounting import peak_live_blocks


def _frames(filename: str, line: int, name: str) -> list[dict]:
    # innermost first, as torch records them: a torch frame, then the one that says what it is for
    return [{"filename": "/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": filename, "line": line, "name": name}]


def test_live_at_peak_groups_by_allocation_site_and_ignores_later_frees() -> None:
    mb = 2**20
    logits = _frames("/src/fp8shard/models/loss.py", 80, "_chunks")
    act = _frames("/src/fp8shard/models/gpt.py", 120, "forward")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100 * mb, "frames": act},
        {"action": "alloc", "addr": 2, "size": 300 * mb, "frames": logits},
        {"action": "alloc", "addr": 3, "size": 300 * mb, "frames": logits},
        {"action": "free_requested", "addr": 2, "size": 300 * mb},  # not yet given back
        {"action": "alloc", "addr": 4, "size": 50 * mb, "frames": act},  # the peak: 750 MB
        {"action": "free_completed", "addr": 2, "size": 300 * mb},
        {"action": "free_completed", "addr": 3, "size": 300 * mb},
        {"action": "alloc", "addr": 5, "size": 400 * mb, "frames": act},  # 550 MB: below the peak
        {"action": "segment_alloc", "addr": 9, "size": 2000 * mb},  # reserved, not allocated
    ]
    out = peak_live_blocks({"device_traces": [trace]})
    assert out["peak_mb"] == 750
    assert [(g["mb"], g["blocks"]) for g in out["groups"]] == [(600, 2), (150, 2)]
    assert out["groups"][0]["where"].startswith("loss.py:80 _chunks")
    assert out["groups"][1]["where"].startswith("gpt.py:120 forward")


def test_an_empty_trace_has_no_peak() -> None:
    assert peak_live_blocks({"device_traces": [[]]}) == {"peak_mb": 0.0, "groups": [], "kinds": []}
    assert peak_live_blocks({}) == {"peak_mb": 0.0, "groups": [], "kinds": []}


def test_live_at_peak_adds_up_inductor_blocks_of_one_shape_made_on_many_lines(tmp_path) -> None:
    """Inductor allocates each chunk's buffer on its own line; by shape and dtype they add up."""
    mb = 2**20
    code = tmp_path / "torchinductor_cx" / "cabc.py"
    code.parent.mkdir()
    code.write_text("\n".join([
        "buf1 = empty_strided_cuda((1280, 50304), (50304, 1), torch.float32)",
        "buf2 = empty_strided_cuda((1280, 50304), (50304, 1), torch.float32)",
        "buf3 = empty_strided_cuda((768, 3072), (3072, 1), torch.bfloat16)"]) + "\n")
    at = lambda line: [{"filename": str(code), "line": line, "name": "call"}]
    trace = [{"action": "alloc", "addr": 1, "size": 240 * mb, "frames": at(1)},
             {"action": "alloc", "addr": 2, "size": 240 * mb, "frames": at(2)},
             {"action": "alloc", "addr": 3, "size": 300 * mb, "frames": at(3)}]
    out = peak_live_blocks({"device_traces": [trace]})
    assert [(g["mb"], g["blocks"]) for g in out["groups"]] == [(300, 1), (240, 1), (240, 1)]
    assert [(g["mb"], g["blocks"], g["where"]) for g in out["kinds"]] == [
        (480, 2, "(1280, 50304) float32"), (300, 1, "(768, 3072) bfloat16")]


def test_memory_table_prints_the_phases_and_what_is_live():
    from accounting import PHASES, memory_table

    row = {"system": "fp8shard-bf16+compile", "available": True,
           "mem_phases_mb": dict(zip(PHASES, (1968.0, 9909.0, 6785.0, 9950.0, 1968.0, 1970.0), strict=True)),
           "live_at_peak": {"peak_mb": 3124.0,
                            "groups": [{"mb": 3072.0, "blocks": 13, "where": "loss.py:80 _chunks"}]}}
    lines = memory_table([row, {"system": "cpu", "available": True, "mem_phases_mb": None},
                          {"system": "gone", "available": False}])
    table = "\n".join(lines)
    assert "fwd peak" in table and "bwd end" in table
    assert next(ln for ln in lines if ln.startswith("fp8shard-bf16+compile")).split()[1:] == \
        ["1968", "9909", "6785", "9950", "1968", "1970"]
    assert "live at the step's peak (3124 MB" in table and "loss.py:80 _chunks" in table
    assert "by shape and dtype:" in table
    assert "cpu" not in table and "gone" not in table


def test_step_memory_reads_each_phase(monkeypatch):
    """StepMemory's bookkeeping with torch.cuda's counters replaced by a scripted allocator."""
    import accounting

    mb = 2**20
    state = {"now": 100 * mb, "peak": 500 * mb, "recording": False}

    def alloc(n: int) -> None:  # allocate (n > 0) or free (n < 0) n MB
        state["now"] += n * mb
        state["peak"] = max(state["peak"], state["now"])

    cuda = accounting.torch.cuda
    monkeypatch.setattr(cuda, "memory_allocated", lambda: state["now"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["now"]))
    monkeypatch.setattr(cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: state.update(recording=enabled is not None))
    monkeypatch.setattr(cuda.memory, "_snapshot", lambda: {"device_traces": [[
        {"action": "alloc", "addr": 1, "size": 40 * mb, "frames": []}]]})
    m = accounting.StepMemory(snapshot=True)
    m.begin()
    assert state["recording"]
    alloc(300), alloc(-200)  # forward: peak 400, 200 left for backward
    m.end("forward")
    alloc(50), alloc(-250)  # backward
    m.end("backward")
    alloc(30), alloc(-30)  # optimizer
    m.end("optimizer")
    assert m.mb == {"start": 100, "peak_forward": 400, "after_forward": 200, "peak_backward": 250,
                    "after_backward": 0, "peak_optimizer": 30}
    assert m.peak_bytes() == 500 * mb  # the run's earlier peak
    block = [{"mb": 40.0, "blocks": 1, "where": "(no frames)"}]
    assert not state["recording"] and m.live == {"peak_mb": 40.0, "groups": block, "kinds": block}
