"""Replicas of k ranks in the period-H engine (``PipeDiLoCo(..., replicas=replica_groups(k))``):
k ranks with batch b per replica train as one rank with batch k·b (SGD and AdamW inner, Nesterov
outer), the sharded exchange between rank peers equals the whole-model exchange (fp32 exactly at
M = 2, int8 within its rounding), resume mid-flight is bit-exact at M = 2, k = 2, a non-finite
inner step drops its round on every rank, and the ranks of a replica are checked to agree."""

from functools import partial

import pytest
import torch

from diloco_reference import INNER, OUTER
from distributed_utils import run_workers
from engine_reference import STEPS, batch, flat_params, make_model
from pipesgd.comm import ring_bytes
from pipesgd.engine.diloco import PipeDiLoCo

ADAMW = partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _loss(model, replica, k, member, t):
    """Replica ``replica``'s batch of step ``t`` (16 samples), the ``member``-th of its k pieces."""
    x, y = batch(replica, t)
    n = len(y) // k
    part = slice(member * n, (member + 1) * n)
    return torch.nn.functional.cross_entropy(model(x[part]), y[part])


def _run(rank, world, k, width=2, rule="none", inner=INNER, fragments=1, delay=0, compressor="none", whole=False,
         stop=None, steps=STEPS + 1, warmup=0, bad=None, nonfinite="abort"):
    """World ``world`` as replicas of ``k`` ranks; ``whole``: every rank of a replica takes the
    replica's whole batch (no piece); ``stop``: save the state before that step, rebuild and go on;
    ``bad``: (rank, step) whose loss is made NaN."""
    from pipesgd.dist import replica_groups

    groups = replica_groups(k)

    def build():
        model = make_model()
        opt = inner(model.parameters())
        return model, opt, PipeDiLoCo(opt, model.parameters(), 4, width=width, staleness=rule, allreduce="ring",
                                      outer_optimizer=OUTER, fragments=fragments, sync_delay=delay,
                                      compressor=compressor, warmup_sync_steps=warmup, replicas=groups,
                                      nonfinite=nonfinite)

    model, opt, engine = build()
    sent = []
    for t in range(steps):
        if t == stop:
            saved = {"model": {n: v.clone() for n, v in model.state_dict().items()},
                     "opt": opt.state_dict(), "engine": engine.state_dict()}
            engine.close()
            model, opt, engine = build()
            model.load_state_dict(saved["model"])
            engine.load_state_dict(saved["engine"])
        opt.zero_grad()
        loss = _loss(model, rank // k, 1, 0, t) if whole else _loss(model, rank // k, k, rank % k, t)
        if bad == (rank, t):
            loss = loss * float("nan")
        loss.backward()
        sent.append(engine.step().comm.wire_bytes)
    engine.flush()
    out = {"params": flat_params(model), "sent": sent, "summary": engine.summary(),
           "skipped": list(engine.nonfinite.skipped)}
    engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inner,width,rule,fragments,delay,warmup", [
    (INNER, 2, "none", 1, 0, 0), (ADAMW, 1, "none", 1, 0, 0), (ADAMW, 2, "eager", 2, 1, 3)])
def test_k_ranks_with_batch_b_train_as_one_rank_with_batch_kb(inner, width, rule, fragments, delay, warmup):
    """World 4 as two replicas of two ranks, 8 samples each, against world 2 as two replicas of one
    rank, 16 samples each: the same weights within 1e-6 (the inner average of two 8-sample means is
    the 16-sample mean up to rounding)."""
    many = run_workers(_run, 4, 2, width, rule, inner, fragments, delay, "none", False, None, STEPS + 1, warmup)
    one = run_workers(_run, 2, 1, width, rule, inner, fragments, delay, "none", False, None, STEPS + 1, warmup)
    for rank, out in enumerate(many):
        assert (out["params"] - one[rank // 2]["params"]).abs().max() <= 1e-6, f"rank {rank}"
    assert torch.equal(many[0]["params"], many[1]["params"]), "the ranks of a replica differ"
    # after the warm-up (synchronous steps over the world) each rank of a replica sends half the
    # pseudo-gradient over the slow link, at the steps a replica of one rank sends it all
    for rank, out in enumerate(many):
        mine, whole = out["sent"][warmup:], one[rank // 2]["sent"][warmup:]
        assert 0 < sum(mine) <= sum(whole) // 2 + 64 and [b > 0 for b in mine] == [b > 0 for b in whole]
    assert many[0]["summary"]["bytes_inside_replica"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("width,rule,fragments,delay", [(2, "none", 1, 0), (2, "eager", 2, 1)])
def test_sharded_exchange_equals_the_whole_model_exchange_exactly_in_fp32(width, rule, fragments, delay):
    """Every rank of a replica on the replica's whole batch: the inner average of k equal gradients
    is that gradient exactly, so the only difference from replicas of one rank is the exchange in
    shards, which at M = 2 sums the same two values per element (a + b): bit for bit equal."""
    many = run_workers(_run, 4, 2, width, rule, INNER, fragments, delay, "none", True)
    one = run_workers(_run, 2, 1, width, rule, INNER, fragments, delay, "none", True)
    for rank, out in enumerate(many):
        assert torch.equal(out["params"], one[rank // 2]["params"]), f"rank {rank}"


def _exchange(rank, world, k, compressor):
    """One flat buffer per replica (the same on its k ranks), summed between replicas in shards."""
    import torch.distributed as dist

    from pipesgd.comm import ring_allreduce
    from pipesgd.dist import replica_groups
    from pipesgd.reduction.sharded import Sharded
    from pipesgd.reduction import resolve

    groups = replica_groups(k)
    g = torch.Generator().manual_seed(100 + groups.index)
    flat = torch.randn(1001, generator=g) * (1 + groups.index)
    red = Sharded(resolve(compressor), groups.gather, k, groups.member)
    red.bind([flat.shape], ring_allreduce, flat.device)
    out = flat.clone()
    stats = red.reduce(out, groups.peers)
    dist.barrier()
    return out, stats.wire_bytes


@pytest.mark.timeout(180)
def test_sharded_reduction_sums_between_replicas_fp32_exactly_and_int8_within_its_bound():
    inputs = [torch.randn(1001, generator=torch.Generator().manual_seed(100 + m)) * (1 + m) for m in range(2)]
    exact = inputs[0] + inputs[1]
    fp32 = run_workers(_exchange, 4, 2, "none")
    for out, wire in fp32:
        assert torch.equal(out, exact)
    # a replica's two ranks send its buffer once between them: the whole-model ring's bytes, up to the cut
    assert abs(sum(w for _, w in fp32[:2]) - ring_bytes(1001, 2, 4)) <= 8 and fp32[0][1] < ring_bytes(1001, 2, 4)
    int8 = run_workers(_exchange, 4, 2, "int8")
    bound = 3 * max(x.abs().max() for x in inputs).item() / 254  # a hop's encode and the owner's
    for out, _ in int8:
        err = (out - exact).abs().max().item()
        assert 0 < err <= bound, err
        assert torch.equal(out, int8[0][0]), "every rank holds the same sum"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("width,rule,stop,fragments,delay", [(2, "none", 7, 1, 0), (2, "eager", 9, 2, 1),
                                                            (1, "none", 5, 1, 0)])
def test_resume_mid_round_and_mid_flight_is_bit_exact_at_two_replicas_of_two(width, rule, stop, fragments, delay):
    """stop 7: inside round 2 with round 1 in flight; 9 with two fragments landing a step late:
    fragment 1's round launched at 8 trains on from its weights there; 5 at width 1: mid-round."""
    resumed = run_workers(_run, 4, 2, width, rule, INNER, fragments, delay, "int8", False, stop)
    uninterrupted = run_workers(_run, 4, 2, width, rule, INNER, fragments, delay, "int8", False)
    for a, b in zip(resumed, uninterrupted):
        assert torch.equal(a["params"], b["params"])


@pytest.mark.timeout(240)
def test_a_non_finite_inner_step_drops_its_round_on_every_rank():
    """Rank 1 (replica 0) NaN at step 5 (round 2, steps 5-8): the replica's average is non-finite,
    not applied; its round is dropped on every rank where its average lands (width 2: at step 12),
    and every rank ends on the same finite weights (trainer.nonfinite=skip)."""
    out = run_workers(_run, 4, 2, 2, "none", INNER, 1, 0, "none", False, None, STEPS + 1, 0, (1, 5), "skip")
    assert all(o["skipped"] == [2] for o in out), [o["skipped"] for o in out]
    assert all(torch.isfinite(o["params"]).all() and torch.equal(o["params"], out[0]["params"]) for o in out)
    clean = run_workers(_run, 4, 2, 2, "none", INNER, 1, 0, "none", False, None, STEPS + 1, 0, None, "skip")
    assert clean[0]["skipped"] == [] and not torch.equal(clean[0]["params"], out[0]["params"])


def _diverged(rank, world):
    from pipesgd.dist import replica_groups
    from pipesgd.engine.replicas import ReplicaMismatch

    groups = replica_groups(2)
    model = make_model()
    opt = INNER(model.parameters())
    engine = PipeDiLoCo(opt, model.parameters(), 4, width=2, replicas=groups, allreduce="ring")
    for t in range(2):
        opt.zero_grad()
        _loss(model, rank // 2, 2, rank % 2, t).backward()
        engine.step()
    engine.check_replicas()  # agree
    if rank == 3:
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0
    mismatch = None
    try:
        engine.check_replicas()
    except ReplicaMismatch as e:
        mismatch = str(e)
    engine.close()
    return mismatch


@pytest.mark.timeout(180)
def test_the_ranks_of_a_replica_are_checked_to_agree_mid_round():
    out = run_workers(_diverged, 4)
    assert out[0] is None and out[1] is None, "replica 0 agrees"
    assert "diverged" in out[2] and "diverged" in out[3]


def _refused(rank, world):
    from pipesgd.dist import replica_groups

    groups = replica_groups(2)
    model = make_model()
    errors = []
    try:
        PipeDiLoCo(INNER(model.parameters()), model.parameters(), 4, replicas=groups, compressor="powersgd")
    except ValueError as e:
        errors.append(str(e))
    one = PipeDiLoCo(INNER(model.parameters()), model.parameters(), 4, width=2)
    state = one.state_dict()
    one.close()
    two = PipeDiLoCo(INNER(model.parameters()), model.parameters(), 4, width=2, replicas=groups)
    try:
        two.load_state_dict(state)
    except ValueError as e:
        errors.append(str(e))
    two.close()
    try:
        replica_groups(3)
    except ValueError as e:
        errors.append(str(e))
    return errors


@pytest.mark.timeout(120)
def test_refusals_name_their_option():
    errors = run_workers(_refused, 4)[0]
    assert len(errors) == 3, errors
    assert "compressor=powersgd" in errors[0] and "dist.ranks_per_replica" in errors[0]
    assert "dist.ranks_per_replica=1, this run has 2" in errors[1]
    assert "dist.ranks_per_replica=3 is invalid for world size 4" in errors[2]
