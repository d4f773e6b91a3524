"""Random-number-generator states as tensors, so they travel in the checkpoint as data.

Each rank saves its own (``rng/<rank>/<generator>``): with dropout, ranks draw different
streams. They restore only at the same world size and rank; at another world size the streams
cannot continue the old ones anyway, and the caller reseeds (the training command derives
seeds from (seed, step, rank)).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from fp8shard.checkpoint.state import RNG


def rng_key(rank: int, name: str) -> str:
    return f"{RNG}{rank}/{name}"


def capture_rng(rank: int) -> dict[str, torch.Tensor]:
    """This process's torch (CPU and current CUDA device), Python and NumPy RNG states."""
    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    assert np_name == "MT19937" and version == 3
    out = {
        "torch_cpu": torch.get_rng_state(),
        "python_mt": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "numpy_mt": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos_gauss": torch.tensor([np_pos, np_has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_gauss], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return {rng_key(rank, k): v for k, v in out.items()}


def restore_rng(rank: int, states: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`capture_rng` (keys of ``rank``)."""
    s = {k.removeprefix(rng_key(rank, "")): v for k, v in states.items() if k.startswith(rng_key(rank, ""))}
    torch.set_rng_state(s["torch_cpu"])
    gauss = float(s["python_gauss"][0])
    random.setstate((3, tuple(int(x) for x in s["python_mt"]), None if gauss != gauss else gauss))
    pos, has_gauss = (int(x) for x in s["numpy_pos_gauss"])
    np.random.set_state(("MT19937", s["numpy_mt"].numpy().astype(np.uint32), pos, has_gauss,
                         float(s["numpy_gauss"][0])))
    if "torch_cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["torch_cuda"])
