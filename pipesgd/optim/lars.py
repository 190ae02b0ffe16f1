"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg, 2017), the large-batch optimizer
behind "ImageNet training in minutes" (You et al., 2018).

Each parameter tensor (a "layer") gets its own learning rate from the ratio of its weight norm to
its gradient norm, so no layer's update is large relative to its weights however big the batch:

    local_lr = η · ||w|| / (||g|| + wd · ||w||)        (1 when ||w|| or ||g|| is 0)
    v ← m · v + lr · local_lr · (g + wd · w)
    w ← w − v

``lr`` is the global rate (scheduled: warm-up, polynomial decay), η the trust coefficient.
Biases and BatchNorm scales/shifts (every tensor with ndim <= 1) are excluded from the adaptation
and from weight decay and take plain momentum SGD steps at ``lr``, as in the authors' ImageNet
code and the MLPerf reference: their norms are tiny or meaningless as "layer" scales.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer


def _check(name: str, value: float, *, positive: bool = False, below_one: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and value == value
    ok = ok and (value > 0 if positive else value >= 0) and (value < 1 if below_one else True)
    if not ok:
        bound = "> 0" if positive else ("in [0, 1)" if below_one else ">= 0")
        raise ValueError(f"optimizer.{name}={value!r} is invalid: must be a number {bound}")


class LARS(Optimizer):
    """Momentum SGD with a per-tensor trust ratio; see the module docstring for the rule.

    ``exclude_1d=False`` adapts and decays every tensor (the 2017 paper's plain rule).
    Raises ValueError naming the option for ``trust_coefficient <= 0``, negative ``lr``,
    ``weight_decay`` or ``eps``, and ``momentum`` outside [0, 1).
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, eps: float = 0.0,
                 exclude_1d: bool = True):
        _check("lr", lr)
        _check("momentum", momentum, below_one=True)
        _check("weight_decay", weight_decay)
        _check("trust_coefficient", trust_coefficient, positive=True)
        _check("eps", eps)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, exclude_1d=exclude_1d))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, m, wd, eta, eps = (group[k] for k in ("lr", "momentum", "weight_decay", "trust_coefficient", "eps"))
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["exclude_1d"] and p.ndim <= 1:
                    d, scale = g, lr
                else:
                    w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
                    trust = eta * w_norm / (g_norm + wd * w_norm + eps)
                    # Two scalar tensors, no host sync: where() keeps the step graph-free and CUDA-friendly.
                    trust = torch.where((w_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust))
                    d, scale = g.add(p, alpha=wd) if wd else g, lr * trust
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(m).add_(d * scale)
                p.sub_(buf)
        return loss
