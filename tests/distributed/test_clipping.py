"""``max_grad_norm`` clips the averaged gradient the optimizer applies, as DDP users get by clipping
after ``backward()``; clipping before ``engine.step()`` would clip each rank's own gradient."""

import pytest
import torch

from distributed_utils import run_workers
from engine_reference import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model, reference
from pipesgd import PipeSGD

MAX_NORM = 0.05


def _worker(rank, p, width):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine = PipeSGD(opt, model.parameters(), width=width, max_grad_norm=MAX_NORM)
    norms = []
    for t in range(STEPS):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        norms.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]).norm().item())
        engine.step()
    engine.flush()
    engine.close()
    return flat_params(model), min(norms)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("width", [1, 2])
def test_max_grad_norm_clips_the_average(width):
    expected = reference(2, width, max_grad_norm=MAX_NORM)
    assert (expected - reference(2, width)).abs().max() > 1e-3, "the clip must bite, or equality proves little"
    for params, smallest_local_norm in run_workers(_worker, 2, width):
        assert smallest_local_norm > MAX_NORM
        assert (params - expected).abs().max() <= 1e-6


@pytest.mark.parametrize("bad", [0, -1.0, True, float("nan")])
def test_bad_max_grad_norm_names_the_value(bad):
    model = make_model()
    with pytest.raises(ValueError, match=rf"max_grad_norm must be a number > 0 \(or None: no clipping\), got {bad!r}"):
        PipeSGD(torch.optim.SGD(model.parameters(), lr=LR), model.parameters(), max_grad_norm=bad)
