"""The data: a deterministic corpus with a known floor, and global batches independent of world size."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8shard.train.config import DataConfig
from fp8shard.train.data import BatchLoader, MarkovSource, load_data, val_batches


def test_markov_corpus_is_deterministic_and_seed_dependent():
    cfg = DataConfig(num_train_tokens=5000, num_val_tokens=2000)
    a, b = load_data(cfg, 16), load_data(cfg, 16)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)
    assert a.entropy_floor == b.entropy_floor
    c = load_data(DataConfig(num_train_tokens=5000, num_val_tokens=2000, seed=7), 16)
    assert not np.array_equal(a.train, c.train)
    assert len(a.train) == 5000 and len(a.val) == 2000 and int(a.train.max()) < 256


def test_entropy_floor_is_the_true_models_loss():
    """The floor equals the mean -log p(x_t | context) of the generating chain on its own samples."""
    src = MarkovSource(vocab_size=64, order=2, classes=3, spread=3, concentration=0.5, seed=3)
    tokens, floor = src.sample(200_000, stream=11, chains=100, min_length=2000)
    x = tokens.astype(np.int64).reshape(100, -1)  # chains laid end to end
    prev1, prev2, nxt = x[:, 1:-1], x[:, :-2], x[:, 2:]
    cls = src.cls[0][prev2] % src.classes
    offset = (nxt - src.succ[prev1] + src.offsets.max()) % 64  # index into offsets
    nll = -np.log(src.probs[cls, offset]).mean()
    assert nll == pytest.approx(floor, abs=0.02)
    # ... and it is well below what order-1 statistics allow, so context matters.
    pair = np.zeros((64, 64))
    np.add.at(pair, (prev1.ravel(), nxt.ravel()), 1)
    p1 = pair / pair.sum(1, keepdims=True)
    h1 = -(pair * np.log(np.where(p1 > 0, p1, 1))).sum() / pair.sum()
    assert h1 > floor + 0.05
    assert floor < math.log(64) / 2


def _rank_windows(tokens, world_size, steps, gbs=8, mbs=2, seq=4, seed=5):
    """Per step, the token windows every rank reads, concatenated in rank order."""
    loaders = [BatchLoader(tokens, seq, gbs, mbs, r, world_size, seed) for r in range(world_size)]
    out = []
    for _ in range(steps):
        per_rank = [torch.cat([x for x, _ in ld.next_batches()]) for ld in loaders]
        out.append(torch.cat(per_rank))
    return out


def test_global_batches_do_not_depend_on_world_size_and_ranks_do_not_overlap():
    tokens = np.arange(1000, dtype=np.uint16)  # window i starts at token 4 i: ids identify windows
    ref = _rank_windows(tokens, 1, steps=40)  # 40 x 8 samples > 249 windows: crosses an epoch
    for world in (2, 4, 8):
        got = _rank_windows(tokens, world, steps=40)
        for a, b in zip(ref, got, strict=True):
            assert torch.equal(a, b)
    starts = torch.cat([s[:, 0] for s in ref[:31]])  # 248 samples within the first epoch
    assert len(set(starts.tolist())) == len(starts)  # no window twice within an epoch


def test_targets_are_inputs_shifted_by_one():
    tokens = np.arange(500, dtype=np.uint16)
    (x, y), = BatchLoader(tokens, 8, 4, 4, 0, 1, seed=0).next_batches()
    assert x.shape == (4, 8) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(y - x, torch.ones_like(x))


def test_loader_state_resumes_at_another_world_size():
    tokens = np.arange(2000, dtype=np.uint16)
    full = _rank_windows(tokens, 1, steps=6)
    first = BatchLoader(tokens, 4, 8, 2, 0, 1, seed=5)
    for _ in range(4):
        first.next_batches()
    state = first.state_dict()
    assert state["consumed_samples"] == 32
    resumed = [BatchLoader(tokens, 4, 8, 2, r, 2, seed=5) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(state)
    for step in (4, 5):
        got = torch.cat([torch.cat([x for x, _ in ld.next_batches()]) for ld in resumed])
        assert torch.equal(got, full[step])
    with pytest.raises(ValueError, match="seed=5"):
        BatchLoader(tokens, 4, 8, 2, 0, 1, seed=6).load_state_dict(state)


def test_validation_windows_are_split_evenly_and_cover_the_same_set():
    tokens = np.arange(3000, dtype=np.uint16)
    whole = torch.cat([x for x, _, _ in val_batches(tokens, 10, 32, 4, 0, 1)])
    parts = [list(val_batches(tokens, 10, 32, 4, r, 4)) for r in range(4)]
    assert len({len(p) for p in parts}) == 1  # same number of forwards on every rank
    assert torch.equal(torch.cat([x for p in parts for x, _, pad in p if not pad]), whole)


@pytest.mark.parametrize("windows,world,micro", [(1, 2, 4), (2, 3, 1), (3, 2, 4), (5, 4, 2), (7, 3, 2)])
def test_fewer_validation_windows_than_ranks_still_cover_each_window_once(windows, world, micro):
    # [Note: validation split]: every window once, every rank the same number of forwards (at
    # least one, a padding forward where its share is empty); padding is left out of the mean.
    seq = 10
    tokens = np.arange(windows * seq + 1, dtype=np.uint16)  # exactly `windows` windows
    parts = [list(val_batches(tokens, seq, 10**6, micro, r, world)) for r in range(world)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) >= 1
    starts = sorted(int(x[0]) for p in parts for xs, _, pad in p if not pad for x in xs[:, 0:1])
    assert starts == [i * seq for i in range(windows)]


def test_text_and_token_files(tmp_path):
    text = tmp_path / "t.txt"
    text.write_bytes(bytes(range(256)) * 20)
    d = load_data(DataConfig(source="text", path=str(text), val_fraction=0.1), 16)
    assert d.vocab_size == 256 and len(d.train) + len(d.val) == 5120 and d.entropy_floor is None
    ids = (np.arange(10_000) % 1000).astype(np.uint32)
    path = tmp_path / "tok.bin"
    ids.tofile(path)
    d = load_data(DataConfig(source="tokens", path=str(path), token_dtype="uint32", vocab_size=0), 16)
    assert d.vocab_size == 1000
    assert np.array_equal(np.concatenate([d.train, d.val]), ids)
