"""The width-K engine against references: width 1 against PyTorch DDP, widths 2 and 3 against a
plain single-process implementation of the stale update rule."""

import copy

import pytest
import torch

from distributed_utils import run_workers
from engine_reference import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model, reference
from pipesgd import PipeSGD

def _pipesgd_worker(rank, p, width, compressor, allreduce):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    applied = []
    with PipeSGD(opt, model.parameters(), width=width, compressor=compressor, allreduce=allreduce) as engine:
        for t in range(STEPS):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            applied.append(engine.step().applied)
            assert engine.in_flight == min(t + 1, width - 1)
        engine.flush()
        assert engine.in_flight == 0
    return flat_params(model), applied


def _ddp_vs_sync_worker(rank, p):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(make_model())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for t in range(STEPS):
        ddp_opt.zero_grad()
        loss_of(ddp, rank, t).backward()
        ddp_opt.step()
    ours, _ = _pipesgd_worker(rank, p, 1, "none", "ring")
    return flat_params(ddp.module), ours


@pytest.mark.timeout(120)
def test_width1_equals_ddp():
    for ddp_params, ours in run_workers(_ddp_vs_sync_worker, 2):
        assert (ddp_params - ours).abs().max() <= 1e-5
        assert not torch.equal(ours, flat_params(make_model())), "training must have moved the weights"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p,width", [(2, 2), (2, 3), (3, 2)])
def test_width_k_equals_reference(p, width):
    expected = reference(p, width)
    results = run_workers(_pipesgd_worker, p, width, "none", "ring")
    for params, applied in results:
        assert applied == [t >= width - 1 for t in range(STEPS)]
        assert (params - expected).abs().max() <= 1e-5
    # The stale rule really differs from synchronous SGD (so the comparison can fail).
    assert (reference(p, 1) - expected).abs().max() > 1e-4


@pytest.mark.timeout(120)
def test_native_allreduce_and_compressed_ring_keep_replicas_identical():
    for allreduce, compressor, tol in [("native", "none", 1e-5), ("ring", "int8", 5e-2)]:
        results = run_workers(_pipesgd_worker, 2, 2, compressor, allreduce)
        assert torch.equal(results[0][0], results[1][0]), f"{allreduce}/{compressor}: replicas differ"
        assert (results[0][0] - reference(2, 2)).abs().max() <= tol


def test_lone_process_runs_the_same_rule():
    """No process group: the engine still delays by width-1 steps (world of one)."""
    for width in (1, 2, 4):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        engine = PipeSGD(opt, model.parameters(), width=width)
        for t in range(STEPS):
            opt.zero_grad()
            loss_of(model, 0, t).backward()
            engine.step()
        engine.flush()
        assert (flat_params(model) - reference(1, width)).abs().max() <= 1e-6


def test_warmup_sync_steps_then_pipeline():
    for width, warm in [(2, 5), (3, 4)]:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        engine = PipeSGD(opt, model.parameters(), width=width, warmup_sync_steps=warm)
        applied = []
        for t in range(STEPS):
            opt.zero_grad()
            loss_of(model, 0, t).backward()
            applied.append(engine.step().applied)
        engine.flush()
        assert applied == [t < warm or t >= warm + width - 1 for t in range(STEPS)]
        assert (flat_params(model) - reference(1, width, warmup_sync_steps=warm)).abs().max() <= 1e-6
        assert (flat_params(model) - reference(1, width)).abs().max() > 1e-5


def test_state_dict_round_trip_resumes_exactly():
    """Stop after 7 steps with gradients in flight, restore into fresh objects, finish: identical."""
    def run(split_at=None):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        engine = PipeSGD(opt, model.parameters(), width=3)
        for t in range(STEPS):
            if t == split_at:
                state = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), engine.state_dict())
                assert len(state[2]["pending"]) == 2
                model = make_model()
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
                engine = PipeSGD(opt, model.parameters(), width=3)
                model.load_state_dict(state[0])
                opt.load_state_dict(state[1])
                engine.load_state_dict(state[2])
            opt.zero_grad()
            loss_of(model, 0, t).backward()
            engine.step()
        engine.flush()
        return flat_params(model)

    assert torch.equal(run(), run(split_at=7))


@pytest.mark.parametrize("width", [0, -1, 1.5, True])
def test_bad_width_names_the_value(width):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=f"width must be an integer >= 1.*got {width!r}"):
        PipeSGD(opt, model.parameters(), width=width)


def test_gradients_are_double_buffered():
    """What step() launched must not change when the caller's next backward reuses p.grad."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = PipeSGD(opt, model.parameters(), width=2)
    loss_of(model, 0, 0).backward()
    launched = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
    engine.step()
    for p in model.parameters():
        p.grad.mul_(100.0)  # in-place accumulation, as a non-zeroed backward would do
    assert torch.equal(engine.state_dict()["pending"][0], launched)
