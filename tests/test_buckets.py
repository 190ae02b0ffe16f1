"""Backward-overlapped buckets (trainer.bucket_mb): the same parameters as the unbucketed engine
(within 1e-6) at widths 1 and 2, reductions launched from backward, and the one-backward contract."""

import pytest
import torch
from torch import nn

from distributed_utils import run_workers
from pipesgd import PipeSGD
from test_engine import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model, reference

BUCKET_MB = 400 / 2**20  # 400 bytes: the toy model's 4 tensors fall into 3 buckets


def _train(rank, width, bucket_mb, compressor="none"):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    launched_in_backward = []
    with PipeSGD(opt, model.parameters(), width=width, compressor=compressor, bucket_mb=bucket_mb) as engine:
        for t in range(STEPS):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            if bucket_mb is not None:
                r = engine._reducer
                launched_in_backward.append(r._next == len(r.buckets))
            engine.step()
        engine.flush()
    return flat_params(model), launched_in_backward


def _compare_worker(rank, p, compressor):
    out = {}
    for width in (1, 2):
        plain, _ = _train(rank, width, None, compressor)
        bucketed, launched = _train(rank, width, BUCKET_MB, compressor)
        out[width] = (plain, bucketed, all(launched))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("p", [2, 3])
def test_bucketed_equals_unbucketed_at_widths_1_and_2(p):
    results = run_workers(_compare_worker, p, "none")
    for out in results:
        for width, (plain, bucketed, launched) in out.items():
            assert launched, "every bucket was queued by the backward hooks, before step()"
            assert (plain - bucketed).abs().max() <= 1e-6, f"width {width}"
            assert (bucketed - reference(p, width)).abs().max() <= 1e-5, f"width {width}"
    assert (results[0][1][1] - results[0][2][1]).abs().max() > 1e-4, "widths differ, so the check can fail"


@pytest.mark.timeout(120)
def test_bucketed_int8_keeps_replicas_identical():
    results = run_workers(_compare_worker, 2, "int8")
    for width in (1, 2):
        assert torch.equal(results[0][width][1], results[1][width][1])
        assert (results[0][width][1] - reference(2, width)).abs().max() <= 5e-2


def test_buckets_follow_backward_order_and_cap():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = PipeSGD(opt, model.parameters(), width=1, bucket_mb=BUCKET_MB)
    r = engine._reducer
    shapes = [[tuple(r.params[i].shape) for i in b] for b in r.buckets]
    assert shapes == [[(3,), (3, 32)], [(32,)], [(32, 10)]]  # last layer first; a 1280-byte tensor alone
    engine.close()


def test_unused_parameter_counts_as_zero_and_lone_process_matches_reference():
    model = make_model()
    extra = nn.Parameter(torch.ones(4))  # never used by the loss: its hook never fires
    opt = torch.optim.SGD(list(model.parameters()) + [extra], lr=LR, momentum=MOMENTUM)
    engine = PipeSGD(opt, list(model.parameters()) + [extra], width=2, bucket_mb=BUCKET_MB)
    for t in range(STEPS):
        opt.zero_grad()
        loss_of(model, 0, t).backward()
        engine.step()
    engine.flush()
    assert torch.equal(extra.detach(), torch.ones(4))
    assert (flat_params(model) - reference(1, 2)).abs().max() <= 1e-6


def test_second_backward_before_step_raises():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = PipeSGD(opt, model.parameters(), width=1, bucket_mb=BUCKET_MB)
    loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="exactly one backward per step"):
        loss_of(model, 0, 1).backward()
    engine.close()


@pytest.mark.parametrize("bad", [0, -1.0, True])
def test_bad_bucket_mb_names_the_value(bad):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=f"bucket_mb must be a number > 0.*got {bad!r}"):
        PipeSGD(opt, model.parameters(), bucket_mb=bad)


def test_timing_model_overlaps_sync_buckets_like_ddp_and_not_pipe():
    from pipesgd.timing import Link, predict_iter_ms

    link, nbytes, compute = Link.parse("100mbit", "50us"), 1_078_888, 0.172
    cap = 256 * 1024
    plain = predict_iter_ms("sync", "ring", nbytes, 2, link, compute)
    bucketed = predict_iter_ms("sync", "ring", nbytes, 2, link, compute, sync_buckets=True,
                               bucket_cap_bytes=cap, first_bucket_bytes=cap)
    ddp = predict_iter_ms("ddp", "ring", nbytes, 2, link, compute, bucket_cap_bytes=cap, first_bucket_bytes=cap)
    assert bucketed == pytest.approx(ddp) and bucketed < plain
    pipe = predict_iter_ms("pipe", "ring", nbytes, 2, link, compute, width=2)
    assert predict_iter_ms("pipe", "ring", nbytes, 2, link, compute, width=2, sync_buckets=True,
                           bucket_cap_bytes=cap, first_bucket_bytes=cap) == pipe
