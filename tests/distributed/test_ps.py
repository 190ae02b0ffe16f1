"""Parameter-server modes: ps_sync against synchronous allreduce SGD (same init, data, lr), ps_async
invariants and MNIST convergence, the five-mode multirun, and bad input."""


import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_workers
from pipesgd import PipeSGD
from pipesgd.compress import get_compressor
from pipesgd.engine import ParameterServerEngine
from engine_reference import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model, reference


def _run(rank, engine_of, steps=STEPS):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine = engine_of(opt, model)
    for t in range(steps):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        stats = engine.step()
        assert stats.applied
    engine.flush()
    engine.close()
    return flat_params(model), engine


def _sync_worker(rank, p, compressor):
    group = dist.new_group(list(range(p)))
    ps, engine = _run(rank, lambda opt, m: ParameterServerEngine(opt, get_compressor(compressor), group))
    ring, _ = _run(rank, lambda opt, m: PipeSGD(opt, m.parameters(), width=1, compressor=compressor))
    return ps, ring, engine.last.comm.ratio


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p", [2, 3])
def test_ps_sync_equals_sync_allreduce(p):
    expected = reference(p, 1)
    results = run_workers(_sync_worker, p, "none")
    for ps, ring, _ in results:
        assert (ps - ring).abs().max() <= 1e-5
        assert (ps - expected).abs().max() <= 1e-5
        assert torch.equal(ps, results[0][0]), "replicas are bit-identical"
    assert (expected - flat_params(make_model())).abs().max() > 1e-3, "training moved the weights"


@pytest.mark.timeout(120)
def test_ps_sync_with_int8_pushes_keeps_replicas_identical():
    results = run_workers(_sync_worker, 2, "int8")
    assert torch.equal(results[0][0], results[1][0])
    assert (results[0][0] - reference(2, 1)).abs().max() <= 5e-2
    assert all(ratio > 3 for _, _, ratio in results), "pushes are compressed"


def _async_worker(rank, p, compressor):
    params, engine = _run(rank, lambda opt, m: ParameterServerEngine(opt, get_compressor(compressor),
                                                                     asynchronous=True))
    loss_after = sum(loss_of_model(params, rank, t) for t in range(STEPS))
    return params, engine.summary(), loss_after


def loss_of_model(flat, rank, t):
    model = make_model()
    torch.nn.utils.vector_to_parameters(flat, model.parameters())
    with torch.no_grad():
        return loss_of(model, rank, t).item()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,compressor", [(2, "none"), (3, "none"), (2, "int8")])
def test_ps_async_applies_every_gradient_and_ends_identical(p, compressor):
    results = run_workers(_async_worker, p, compressor)
    params0, summary, loss_after = results[0]
    for params, _, _ in results[1:]:
        assert torch.equal(params, params0), "flush() leaves every rank with the server's weights"
    assert summary["server_updates"] == p * STEPS
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"]
    assert sum(summary["staleness_histogram"]) == p * STEPS
    initial = make_model()
    start = torch.nn.utils.parameters_to_vector(initial.parameters()).detach()
    assert loss_after < sum(loss_of_model(start, 0, t) for t in range(STEPS)), "training reduced the loss"


def test_ps_engine_refuses_a_lone_process():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"trainer.mode=ps_sync needs >= 2 processes \(dist.nproc\)"):
        ParameterServerEngine(opt, get_compressor("none"))
