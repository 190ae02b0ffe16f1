"""The single-process reference the engine tests compare against: a small model, per-rank batches,
and the width-K update rule simulated for p ranks in one process."""

import torch
from torch import nn


STEPS = 20
LR, MOMENTUM = 0.05, 0.9


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def batch(rank: int, step: int):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def loss_of(model, rank, step):
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def reference(p: int, width: int, steps: int = STEPS, warmup_sync_steps: int = 0,
              skip_step: int | None = None, max_grad_norm: float | None = None) -> torch.Tensor:
    """One process, p simulated ranks: the update at step t applies the rank-average of the
    gradients computed at step t-width+1 (at t-0 during the first warmup_sync_steps); a final
    flush applies the rest in order. The update with step ``skip_step``'s gradient is dropped;
    ``max_grad_norm`` clips each applied average."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    queue = []

    def apply(entry):
        t, avg = entry
        if t == skip_step:
            return
        for prm, g in zip(model.parameters(), avg):
            prm.grad = g.clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()

    for t in range(steps):
        grads = []
        for r in range(p):
            model.zero_grad()
            loss_of(model, r, t).backward()
            grads.append([prm.grad.clone() for prm in model.parameters()])
        queue.append((t, [sum(gs) / p for gs in zip(*grads)]))
        if len(queue) == (1 if t < warmup_sync_steps else width):
            apply(queue.pop(0))
    while queue:
        apply(queue.pop(0))
    return flat_params(model)
