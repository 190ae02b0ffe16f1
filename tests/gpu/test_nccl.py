"""The reference checks on NCCL, one GPU per rank (docs/gpu.md says what they add to the CPU proofs).

Skipped without CUDA and at least two GPUs. ``PIPESGD_GPU_SUITE_ON_CPU=1`` runs the very same
checks on Gloo and the CPU: how this suite is itself kept working on machines without GPUs.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from distributed_utils import run_workers
from engine_reference import LR, MOMENTUM, STEPS, batch, flat_params, make_model
from pipesgd import PipeSGD

if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
    BACKEND = "nccl"
elif os.environ.get("PIPESGD_GPU_SUITE_ON_CPU") == "1":
    BACKEND = "gloo"
else:
    pytestmark = pytest.mark.skip(reason="needs CUDA and >= 2 GPUs (or PIPESGD_GPU_SUITE_ON_CPU=1)")
    BACKEND = "nccl"

P = 2
COMPRESSORS = ["none", "fp16", "bf16", "int8"]


def device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if BACKEND == "nccl" else torch.device("cpu")


def _exact_math() -> None:
    """No TF32: the references below are compared at fp32 precision."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _allreduce_worker(rank, p, algorithm, compressor, group_size):
    import torch.distributed as dist

    from pipesgd.comm import ring_allreduce, tree_allreduce
    from pipesgd.comm.hierarchical import HierarchicalAllreduce
    from pipesgd.dist import node_groups

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(10_007, generator=g).to(device(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    group = dist.new_group()  # the engine's comm group, as the trainer builds it
    if algorithm == "hierarchical":
        nodes = node_groups(group_size)
        fn = HierarchicalAllreduce(nodes.intra, nodes.leaders, group_size)
    else:
        fn = {"ring": ring_allreduce, "tree": tree_allreduce}[algorithm]
    fn(x, compressor, group)
    return x.cpu(), expected.cpu()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compressor", COMPRESSORS)
@pytest.mark.parametrize("algorithm,group_size", [("ring", None), ("tree", None), ("hierarchical", 1),
                                                  ("hierarchical", 2)])
def test_allreduces_match_dist_all_reduce_and_keep_replicas_identical(algorithm, group_size, compressor):
    results = run_workers(_allreduce_worker, P, algorithm, compressor, group_size, backend=BACKEND, timeout=240)
    (ours, expected), (theirs, _) = results
    assert torch.equal(ours, theirs), "replicas must decode identical bytes"
    # none: summation order only; compressors: p encodes of at most 2**-7 relative (bf16) or a block's max/254
    tol = 1e-5 if compressor == "none" else 2e-2 * expected.abs().max().item()
    assert (ours - expected).abs().max() <= tol


def _train(rank, width, compressor, split_at=None):
    _exact_math()
    dev = device(rank)

    def build():
        model = make_model().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        return model, opt, PipeSGD(opt, model.parameters(), width=width, compressor=compressor)

    def loss(model, t):
        x, y = (v.to(dev) for v in batch(rank, t))
        return torch.nn.functional.cross_entropy(model(x), y)

    model, opt, engine = build()
    for t in range(STEPS):
        if t == split_at:  # a checkpoint: everything to the CPU, into fresh objects, as resume does
            saved = copy.deepcopy(_to_cpu((model.state_dict(), opt.state_dict(), engine.state_dict())))
            engine.close()
            model, opt, engine = build()
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            engine.load_state_dict(saved[2])
        opt.zero_grad()
        loss(model, t).backward()
        engine.step()
    engine.flush()
    engine.close()
    return flat_params(model).cpu()


def _to_cpu(state):
    from pipesgd.flat import state_to_device

    return state_to_device(state, "cpu")


def _ddp_worker(rank, p):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _exact_math()
    dev = device(rank)
    ddp = DDP(make_model().to(dev), device_ids=[rank] if dev.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    for t in range(STEPS):
        opt.zero_grad()
        x, y = (v.to(dev) for v in batch(rank, t))
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return flat_params(ddp.module).cpu(), _train(rank, 1, "none")


@pytest.mark.timeout(300)
def test_width1_equals_ddp():
    for ddp_params, ours in run_workers(_ddp_worker, P, backend=BACKEND, timeout=240):
        assert (ddp_params - ours).abs().max() <= 1e-5
        assert not torch.equal(ours, flat_params(make_model())), "training must have moved the weights"


def _replica_worker(rank, p, width, compressor):
    return _train(rank, width, compressor)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compressor", [*COMPRESSORS, "topk", "powersgd"])
def test_replicas_stay_bit_identical(compressor):
    ours, theirs = run_workers(_replica_worker, P, 2, compressor, backend=BACKEND, timeout=240)
    assert torch.equal(ours, theirs)


def _resume_worker(rank, p, compressor):
    return _train(rank, 3, compressor), _train(rank, 3, compressor, split_at=7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compressor", ["none", "int8", "powersgd"])
def test_resume_with_gradients_in_flight_is_bit_exact(compressor):
    for straight, resumed in run_workers(_resume_worker, P, compressor, backend=BACKEND, timeout=240):
        assert torch.equal(straight, resumed)


# --- one case per defect the CPU fakes now catch (docs/gpu.md, "What only a GPU can prove")


def _fit(model, opt, step, rank, steps):
    """``steps`` steps of the reference loss on ``rank``'s batches, each ended by ``step()``; what it returned."""
    dev, out = device(rank), []
    for t in range(steps):
        opt.zero_grad()
        x, y = (v.to(dev) for v in batch(rank, t))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        out.append(step())
    return out


def _bf16_paths_worker(rank, p):
    """bf16 payloads cross as torch.bfloat16 (NCCL has no int16): the ring, the tree and ps_sync."""
    from pipesgd.engine.ps import ParameterServerEngine
    from pipesgd.compress import get_compressor

    _exact_math()
    dev = device(rank)
    out = {}
    for allreduce in ("ring", "tree"):
        model = make_model().to(dev)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with PipeSGD(opt, model.parameters(), width=2, compressor="bf16", allreduce=allreduce) as engine:
            _fit(model, opt, engine.step, rank, 3)
            engine.flush()
        out[allreduce] = flat_params(model).cpu()
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    _fit(model, opt, ParameterServerEngine(opt, get_compressor("bf16")).step, rank, 3)
    out["ps_sync"] = flat_params(model).cpu()
    return out


@pytest.mark.timeout(300)
def test_bf16_crosses_the_ring_the_tree_and_ps_sync():
    ours, theirs = run_workers(_bf16_paths_worker, P, backend=BACKEND, timeout=240)
    for path in ("ring", "tree", "ps_sync"):
        assert torch.equal(ours[path], theirs[path]), path


def _device_worker(rank, p):
    """The communication thread sets this rank's device once: no context on another GPU."""
    out = _train(rank, 2, "powersgd")
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    others = ([i for i in range(torch.cuda.device_count()) if i != rank and has_context(i)]
              if BACKEND == "nccl" and has_context is not None else [])
    return out, others


@pytest.mark.timeout(300)
def test_no_rank_creates_a_context_on_another_gpu():
    for _, others in run_workers(_device_worker, P, backend=BACKEND, timeout=240):
        assert others == [], f"a context on GPU(s) {others} of another rank"


def _ported_loop_worker(rank, p):
    """module= with BatchNorm buffers and a metric all-reduce with an update in flight: every
    collective on the engine's thread, so NCCL sees one order (a deadlock before, at best)."""
    import torch.distributed as dist

    dev = device(rank)
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 2)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with PipeSGD(opt, model.parameters(), width=2, module=model, timeout_s=60) as engine:
        for step in range(6):
            opt.zero_grad()
            model(torch.randn(5, 6, device=dev) + rank).square().mean().backward()
            engine.step()
            if step % 2:
                metric = torch.tensor([float(rank + 1)], device=dev)
                engine.collective(lambda: dist.all_reduce(metric), "metric all-reduce")
        engine.flush()
    return metric.cpu(), torch.cat([b.float().reshape(-1) for b in model.buffers()]).cpu()


@pytest.mark.timeout(300)
def test_broadcast_buffers_and_a_metric_all_reduce_keep_one_order():
    (m0, b0), (m1, b1) = run_workers(_ported_loop_worker, P, backend=BACKEND, timeout=240)
    assert m0.item() == m1.item() == 3.0 and torch.equal(b0, b1)


def _junk_sizes() -> list[int]:
    """Sizes the engine's state and buffers have for this model: the caching allocator hands a
    freed block only to a request of its pool (small: <= 1 MiB, large: above) and about its size,
    so junk of one 4 MiB tensor never reused the few-KB blocks it should clobber."""
    sizes = [p.numel() for p in make_model().parameters()]
    total = sum(sizes)
    return sorted({*sizes, total, total + 1, 1 << 20})


def _pressure_worker(rank, p, compressor):
    """Each step allocates and poisons memory of the sizes the engine's state has, right after the
    engine's state is made or loaded: reduction state made on the wrong stream would be handed out
    and overwritten here."""
    real_step = PipeSGD.step
    sizes = _junk_sizes()

    def step(self):
        junk = [torch.full((n,), float("nan"), device=device(rank)) for n in sizes for _ in range(4)]
        del junk
        return real_step(self)

    PipeSGD.step = step
    try:
        return _train(rank, 3, compressor), _train(rank, 3, compressor, split_at=7)
    finally:
        PipeSGD.step = real_step


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compressor", ["powersgd", "topk"])
def test_reduction_state_survives_allocator_reuse_at_start_and_resume(compressor):
    for straight, resumed in run_workers(_pressure_worker, P, compressor, backend=BACKEND, timeout=240):
        assert torch.isfinite(straight).all() and torch.equal(straight, resumed)


HANG_WIDTH = 3


def _hang_worker(rank, p):
    """Rank 1 goes silent after its first step; rank 0's engine (width 3), with the trainer's
    deadline (a share of the groups' 60 s timeout, tests/distributed_utils.py), must raise before
    NCCL's watchdog, which counts from the enqueue of step 2's reduction, K-1 steps before the
    engine starts waiting for it. Returns the error and the seconds from that enqueue."""
    import threading
    import time

    from pipesgd.dist import ENGINE_TIMEOUT_SHARE
    from pipesgd.engine.base import ReductionError

    dev = device(rank)
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine = PipeSGD(opt, model.parameters(), width=HANG_WIDTH, timeout_s=ENGINE_TIMEOUT_SHARE * 60)
    enqueued = None
    for t in range(1 + HANG_WIDTH):
        if rank == 1 and t == 1:
            threading.Event().wait()  # silent: never returns (the harness kills this rank)
        opt.zero_grad()
        x, y = (v.to(dev) for v in batch(rank, t))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if t == 1:
            enqueued = time.monotonic()
        try:
            engine.step()
        except ReductionError as e:
            return str(e), time.monotonic() - enqueued
    return None, 0.0


@pytest.mark.timeout(300)
def test_a_silent_peer_raises_the_engines_error_before_the_groups_timeout():
    (message, since_enqueue), = run_workers(_hang_worker, P, backend=BACKEND, timeout=240, expect=[0])
    assert message is not None and "did not finish within 48 s" in message
    # waited for K-1 steps after its enqueue (step 2's reduction, at step 2 + K - 1) ...
    assert f"step 2's gradient (waited for at step {1 + HANG_WIDTH})" in message, message
    # ... and still inside the groups' timeout counted from that enqueue, as NCCL's watchdog counts
    assert since_enqueue < 60


def _no_sleep_worker(rank, p):
    """Waiting for the device with a deadline never sleeps (it blocks on the done-event)."""
    import pipesgd.comm.streams as streams

    def no_sleep(seconds):
        raise AssertionError("the wait for the device slept")

    streams.time.sleep = no_sleep
    _exact_math()
    dev = device(rank)
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with PipeSGD(opt, model.parameters(), width=2, timeout_s=60) as engine:
        _fit(model, opt, engine.step, rank, 5)
        engine.flush()
    return flat_params(model).cpu()


@pytest.mark.timeout(300)
def test_waiting_with_a_deadline_never_sleeps():
    ours, theirs = run_workers(_no_sleep_worker, P, backend=BACKEND, timeout=240)
    assert torch.equal(ours, theirs)


def _ps_times_worker(rank, p):
    from pipesgd.compress import get_compressor
    from pipesgd.engine.ps import ParameterServerEngine

    dev = device(rank)
    model = make_model().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stats = _fit(model, opt, ParameterServerEngine(opt, get_compressor("none")).step, rank, 3)
    return [(len(s.wait_spans), s.exposed_s(), s.comm.time_s()) for s in stats]


@pytest.mark.timeout(300)
def test_ps_sync_times_its_rounds_on_the_device():
    for rows in run_workers(_ps_times_worker, P, backend=BACKEND, timeout=240):
        for spans, exposed, comm in rows:
            assert spans == (1 if BACKEND == "nccl" else 0)
            assert exposed > 0 and comm > 0 and exposed == comm


def _rng_worker(rank, p):
    from pipesgd.reliability.checkpoint import rng_state, set_rng_state

    dev = device(rank)
    state = rng_state(dev)
    first = torch.rand(4, device=dev)
    set_rng_state(state, dev)
    again = torch.rand(4, device=dev)
    own = state["cuda"] is None if dev.type == "cpu" else state["cuda"].dtype == torch.uint8
    return torch.equal(first, again), own


@pytest.mark.timeout(300)
def test_a_checkpoint_keeps_and_restores_the_ranks_own_gpu_rng():
    for same, own in run_workers(_rng_worker, P, backend=BACKEND, timeout=240):
        assert same and own
