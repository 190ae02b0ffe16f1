"""The single-process reference of the period-H rules (PipeDiLoCo): p simulated replicas, each with
its own weights, inner optimizer, anchor and outer optimizer, and the outer step of the round
``width - 1`` rounds back applied under its rule (docs/period-h.md); with a
``delay`` τ, the round's own average applied τ steps after its launch with the steps trained since
kept on top (``none``: the weights train on from where the round ended; ``eager``: from the anchor
with the own part applied, moved by what the rest moves it)."""

from collections import deque
from functools import partial

import torch

from engine_reference import LR, MOMENTUM, flat_params, loss_of, make_model

OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
INNER = partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM)


def diloco_reference(p: int, sync_every: int, width: int, steps: int, rule: str = "none",
                     outer=OUTER, inner=INNER, fragments: list | None = None,
                     delay: int = 0, warmup: int = 0, alpha: float | None = None,
                     damping: float = 1.0) -> list[torch.Tensor]:
    """Every replica's final weights (after the flush) as flat tensors, one per replica.
    ``fragments``: how many parameter tensors each fragment takes, in order (None: one fragment), or
    each fragment's tensor indices (a strided layout);
    fragment f's rounds end at the steps ≡ (f+1)·H/F (mod H). ``delay`` (width 2): a round's average
    lands ``delay`` steps after its launch (0: at the next round's end). ``warmup``: that many
    synchronous steps first (each step's gradient averaged over the replicas), the rounds counted
    from the end of it, their anchors the weights it left. ``alpha`` (with ``delay``): at a landing
    the weights become α·weights + (1 − α)·anchor instead of keeping the steps since the launch.
    Rules: ``none``, ``eager``, ``delayed_nesterov`` (eager with the momentum fed the late average
    alone, the own terms a plain step) and ``damped`` (the late average / (1 + ``damping``·lateness))."""
    models = [make_model() for _ in range(p)]
    inners = [inner(m.parameters()) for m in models]
    if fragments and isinstance(fragments[0], list):  # the tensors' indices of each fragment (strided)
        members = fragments
    else:
        sizes = fragments or [len(list(models[0].parameters()))]
        members = [list(range(sum(sizes[:f]), sum(sizes[:f + 1]))) for f in range(len(sizes))]
    sizes = members
    frag_params = [[[list(m.parameters())[i] for i in idx] for idx in members] for m in models]
    anchors = [[[q.detach().clone() for q in fp] for fp in frag_params[m]] for m in range(p)]
    outers = [[outer(a) for a in anchors[m]] for m in range(p)]
    own = [[deque() for _ in sizes] for _ in range(p)]
    pending = [deque() for _ in sizes]
    offsets = [(f + 1) * sync_every // len(sizes) for f in range(len(sizes))]
    launched = [[None for _ in sizes] for _ in range(p)]  # delay under none: the weights at the launch

    def outer_step(m, f, grad):
        for a, g in zip(anchors[m][f], grad):
            a.grad = g.clone()
        outers[m][f].step()

    own_terms = rule in ("eager", "delayed_nesterov")  # each replica applies a term of its own
    lateness = delay / sync_every if delay else width - 1

    def plain_step(m, f, terms):
        """delayed_nesterov's own part: a plain step of the outer rate, outside the momentum."""
        lr = outers[m][f].param_groups[0]["lr"]
        with torch.no_grad():
            for a, t in zip(anchors[m][f], terms):
                a.sub_(t, alpha=lr / p)

    def apply_oldest(f):
        late = pending[f].popleft()
        for m in range(p):
            prev = own[m][f].popleft()
            g = late
            fresh = own[m][f][-1] if own[m][f] else [torch.zeros_like(x) for x in prev]
            if rule == "eager":
                g = [lt - pv / p + fr / p for lt, pv, fr in zip(late, prev, fresh)]
            if rule == "damped":
                g = [lt / (1 + damping * lateness) for lt in late]
            outer_step(m, f, g)
            if rule == "delayed_nesterov":
                plain_step(m, f, [fr - pv for fr, pv in zip(fresh, prev)])

    def restart(f):
        with torch.no_grad():
            for m in range(p):
                launched[m][f] = None
                for a, q in zip(anchors[m][f], frag_params[m][f]):
                    q.copy_(a)

    def end_round(f):
        deltas = [[a - q.detach() for a, q in zip(anchors[m][f], frag_params[m][f])] for m in range(p)]
        pending[f].append([sum(ds) / p for ds in zip(*deltas)])
        for m in range(p):
            own[m][f].append(deltas[m])
        if len(pending[f]) == width:
            apply_oldest(f)
        elif rule == "eager":  # the fill: a zero late average
            for m in range(p):
                outer_step(m, f, [d / p for d in own[m][f][-1]])
        elif rule == "delayed_nesterov":
            for m in range(p):
                outer_step(m, f, [torch.zeros_like(d) for d in own[m][f][-1]])
                plain_step(m, f, own[m][f][-1])
        if delay and not own_terms and len(pending[f]) == 1:  # train on from here until it lands
            for m in range(p):
                launched[m][f] = [q.detach().clone() for q in frag_params[m][f]]
        else:
            restart(f)

    def land(f):
        before = [launched[m][f] or [a.detach().clone() for a in anchors[m][f]] for m in range(p)]
        apply_oldest(f)
        with torch.no_grad():
            for m in range(p):
                launched[m][f] = None
                for a, b, q in zip(anchors[m][f], before[m], frag_params[m][f]):
                    if alpha is None:
                        q.add_(a - b)
                    else:
                        q.mul_(alpha).add_(a, alpha=1 - alpha)

    def anchors_from_weights():
        with torch.no_grad():
            for m in range(p):
                for f in range(len(sizes)):
                    for a, q in zip(anchors[m][f], frag_params[m][f]):
                        a.copy_(q)

    for t in range(steps):
        for m in range(p):
            inners[m].zero_grad()
            loss_of(models[m], m, t).backward()
        if t < warmup:  # synchronous: every replica steps with the average
            grads = [[q.grad.clone() for q in models[m].parameters()] for m in range(p)]
            for m in range(p):
                for q, *gs in zip(models[m].parameters(), *grads):
                    q.grad.copy_(sum(gs) / p)
        for m in range(p):
            inners[m].step()
        if t + 1 == warmup:
            anchors_from_weights()
        if t < warmup:
            continue
        clock = t + 1 - warmup
        for f, offset in enumerate(offsets):
            if delay and pending[f] and (clock - offset) % sync_every == delay:
                land(f)
        for f, offset in enumerate(offsets):
            if (clock - offset) % sync_every == 0:
                end_round(f)
    if steps <= warmup:
        anchors_from_weights()
        return [flat_params(m) for m in models]
    for f in range(len(sizes)):
        if delay and pending[f]:
            land(f)
    for f, offset in enumerate(offsets):
        if (steps - warmup - offset) % sync_every:
            end_round(f)
    for f in range(len(sizes)):
        while pending[f]:
            apply_oldest(f)
        restart(f)
    return [flat_params(m) for m in models]
