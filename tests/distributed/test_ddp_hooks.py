"""``trainer.mode=ddp compressor=powersgd`` is torch's own PowerSGD hook, the baseline a user would
pick: on 2 Gloo ranks the mode's DDP ends every step with the parameters of a DDP built by hand with
the same ``PowerSGDState``, and its engine state resumes the hook exactly (error feedback,
warm-started Q, iteration count, generator).

"Same" is within ``ATOL``, not bit for bit: torch's hook is not bit-reproducible on the CPU even
against itself (two identical hand-built runs in one process differ by 7e-9 from the first
compressed step on, measured here; its buffers' alignment changes the kernels' summation order)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed_utils import run_workers

STEPS = 6
ATOL = 1e-6


def _model() -> nn.Module:
    """Over DDP's default 1 MiB first bucket (as ResNet-20 is): torch's hook would hang on Gloo with
    two buckets, so the mode makes one; its parameters are re-ordered when DDP re-buckets after the
    first iteration (model order, then the order backward makes gradients ready)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 6000))


def _batch(rank: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def _mode_engine(model, opt, rank, world):
    from pipesgd.comm import ring_allreduce
    from pipesgd.engine.build import build
    from pipesgd.engine.base import ModeArgs
    from pipesgd.reduction.powersgd import PowerSGD

    args = ModeArgs(model=model, optimizer=opt, width=1, compressor=PowerSGD(rank=2), allreduce=ring_allreduce,
                    group=None, world_size=world, warmup_sync_steps=0, device=torch.device("cpu"))
    ddp, engine = build("ddp", args)
    engine.hook_state.state.start_powerSGD_iter = 2  # torch's minimum: compress from the third step on
    return ddp, engine


def _train(ddp, opt, engine, rank, steps):
    out = []
    for i in steps:
        x, y = _batch(rank, i)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if engine is None:
            opt.step()
        else:
            engine.step()
        out.append(torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]).clone())
    return out


def _against_hand_built(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp, engine = _mode_engine(model, opt, rank, world)
    mine = _train(ddp, opt, engine, rank, range(STEPS))

    ref_model = _model()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    ref = DDP(ref_model, bucket_cap_mb=25)  # one bucket, as the mode builds it on Gloo (pipesgd.engine.ddp)
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                               use_error_feedback=True, warm_start=True, random_seed=0)
    ref.register_comm_hook(state, psgd.powerSGD_hook)
    theirs = _train(ref, ref_opt, None, rank, range(STEPS))
    plain_model = _model()  # the same steps without the hook: PowerSGD must have changed something
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    plain = _train(DDP(plain_model), plain_opt, None, rank, range(STEPS))
    return mine, theirs, plain, engine.hook_state.state.iter, dict(engine.hook_state._layout)


@pytest.mark.timeout(400)
def test_ddp_powersgd_is_torchs_hook():
    for mine, theirs, plain, hook_iter, layout in run_workers(_against_hand_built, 2):
        assert hook_iter == STEPS
        assert len(layout) == 1, layout
        for step, (a, b) in enumerate(zip(mine, theirs)):
            assert (a - b).abs().max() <= ATOL, f"step {step}: the mode's DDP differs from the hand-built PowerSGD DDP"
        assert torch.equal(mine[1], plain[1])                # steps 1-2: plain allreduce, as torch's start iter says
        assert (mine[-1] - plain[-1]).abs().max() > 100 * ATOL  # then compressed: a different trajectory


def _resume(rank, world):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp, engine = _mode_engine(model, opt, rank, world)
    straight = _train(ddp, opt, engine, rank, range(STEPS))[-1]

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp, engine = _mode_engine(model, opt, rank, world)
    _train(ddp, opt, engine, rank, range(STEPS // 2))
    import io
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "engine": engine.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)  # as pipesgd.reliability.checkpoint loads it

    model = _model()
    model.load_state_dict(saved["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.load_state_dict(saved["opt"])
    ddp, engine = _mode_engine(model, opt, rank, world)
    engine.load_state_dict(saved["engine"])
    resumed = _train(ddp, opt, engine, rank, range(STEPS // 2, STEPS))[-1]

    model = _model()  # and without the hook's state: the residual and Q are lost, the run differs
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    ddp, engine = _mode_engine(model, opt, rank, world)
    engine.hook_state.state.iter = STEPS // 2
    lost = _train(ddp, opt, engine, rank, range(STEPS // 2, STEPS))[-1]
    return straight, resumed, lost


@pytest.mark.timeout(400)
def test_ddp_powersgd_resumes_exactly():
    for straight, resumed, lost in run_workers(_resume, 2):
        assert (straight - resumed).abs().max() <= ATOL
        assert (straight - lost).abs().max() > 100 * ATOL


def test_ddp_start_iter_is_torchs_start_powersgd_iter():
    """``compressor.ddp_start_iter`` reaches torch's ``PowerSGDState`` (a timing run of 50 steps
    with torch's default 1000 would time plain DDP), defaults to torch's 1000, and torch's minimum
    (2, with warm start or error feedback) is checked where the value is given, naming it."""
    from pipesgd.reduction.powersgd import PowerSGD

    params = list(_model().parameters())
    assert PowerSGD(rank=2, ddp_start_iter=2).ddp_state(params, None).state.start_powerSGD_iter == 2
    assert PowerSGD(rank=2).ddp_state(params, None).state.start_powerSGD_iter == 1000
    for bad in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"ddp_start_iter={bad!r}"):
            PowerSGD(rank=2, ddp_start_iter=bad)
