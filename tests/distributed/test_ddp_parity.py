"""What DDP guards and the library engine must guard too, so a DDP script ports without losing a
guard, on 2 Gloo ranks: unused parameters, ranks that disagree about them, uneven inputs (join),
BatchNorm buffers kept as DDP keeps them, the public replica check, and an optimizer resumed
without the engine's state."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_utils import run_workers
from pipesgd import PipeSGD, ReductionError
from pipesgd.reliability.replicas import ReplicaMismatch


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 3)
        self.unused = nn.Linear(4, 3)

    def forward(self, x, both: bool = False):
        return self.used(x) + (self.unused(x) if both else 0)


def _batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def _unused_worker(rank, p, find_unused, disagree):
    model = WithUnused()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    engine = PipeSGD(opt, model.parameters(), width=2, module=model, find_unused_parameters=find_unused,
                     timeout_s=30)
    before = _flat(model.unused.parameters())
    try:
        for i in range(20):
            x, y = _batch(rank, i)
            opt.zero_grad(set_to_none=True)
            ((model(x, both=disagree and rank == 0) - y) ** 2).mean().backward()
            engine.step()
        engine.flush()
    except (RuntimeError, ReductionError) as e:
        return type(e).__name__, str(e)
    finally:
        engine.close()
    return before, _flat(model.unused.parameters()), _flat(model.used.parameters())


@pytest.mark.timeout(120)
def test_parameters_without_a_gradient_on_every_rank_are_left_alone():
    results = run_workers(_unused_worker, 2, True, False)
    for before, unused, used in results:
        assert torch.equal(before, unused), "no momentum, no weight decay: as plain torch"
    assert torch.equal(results[0][2], results[1][2])


@pytest.mark.timeout(120)
def test_a_parameter_without_a_gradient_is_an_error_by_default_naming_it():
    for kind, message in run_workers(_unused_worker, 2, False, False):
        assert kind == "RuntimeError"
        assert "unused.weight, unused.bias got no gradient" in message and "find_unused_parameters=True" in message


@pytest.mark.timeout(120)
def test_ranks_that_disagree_about_unused_parameters_get_an_error_naming_them():
    for kind, message in run_workers(_unused_worker, 2, True, True):
        assert kind == "ReductionError"
        assert "ranks disagree" in message and "unused.weight, unused.bias" in message


def _join_worker(rank, p, use_join):
    """Rank 0 has 5 batches, rank 1 has 8. With join, rank 0 shadows rank 1's last 3 steps; without
    it, rank 0 steps 3 times more with zero gradients: the same arithmetic, by hand."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PipeSGD(opt, model.parameters(), width=2, timeout_s=30)
    mine = 5 if rank == 0 else 8

    def train(n: int) -> None:
        for i in range(n):
            x, y = _batch(rank, i)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            engine.step()

    if use_join:
        with engine.join():
            train(mine)
    else:
        train(mine)
        for _ in range(8 - mine):
            for q in model.parameters():
                q.grad = torch.zeros_like(q)
            engine.step()
    engine.flush()
    total = torch.tensor([1.0])
    dist.all_reduce(total)  # the evaluation collective that hung without join
    engine.close()
    return _flat(model.parameters()), engine.shadowed, engine.steps


@pytest.mark.timeout(120)
def test_join_lets_a_rank_with_fewer_batches_shadow_the_others():
    (w0, shadowed0, steps0), (w1, shadowed1, steps1) = run_workers(_join_worker, 2, True)
    assert (shadowed0, shadowed1) == (3, 0) and steps0 == steps1 == 8
    assert torch.equal(w0, w1)
    by_hand, _, _ = run_workers(_join_worker, 2, False)[0]
    assert torch.equal(w0, by_hand), "join = zero gradients from the rank that ran out"


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))


def _buffers_worker(rank, p, broadcast):
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=1, module=model, broadcast_buffers=broadcast)
    ref = _bn_model()
    ddp = nn.parallel.DistributedDataParallel(ref, broadcast_buffers=broadcast)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(6):
        x, y = _batch(rank, i)
        for m, o, step in ((model, opt, engine.step), (ddp, ref_opt, ref_opt.step)):
            o.zero_grad()
            ((m(x) - y) ** 2).mean().backward()
            step()
    engine.flush()
    engine.close()
    return _flat(model.parameters()), _flat(model.buffers()), _flat(ref.parameters()), _flat(ref.buffers())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_follow_the_first_rank_before_every_forward_as_under_ddp(broadcast):
    """DDP broadcasts before each forward, the engine in each step: the same buffers at every
    forward, so the same weights; after the last step every rank holds the first rank's buffers,
    which DDP would broadcast at the next forward."""
    (params0, buffers0, ddp_params0, ddp_buffers0), (params1, buffers1, _, ddp_buffers1) = \
        run_workers(_buffers_worker, 2, broadcast)
    assert torch.equal(params0, params1)
    assert torch.allclose(params0, ddp_params0, rtol=0, atol=1e-6), "width 1 with BatchNorm trains as DDP"
    assert torch.allclose(buffers0, ddp_buffers0, rtol=0, atol=1e-6)
    assert not torch.equal(ddp_buffers0, ddp_buffers1), "the last forward's own batch statistics differ per rank"
    assert torch.allclose(buffers1, ddp_buffers0 if broadcast else ddp_buffers1, rtol=0, atol=1e-6)


def _replicas_worker(rank, p):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=2, timeout_s=30)
    for i in range(3):
        x, y = _batch(rank, i)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        engine.step()
    engine.check_replicas()  # in flight: fine, it runs after them
    if rank == 1:
        with torch.no_grad():
            model.weight[0, 0] += 1e-3
    try:
        engine.check_replicas()
    except ReplicaMismatch as e:
        return str(e)
    finally:
        engine.flush()
        engine.close()
    return None


@pytest.mark.timeout(120)
def test_check_replicas_is_public_and_raises_on_every_rank():
    m0, m1 = run_workers(_replicas_worker, 2)
    assert m0 == m1 and m0 is not None and "replicas diverged at step 3" in m0


def _resume_worker(rank, p, with_engine_state):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine = PipeSGD(opt, model.parameters(), width=2)
    for i in range(3):
        x, y = _batch(rank, i)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        engine.step()
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}
    engine.flush()
    engine.close()
    model2 = nn.Linear(4, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    engine2 = PipeSGD(opt2, model2.parameters(), width=2)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    if with_engine_state:
        engine2.load_state_dict(saved["engine"])
    x, y = _batch(rank, 3)
    ((model2(x) - y) ** 2).mean().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine2.step()
    engine2.flush()
    engine2.close()
    return [str(w.message) for w in caught if "engine.load_state_dict() was not" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("with_engine_state", [True, False])
def test_resuming_the_optimizer_without_the_engine_state_warns(with_engine_state):
    for caught in run_workers(_resume_worker, 2, with_engine_state):
        assert len(caught) == (0 if with_engine_state else 1)
        assert all("1 in-flight update(s)" in m for m in caught)


def _accumulation_worker(rank, p):
    """One engine.step() per 3 micro-batches against DDP's no_sync() on the first two."""
    torch.manual_seed(0)
    model, ref = nn.Linear(4, 3), nn.Linear(4, 3)
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    engine = PipeSGD(opt, model.parameters(), width=1)
    ddp = nn.parallel.DistributedDataParallel(ref)
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(3):
            x, y = _batch(rank, 3 * step + micro)
            ((model(x) - y) ** 2).mean().backward()
            if micro < 2:
                with ddp.no_sync():
                    ((ddp(x) - y) ** 2).mean().backward()
            else:
                ((ddp(x) - y) ** 2).mean().backward()
        engine.step()
        ref_opt.step()
    engine.close()
    return _flat(model.parameters()), _flat(ref.parameters())


@pytest.mark.timeout(120)
def test_gradient_accumulation_equals_ddp_no_sync():
    for mine, ddp in run_workers(_accumulation_worker, 2):
        assert torch.allclose(mine, ddp, rtol=0, atol=1e-7), (mine - ddp).abs().max()
