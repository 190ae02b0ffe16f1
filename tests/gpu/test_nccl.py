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
    from pipesgd.engine.base import to_device

    return to_device(state, "cpu")


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
