"""Optimizer bookkeeping shared by layer migration and the dynamics callbacks.

These edit an optimizer in place (never rebuild it), so LR schedulers and Lightning's optimizer wrappers keep
pointing at the same object.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def drop_params(params: Iterable[nn.Parameter], optimizers: Sequence[Optimizer]) -> None:
    """Remove ``params`` from every optimizer's parameter groups, together with their state."""
    ids = {id(p) for p in params}
    for opt in optimizers:
        for group in opt.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in ids]
        for p in [p for p in opt.state if id(p) in ids]:
            del opt.state[p]


def index_select_(param: nn.Parameter, dim: int, index: Tensor, optimizers: Sequence[Optimizer]) -> None:
    """Keep only ``index`` along ``dim`` of ``param`` and of its optimizer state, in place.

    The parameter object stays the same (its ``.data`` shrinks), so optimizers and schedulers keep referring to it;
    every optimizer-state tensor shaped like the parameter (Adam's moments, ...) is sliced the same way, scalars
    (step counts) are kept.
    """
    old_shape = param.shape
    index = index.to(param.device)
    with torch.no_grad():
        param.data = param.data.index_select(dim, index).contiguous()
    param.grad = None
    for opt in optimizers:
        state = opt.state.get(param)
        if not state:
            continue
        for key, value in state.items():
            if isinstance(value, Tensor) and value.shape == old_shape:
                state[key] = value.index_select(dim, index.to(value.device)).contiguous()
