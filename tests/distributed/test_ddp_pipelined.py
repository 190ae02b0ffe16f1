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
- ``find_unused_parameters=True``: with a fixed set of parameters that get gradients, the run of
  ``find_unused_parameters=False`` (bit for bit) and ``PipeSGD(width=2)`` (a never-used layer left
  alone, as the engine's ``find_unused_parameters=True`` does); a set that changes is refused at
  that step, naming the parameters;
- a loop that steps the optimizer at the first step (``if state.ready()`` forgotten) is told, once;
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


def _engine(rank, compressor="none", accumulate=1, staleness="none", model=None, find_unused=False):
    """The same steps with ``PipeSGD(width=2)`` (the backend's all_reduce, as DDP's); ``find_unused``:
    its ``find_unused_parameters=True``, a parameter without a gradient on every rank left alone."""
    from pipesgd import PipeSGD

    model = model or _model()
    opt = _opt(model)
    engine = PipeSGD(opt, model.parameters(), width=2, compressor=compressor,
                     allreduce=_fp16_as_ddp if compressor == "fp16" else "native", staleness=staleness,
                     module=model if find_unused else None, find_unused_parameters=find_unused)
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


def _resume(rank, world, powersgd):
    """Straight through, and saved after half the steps then resumed into a fresh DDP (whose first
    step buckets in model order, then re-buckets): the same weights."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

    steps = 12  # saved after 6: both PowerSGD slots have compressed (from their third step), so the
    # random start of their factors, drawn in the bucket's order at the first compressed step, is saved too
    options = ({"inner": powerSGD_hook, "inner_state": _powersgd_template(), "ddp_options": {"bucket_cap_mb": 25}}
               if powersgd else {})
    straight = _hooked(rank, steps=range(steps), **options)
    saved: dict = {}
    _hooked(rank, steps=range(steps // 2), keep=saved, **options)
    model = _model()
    model.load_state_dict(saved["model"])
    resumed = _hooked(rank, steps=range(steps // 2, steps), model=model, resume=saved, **options)
    lost = {k: v for k, v in saved.items() if k != "hook"}
    model = _model()
    model.load_state_dict(saved["model"])
    without = _hooked(rank, steps=range(steps // 2, steps), model=model,
                      resume=lost | {"hook": saved["hook"] | {"pending": {}}}, **options)
    return straight[steps // 2:], resumed, without, sorted(saved["hook"]["pending"][0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("powersgd", [False, True])
def test_a_resume_continues_as_if_uninterrupted(powersgd):
    for straight, resumed, without, names in run_workers(_resume, 2, powersgd, timeout=280):
        assert names == sorted(n for n, _ in _model().named_parameters()), "in-flight averages by name"
        for t, (a, b) in enumerate(zip(straight, resumed)):
            if powersgd:
                assert (a - b).abs().max() <= 1e-6, f"step {t} after the resume differs"
            else:
                assert torch.equal(a, b), f"step {t} after the resume differs"
        assert (straight[-1] - without[-1]).abs().max() > 1e-5, "without the in-flight averages the run differs"


def _scaler_and_join(rank, world):
    """A GradScaler whose scale grows every step against none (the scale is a power of two: the
    same weights), and Join with uneven inputs (rank 0: 5 batches, rank 1: 8)."""
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd.hooks import register

    def run(scaled: bool):
        model = _model()
        opt = _opt(model)
        ddp = DDP(model, bucket_cap_mb=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=1, enabled=scaled)
        state = register(ddp, scaler=scaler if scaled else None)
        for t in range(STEPS):
            opt.zero_grad()
            scaler.scale(_loss(ddp, rank, t)).backward()
            if state.ready():
                scaler.step(opt)
                scaler.update()
        state.flush(opt)
        return _flat(model), scaler.get_scale()

    scaled, scale = run(True)
    plain, _ = run(False)
    model = _model()
    opt = _opt(model)
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = register(ddp)
    with Join([ddp]):
        for t in range(5 if rank == 0 else 8):
            opt.zero_grad()
            _loss(ddp, rank, t).backward()
            if state.ready():
                opt.step()
    state.flush(opt)
    return scaled, plain, scale, _flat(model)


@pytest.mark.timeout(200)
def test_gradscaler_and_join():
    results = run_workers(_scaler_and_join, 2, timeout=180)
    for scaled, plain, scale, _ in results:
        assert scale > 4.0, "the scale changed between launch and use"
        assert torch.equal(scaled, plain), "each average is rescaled from the scale its step launched with"
    assert torch.equal(results[0][3], results[1][3]), "after Join and the flush every replica agrees"


def _refusals(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import batched_powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd.hooks import PipelinedState, pipelined, register

    def error(fn) -> str:
        try:
            fn()
        except (TypeError, ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "accepted"

    model = _model()
    found = {
        "inner": error(lambda: pipelined(5)),
        "inner_state": error(lambda: register(DDP(_model()), inner_state=object())),
        "staleness": error(lambda: register(DDP(_model()), staleness="dc", optimizer=_opt(model))),
        "optimizer": error(lambda: register(DDP(_model()), staleness="lookahead")),
    }
    ddp = DDP(_model(), bucket_cap_mb=25)
    ddp.register_comm_hook(None, pipelined())
    found["state"] = error(lambda: _loss(ddp, rank, 0).backward())
    ddp = DDP(_model(), bucket_cap_mb=25)
    register(ddp, batched_powerSGD_hook, _powersgd_template())
    found["batched"] = error(lambda: [_loss(ddp, rank, t).backward() for t in range(4)])
    static = DDP(_model(), find_unused_parameters=True, static_graph=True)
    found["static_graph"] = error(lambda: PipelinedState(static))
    return found


@pytest.mark.timeout(200)
def test_every_refused_option_is_refused_naming_it():
    for found in run_workers(_refusals, 2, timeout=180):
        assert "pipelined(inner): inner must be a DDP comm hook" in found["inner"]
        assert "inner_state=object cannot be shared" in found["inner_state"]
        assert "staleness='dc' is not available" in found["staleness"]
        assert "staleness='lookahead' needs optimizer=" in found["optimizer"]
        assert "must be a PipelinedState" in found["state"]
        assert "batched_powerSGD_hook" in found["batched"]
        assert found["static_graph"] == "accepted", "a fixed set of unused parameters is fine"


class _Gated(nn.Module):
    """``_model()`` beside a layer ``extra`` that a step uses only where ``use_extra(t)`` says."""

    def __init__(self, use_extra=lambda t: False):
        super().__init__()
        self.body = _model()
        torch.manual_seed(1)
        self.extra = nn.Linear(10, 3)
        self.use_extra, self.t = use_extra, 0

    def forward(self, x):
        out = self.body(x)
        if self.use_extra(self.t):
            out = out + self.extra(x)
        self.t += 1
        return out


def _find_unused(rank, world):
    unused = {"find_unused_parameters": True}
    found = {"all used": (_hooked(rank, ddp_options=unused), _hooked(rank), _engine(rank)),
             "one never used": (_hooked(rank, model=_Gated(), ddp_options=unused),
                                _engine(rank, model=_Gated(), find_unused=True))}
    saved: dict = {}  # saved after half the steps, resumed into a fresh DDP: the same weights
    _hooked(rank, steps=range(STEPS // 2), model=_Gated(), ddp_options=unused, keep=saved)
    model = _Gated()
    model.load_state_dict(saved["model"])
    found["resumed"] = (_hooked(rank, steps=range(STEPS // 2, STEPS), model=model, resume=saved, ddp_options=unused),
                        saved["hook"]["pending_used"][0])

    def changing(ask_ready: bool):
        """``extra`` used from step 3 on; ``ask_ready``: the loop asks ready(), else it always steps."""
        from torch.nn.parallel import DistributedDataParallel as DDP

        from pipesgd.hooks import register

        model = _Gated(lambda t: t >= 3)
        opt = _opt(model)
        ddp = DDP(model, bucket_cap_mb=0.01, **unused)
        state = register(ddp)
        done = []
        try:
            for t in range(STEPS):
                opt.zero_grad()
                _loss(ddp, rank, t).backward()
                if not ask_ready or state.ready():
                    opt.step()
                done.append(t)
        except RuntimeError as e:
            return done, str(e)
        return done, "accepted"

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loop that always steps is told so at its first step
        found["changing, ready()"], found["changing, no ready()"] = changing(True), changing(False)
    return found


@pytest.mark.timeout(200)
def test_find_unused_parameters_with_a_fixed_set_and_a_changing_set_refused():
    initial = _flat(_Gated())
    for found in run_workers(_find_unused, 2, timeout=180):
        found_unused, plain, engine = found["all used"]
        assert len(found_unused) == len(plain) == STEPS + 1
        for t, (a, b, c) in enumerate(zip(found_unused, plain, engine)):
            assert torch.equal(a, b), f"step {t}: find_unused_parameters=True differs from False"
            assert (a - c).abs().max() <= 1e-6, f"step {t}: differs from PipeSGD(width=2)"
        mine, ref = found["one never used"]
        for t, (a, b) in enumerate(zip(mine, ref)):
            assert (a - b).abs().max() <= 1e-6, f"step {t}: differs from PipeSGD(width=2, find_unused_parameters=True)"
        resumed, pending_used = found["resumed"]
        assert pending_used == sorted(f"body.{k}" for k, _ in _model().named_parameters()), "saved with its used set"
        for t, (a, b) in enumerate(zip(mine[STEPS // 2:], resumed)):
            assert torch.equal(a, b), f"step {t} after the resume differs"
        n = _model_numel()
        assert torch.equal(mine[-1][n:], initial[n:]), "the never-used layer is left alone (no momentum, no decay)"
        assert (mine[-1][:n] - initial[:n]).abs().max() > 1e-3, "the rest trained"
        done, message = found["changing, ready()"]
        assert done == [0, 1, 2], "refused at the step whose set changed, before its optimizer step"
        assert "step 3: the parameters that get gradients changed from the step before" in message, message
        assert "now with a gradient: extra.bias, extra.weight" in message, message
        done, message = found["changing, no ready()"]
        assert done == [0, 1, 2, 3], "a loop that never asks ready() is refused at the next backward"
        assert "step 3: the parameters that get gradients changed" in message and "extra.weight" in message, message


def _model_numel() -> int:
    return sum(p.numel() for p in _model().parameters())


def _first_step(rank, world):
    """SGD with momentum and weight decay: a loop that always steps (``if state.ready()``
    forgotten), one that asks, and one step then flush."""
    import warnings

    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd.hooks import register

    def run(steps: int, ask_ready: bool):
        model = _model()
        opt = _opt(model)
        ddp = DDP(model, bucket_cap_mb=0.01)
        state = register(ddp)
        weights = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(steps):
                opt.zero_grad()
                _loss(ddp, rank, t).backward()
                if not ask_ready or state.ready():
                    opt.step()
                weights.append(_flat(model))
            state.flush(opt)
        return [str(w.message) for w in caught], weights

    return run(4, ask_ready=False), run(4, ask_ready=True), run(1, ask_ready=True)


@pytest.mark.timeout(200)
def test_stepping_the_optimizer_at_the_first_step_is_told_once():
    for forgot, asked, one in run_workers(_first_step, 2, timeout=180):
        messages, weights = forgot
        assert len(messages) == 1, messages
        assert "state.ready()" in messages[0] and "first step" in messages[0], messages
        assert not torch.equal(weights[0], _flat(_model())), "the zeros moved the weights: hence the warning"
        assert asked[0] == [] and one[0] == [], "a loop that asks ready(), and the flush, are not warned"
        assert torch.equal(asked[1][0], _flat(_model())), "asked, the first step applies nothing"


WARN_SCRIPT = """
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from pipesgd.hooks import PipelinedState, pipelined
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
model = DDP(nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
state = PipelinedState(model, width=3)
model.register_comm_hook(state, pipelined())
for _ in range(4):
    opt.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    if state.ready():
        opt.step()
{end}
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("end,warned", [("", True), ("state.flush(opt)", False)])
def test_a_hook_that_ends_with_steps_in_flight_warns(end, warned):
    """The schedule's unapplied-work warning, which only PipeSGD gave before it was shared: at
    width 3, two steps' averages are in flight after the last backward."""
    import os
    import subprocess
    import sys

    from distributed_utils import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    r = subprocess.run([sys.executable, "-c", WARN_SCRIPT.format(port=free_port(), end=end)], capture_output=True,
                       text=True, env=env, timeout=100)
    assert r.returncode == 0, r.stderr[-2000:]
    message = ("a PipelinedState (the pipelined DDP hook) ended with 2 update(s) in flight that were never applied: "
               "call state.flush(optimizer)")
    assert (message in r.stderr) == warned, r.stderr[-2000:]
