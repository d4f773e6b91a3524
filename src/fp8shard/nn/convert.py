"""``convert_to_fp8``: swap the ``torch.nn.Linear`` layers of a built model for FP8 ones.

By default the output head stays in high precision: a layer whose own name is one of
``DEFAULT_SKIP_NAMES`` ('lm_head', 'output', 'output_layer', 'head') is skipped, because
the logits are the most precision-sensitive GEMM of a language model and the layer is small
next to the blocks (Transformer Engine and NeMo keep it in BF16 too). Norms and embeddings
are not ``nn.Linear`` and are never touched. Pass ``module_filter`` to choose exactly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fp8shard.fp8.formats import Fp8Format
from fp8shard.fp8.tensor import Float8Tensor
from fp8shard.nn.linear import Linear

ModuleFilter = Callable[[str, torch.nn.Linear], bool]
"""``module_filter(fqn, module) -> True`` to convert the layer at dotted name ``fqn``."""

DEFAULT_SKIP_NAMES = frozenset({"lm_head", "output", "output_layer", "head"})


def default_module_filter(fqn: str, module: torch.nn.Linear) -> bool:
    """Convert every ``nn.Linear`` except the output head (see the module docstring)."""
    return fqn.rsplit(".", 1)[-1] not in DEFAULT_SKIP_NAMES


def convert_to_fp8(
    model: torch.nn.Module,
    module_filter: ModuleFilter | None = None,
    fp8_params: bool = False,
) -> torch.nn.Module:
    """Replace ``torch.nn.Linear`` layers (exactly that class) by ``fp8shard.nn.Linear`` in place.

    Values are kept: the new layer takes the old ``weight`` and ``bias`` parameters themselves
    (so an optimizer built before still sees them), or with ``fp8_params=True`` a ``Float8Tensor``
    E4M3 copy of the weight scaled from its amax. Subclasses of ``nn.Linear`` are left alone:
    they may not call ``forward`` (``nn.MultiheadAttention.out_proj``). Returns ``model``.
    """
    keep = module_filter if module_filter is not None else default_module_filter
    if type(model) is torch.nn.Linear:
        raise TypeError(
            "convert_to_fp8 swaps the children of a model and cannot replace the model object "
            "itself; wrap the layer, e.g. convert_to_fp8(torch.nn.Sequential(layer))[0]"
        )
    for fqn, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if type(child) is torch.nn.Linear and keep(child_fqn, child):
                setattr(parent, name, _to_fp8_linear(child, fp8_params))
    return model


def _to_fp8_linear(old: torch.nn.Linear, fp8_params: bool) -> Linear:
    # Built on meta so no memory or RNG is spent on values that are replaced right away.
    new = Linear(old.in_features, old.out_features, bias=old.bias is not None, device="meta",
                 dtype=old.weight.dtype)
    if fp8_params:
        fp8 = Float8Tensor.quantize(old.weight.detach(), Fp8Format.E4M3)
        new.weight = torch.nn.Parameter(fp8, requires_grad=old.weight.requires_grad)
    else:
        new.weight = old.weight
    new.bias = old.bias
    new.train(old.training)
    return new
