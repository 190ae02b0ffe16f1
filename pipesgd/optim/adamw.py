"""AdamW (Loshchilov & Hutter, 2019) with decoupled weight decay on the weight matrices only.

``torch.optim.AdamW`` decays every parameter it is given; a transformer's biases and LayerNorm
gains (every tensor with ndim <= 1) are not weights to shrink, so, as GPT-2 and nanoGPT do, they
go into a second parameter group with ``weight_decay=0``. Both groups share the lr (and so the
schedule). The decay is decoupled: ``w <- w - lr * (adam_step + weight_decay * w)``, not added to
the gradient, so it is the same whatever the gradient's staleness.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor


def adamw(params: Iterable[Tensor], lr: float = 1e-3, betas: Sequence[float] = (0.9, 0.95), eps: float = 1e-8,
          weight_decay: float = 0.1, exclude_1d: bool = True) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``params``, with ``exclude_1d`` biases and norm gains undecayed
    (first group: decayed; second: not, present only when it has parameters)."""
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or weight_decay < 0:
        raise ValueError(f"optimizer.weight_decay={weight_decay!r} is invalid: must be a number >= 0")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"optimizer.betas={list(betas)!r} is invalid: must be two numbers in [0, 1)")
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2 or not exclude_1d]
    rest = [p for p in params if p.dim() < 2 and exclude_1d]
    groups = [{"params": decay, "weight_decay": float(weight_decay)}]
    if rest:
        groups.append({"params": rest, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
