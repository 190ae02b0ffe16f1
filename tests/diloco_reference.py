"""The single-process reference of the period-H rules (PipeDiLoCo): p simulated replicas, each with
its own weights, inner optimizer, anchor and outer optimizer, and the outer step of the round
``width - 1`` rounds back applied under the rule ``none`` or ``eager`` (docs/period-h.md)."""

from collections import deque
from functools import partial

import torch

from engine_reference import LR, MOMENTUM, flat_params, loss_of, make_model

OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
INNER = partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM)


def diloco_reference(p: int, sync_every: int, width: int, steps: int, rule: str = "none",
                     outer=OUTER, inner=INNER) -> list[torch.Tensor]:
    """Every replica's final weights (after the flush) as flat tensors, one per replica."""
    models = [make_model() for _ in range(p)]
    inners = [inner(m.parameters()) for m in models]
    anchors = [[q.detach().clone() for q in m.parameters()] for m in models]
    outers = [outer(a) for a in anchors]
    own = [deque() for _ in range(p)]
    pending = deque()

    def outer_step(m, grad):
        for a, g in zip(anchors[m], grad):
            a.grad = g.clone()
        outers[m].step()

    def apply_oldest():
        late = pending.popleft()
        for m in range(p):
            prev = own[m].popleft()
            g = late
            if rule == "eager":
                fresh = own[m][-1] if own[m] else [torch.zeros_like(x) for x in prev]
                g = [lt - pv / p + fr / p for lt, pv, fr in zip(late, prev, fresh)]
            outer_step(m, g)

    def end_round():
        deltas = [[a - q.detach() for a, q in zip(anchors[m], models[m].parameters())] for m in range(p)]
        pending.append([sum(ds) / p for ds in zip(*deltas)])
        for m in range(p):
            own[m].append(deltas[m])
        if len(pending) == width:
            apply_oldest()
        elif rule == "eager":  # the fill: a zero late average
            for m in range(p):
                outer_step(m, [d / p for d in own[m][-1]])
        with torch.no_grad():
            for m in range(p):
                for a, q in zip(anchors[m], models[m].parameters()):
                    q.copy_(a)

    in_round = 0
    for t in range(steps):
        for m in range(p):
            inners[m].zero_grad()
            loss_of(models[m], m, t).backward()
            inners[m].step()
        in_round += 1
        if in_round == sync_every:
            in_round = 0
            end_round()
    if in_round:
        end_round()
    while pending:
        apply_oldest()
    with torch.no_grad():
        for m in range(p):
            for a, q in zip(anchors[m], models[m].parameters()):
                q.copy_(a)
    return [flat_params(m) for m in models]
