"""The pipelined DDP hook (pipesgd.hooks) on 2 Gloo ranks: DDP with ``pipelined(inner)`` follows the
width-2 update rule exactly, whatever DDP does with its buckets.

- default allreduce and fp16: the weights of ``PipeSGD(width=2)`` at every step (within 1e-6; they
  come out identical), on a model DDP splits into several buckets and re-buckets after the first
  step, with and without ``gradient_as_bucket_view`` and ``static_graph``, and with ``no_sync``;
  ``staleness="lookahead"`` as the engine's lookahead;
- PowerSGD: torch's ``powerSGD_hook`` applied one step late (two states, one per step in flight,
  called synchronously outside DDP on the same buckets), replicas identical at every step, also
  with a callback slowed down;
- a resume into a fresh DDP (a new bucket layout) continues exactly; GradScaler and Join;
- every refused option is refused naming it."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from distributed_utils import run_workers

STEPS = 8
LR, MOMENTUM = 0.05, 0.9


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _batch(rank: int, t: int):
    g = torch.Generator().manual_seed(10_000 * rank + t)
    return torch.randn(16, 10, generator=g), torch.randint(0, 3, (16,), generator=g)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _opt(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=1e-3)


def _loss(net, rank, t):
    x, y = _batch(rank, t)
    return nn.functional.cross_entropy(net(x), y)


def _hooked(rank, inner=None, inner_state=None, steps=range(STEPS), accumulate=1, ddp_options=None,
            state_options=None, model=None, resume=None, keep=None, lookahead=False):
    """Train DDP with the pipelined hook; the weights after every step and after the flush.
    ``accumulate``: micro-batches per step, all but the last under ``no_sync``. ``keep``: a dict
    that receives the checkpoint after the last step instead of flushing. ``lookahead``: the
    lookahead rule through the state's forward context."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd.hooks import register

    model = model or _model()
    opt = _opt(model)
    ddp = DDP(model, **({"bucket_cap_mb": 0.01} | (ddp_options or {})))  # 0.01 MiB: several buckets
    if lookahead:
        state_options = {"optimizer": opt, "staleness": "lookahead"} | (state_options or {})
    state = register(ddp, inner, inner_state, **(state_options or {}))
    if resume is not None:
        opt.load_state_dict(resume["opt"])
        state.load_state_dict(resume["hook"])
    out = []
    for t in steps:
        opt.zero_grad()
        for micro in range(accumulate):
            if micro < accumulate - 1:
                with ddp.no_sync():
                    _loss(ddp, rank, 100 * t + micro).backward()
            else:
                with state.forward_context():
                    _loss(ddp, rank, 100 * t + micro).backward()
        if state.ready():
            opt.step()
        out.append(_flat(model))
    if keep is not None:
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
        buf.seek(0)
        keep.update(torch.load(buf, weights_only=True))
        return out
    state.flush(opt)
    out.append(_flat(model))
    return out


def _fp16_as_ddp(tensor, compressor=None, group=None):
    """torch's ``fp16_compress_hook`` arithmetic as an allreduce for the engine: halve in fp16,
    then sum (pipesgd's ``native`` sums, then halves in fp32: a halved fp16 subnormal loses its
    last bit, 1e-6 apart after a few steps). The engine divides by p again; ``* p`` undoes it
    exactly (p = 2)."""
    import torch.distributed as dist

    from pipesgd.comm import CommStats

    p = dist.get_world_size(group)
    buf = tensor.to(torch.float16).div_(p)
    dist.all_reduce(buf, group=group)
    tensor.copy_(buf).mul_(p)
    return CommStats()


def _engine(rank, compressor="none", accumulate=1, staleness="none"):
    """The same steps with ``PipeSGD(width=2)`` (the backend's all_reduce, as DDP's)."""
    from pipesgd import PipeSGD

    model = _model()
    opt = _opt(model)
    engine = PipeSGD(opt, model.parameters(), width=2, compressor=compressor,
                     allreduce=_fp16_as_ddp if compressor == "fp16" else "native", staleness=staleness)
    out = []
    for t in range(STEPS):
        opt.zero_grad()
        for micro in range(accumulate):
            with engine.forward_context():
                _loss(model, rank, 100 * t + micro).backward()
        engine.step()
        out.append(_flat(model))
    engine.flush()
    engine.close()
    out.append(_flat(model))
    return out


@pytest.mark.timeout(300)
def test_pipelined_hook_follows_pipesgd_width_2_across_bucket_rebuild():
    results = run_workers(_trajectories, 2, timeout=280)
    for found in results:
        for key, (mine, ref) in found.items():
            for t, (a, b) in enumerate(zip(mine, ref)):
                assert (a - b).abs().max() <= 1e-6, f"{key}: step {t} differs from PipeSGD(width=2)"
            assert len(mine) == len(ref) == STEPS + 1
    sync = results[0]["allreduce", False, False][0]
    assert torch.equal(sync[0], _flat(_model())), "the first step applies nothing"
    for key in results[0]:
        assert torch.equal(results[0][key][0][-1], results[1][key][0][-1]), f"{key}: replicas differ"
    plain, ahead = results[0]["allreduce", False, False][0], results[0]["lookahead"][0]
    assert (plain[-1] - ahead[-1]).abs().max() > 1e-4, "lookahead must change the trajectory"


def _trajectories(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_hook

    found = {}
    for name, inner, comp in (("allreduce", allreduce_hook, "none"), ("fp16", fp16_compress_hook, "fp16")):
        ref = _engine(rank, comp)
        for view in (False, True):
            for static in (False, True):
                found[name, view, static] = (_hooked(rank, inner, ddp_options={
                    "gradient_as_bucket_view": view, "static_graph": static}), ref)
        found[name, "no_sync"] = (_hooked(rank, inner, accumulate=2), _engine(rank, comp, accumulate=2))
    found["lookahead"] = (_hooked(rank, lookahead=True), _engine(rank, staleness="lookahead"))
    return found


class _Spy:
    """An inner hook that records each call's parameter order (as indices into ``params``) and can
    slow down the result's arrival."""

    def __init__(self, inner, params, delay_s: float = 0.0):
        self.inner, self.delay_s, self.orders = inner, delay_s, []
        self._index = {id(p): i for i, p in enumerate(params)}

    def __call__(self, state, bucket):
        import time

        self.orders.append([self._index[id(p)] for p in bucket.parameters()])
        fut = self.inner(state, bucket)
        if not self.delay_s:
            return fut

        def slow(f):
            time.sleep(self.delay_s)  # a slow link: the result arrives late; nothing waits on this sleep
            return f.value()

        return fut.then(slow)


def _powersgd_template():
    from pipesgd.hooks import powersgd_state

    return powersgd_state(None, rank=2, start_iter=2, seed=3)


class _OneBucket:
    """What torch's hook reads of a GradBucket, for the reference (one bucket, as DDP's on Gloo)."""

    def __init__(self, params, flat):
        self._params, self._flat = params, flat

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return self._params

    def buffer(self):
        return self._flat

    def gradients(self):
        return [v.view_as(p) for p, v in zip(self._params, self._flat.split([p.numel() for p in self._params]))]


def _powersgd_reference(rank, orders, steps):
    """torch's ``powerSGD_hook`` applied one step late, without DDP: two states (one per step in
    flight, as the hook keeps), step t's gradient handed to ``state[t % 2]`` in the parameter order
    DDP's bucket had (``orders[t]``), waited for at once, and its result applied at step t+1."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    from pipesgd.hooks import powersgd_state

    model = _model()
    opt = _opt(model)
    params = list(model.parameters())
    states = [powersgd_state(None, like=_powersgd_template()) for _ in range(2)]
    out, pending = [], None

    def apply(pending):
        order, avg = pending
        for p, v in zip(order, avg.split([p.numel() for p in order])):
            p.grad = v.view_as(p).clone()
        opt.step()

    for t in range(steps):
        opt.zero_grad()
        _loss(model, rank, 100 * t).backward()
        order = [params[i] for i in orders[t]]
        flat = torch.cat([p.grad.reshape(-1) for p in order])
        avg = powerSGD_hook(states[t % 2], _OneBucket(order, flat)).wait().clone()
        if pending is not None:
            apply(pending)
        pending = (order, avg)
        out.append(_flat(model))
    apply(pending)
    out.append(_flat(model))
    return out


def _powersgd(rank, world, delay_s):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    model = _model()
    spy = _Spy(powerSGD_hook, list(model.parameters()), delay_s)
    one_bucket = {"bucket_cap_mb": 25}  # torch's hook waits inside its callbacks: one bucket on Gloo
    mine = _hooked(rank, spy, _powersgd_template(), steps=range(12), model=model, ddp_options=one_bucket)
    ref = _powersgd_reference(rank, spy.orders, 12)
    plain = _hooked(rank, steps=range(12), ddp_options=one_bucket)
    return mine, ref, plain, spy.orders


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_pipelined_powersgd_is_torchs_hook_one_step_late(delay_s):
    results = run_workers(_powersgd, 2, delay_s, timeout=280)
    for mine, ref, plain, orders in results:
        assert orders[0] != orders[-1], "DDP re-bucketed after the first step"
        for t, (a, b) in enumerate(zip(mine, ref)):
            assert (a - b).abs().max() <= 1e-6, f"step {t}: differs from torch's PowerSGD one step late"
        assert (mine[-1] - plain[-1]).abs().max() > 1e-4, "PowerSGD compressed from its third step on"
    for t, (a, b) in enumerate(zip(results[0][0], results[1][0])):
        assert torch.equal(a, b), f"step {t}: replicas differ"
