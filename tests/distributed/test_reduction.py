"""Reduction strategies: error-feedback invariants (input = decompressed + residual), top-k and
PowerSGD against dense references computed in the test from every rank's input, in-ring error
feedback against the ring on the corrected input, wire bytes, and residuals in checkpoints."""

import copy

import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_workers
from pipesgd import PipeSGD
from pipesgd.comm import ring_allreduce
from pipesgd.compress import get_compressor
from pipesgd.reduction import ErrorFeedback, InRing, PowerSGD, TopK, resolve
from engine_reference import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model

SHAPES = [torch.Size([6, 5]), torch.Size([5]), torch.Size([4, 3, 2, 2]), torch.Size([3])]
NUMEL = sum(s.numel() for s in SHAPES)


def grad_of(rank: int, step: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * rank + step))


# --- top-k ---------------------------------------------------------------------------------------

def test_topk_keeps_the_k_largest_and_the_residual_holds_the_rest_exactly():
    topk = TopK(ratio=0.25)
    topk.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    x = grad_of(0, 0)
    values, idx = topk.compress(x)
    assert topk.k == round(0.25 * NUMEL) == values.numel()
    assert values.abs().min() >= x.abs().sort(descending=True).values[topk.k - 1]
    decoded = topk.decompress(values, idx, NUMEL)
    memory = ErrorFeedback()
    memory.update(x, decoded)
    assert torch.equal(decoded + memory.residual, x)  # exact: each entry is sent or kept, never split


def _topk_worker(rank, p, ratio):
    topk = TopK(ratio=ratio)
    topk.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    out = []
    for step in range(2):
        flat = grad_of(rank, step)
        corrected = flat + (topk.memory.residual if topk.memory.residual is not None else 0)
        stats = topk.reduce(flat, None)
        out.append((corrected, topk.memory.residual.clone(), flat.clone(), stats))
    return out


@pytest.mark.timeout(120)
def test_topk_allgather_equals_the_dense_sum_of_every_ranks_topk():
    p, ratio = 3, 0.2
    results = run_workers(_topk_worker, p, ratio)
    ref = TopK(ratio=ratio)
    ref.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    for step in range(2):
        sent = []
        for r in range(p):
            corrected, residual, _, _ = results[r][step]
            decoded = ref.decompress(*ref.compress(corrected), NUMEL)
            assert torch.equal(decoded + residual, corrected), "EF invariant"
            sent.append(decoded)
        for r in range(p):
            torch.testing.assert_close(results[r][step][2], sum(sent), rtol=0, atol=1e-6)
            assert torch.equal(results[r][step][2], results[0][step][2]), "replicas must get identical bits"
    # Residuals carry what was not sent: step 1's input includes step 0's leftovers.
    torch.testing.assert_close(results[0][1][0], grad_of(0, 1) + results[0][0][1])
    stats = results[0][0][3]
    assert stats.wire_bytes == (p - 1) * 8 * ref.k
    assert stats.ratio == pytest.approx(stats.raw_bytes / ((p - 1) * 8 * ref.k))
    assert stats.ratio > 1.0


def _dense_topk_worker(rank, p):
    topk = TopK(ratio=1.0)
    topk.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    flat, ref = grad_of(rank, 0), grad_of(rank, 0)
    topk.reduce(flat, None)
    dist.all_reduce(ref)
    return flat, ref, topk.memory.residual


@pytest.mark.timeout(120)
def test_topk_with_ratio_one_is_a_dense_allreduce():
    for flat, ref, residual in run_workers(_dense_topk_worker, 2):
        torch.testing.assert_close(flat, ref, rtol=0, atol=1e-6)
        assert not residual.any()


# --- PowerSGD ------------------------------------------------------------------------------------

def _powersgd_worker(rank, p, r, steps):
    psgd = PowerSGD(rank=r)
    psgd.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    q0 = psgd.state_dict()["q"]  # the warm start the first reduce draws
    out = []
    for step in range(steps):
        flat = grad_of(rank, step)
        corrected = flat + (psgd.memory.residual if psgd.memory.residual is not None else 0)
        stats = psgd.reduce(flat, None)
        out.append((corrected, psgd.memory.residual.clone(), flat.clone(), stats))
    return q0, out


def powersgd_reference(inputs: list[torch.Tensor], q: list[torch.Tensor], r: int):
    """One PowerSGD step from every rank's corrected input: (sum approximation, next Q, mask of
    the compressed entries)."""
    out = torch.zeros(NUMEL)
    compressed = torch.zeros(NUMEL, dtype=torch.bool)
    next_q, qi, offset = [], 0, 0
    for shape in SHAPES:
        n = shape.numel()
        rows = shape[0] if len(shape) >= 2 else 0
        if rows and min(r, rows, n // rows) * (rows + n // rows) < n:
            ms = [x[offset:offset + n].view(rows, n // rows) for x in inputs]
            p_sum = sum(m @ q[qi] for m in ms)
            p_hat = torch.linalg.qr(p_sum).Q
            q_sum = sum(m.T @ p_hat for m in ms)
            approx = p_hat @ q_sum.T
            out[offset:offset + n] = approx.reshape(-1)
            compressed[offset:offset + n] = True
            next_q.append(q_sum / len(inputs))
            qi += 1
        else:
            out[offset:offset + n] = sum(x[offset:offset + n] for x in inputs)
        offset += n
    return out, next_q, compressed


@pytest.mark.timeout(120)
def test_powersgd_matches_a_dense_reference_with_warm_start_and_error_feedback():
    p, r, steps = 3, 2, 3
    results = run_workers(_powersgd_worker, p, r, steps)
    q = results[0][0]
    for rank in range(1, p):
        assert all(torch.equal(a, b) for a, b in zip(q, results[rank][0])), "initial Q must agree"
    for step in range(steps):
        inputs = [results[rank][1][step][0] for rank in range(p)]
        expected, q, compressed = powersgd_reference(inputs, q, r)
        for rank in range(p):
            corrected, residual, flat, stats = results[rank][1][step]
            torch.testing.assert_close(flat, expected, rtol=1e-5, atol=1e-5)
            assert torch.equal(flat, results[0][1][step][2]), "replicas must get identical bits"
            # EF invariant: decompressed = the average approximation (dense blocks: sent exactly).
            decompressed = torch.where(compressed, flat / p, corrected)
            torch.testing.assert_close(decompressed + residual, corrected, rtol=0, atol=1e-6)
            assert not residual[~compressed].any() and residual[compressed].abs().max() > 1e-3
    stats = results[0][1][0][3]
    sizes = 6 * 2 + 5 * 2 + 4 * 2 + 12 * 2 + 5 + 3    # P: 6x2, 4x2 + dense; Q: 5x2, 12x2
    assert stats.wire_bytes == pytest.approx(2 * (p - 1) / p * 4 * sizes, abs=16)
    assert stats.ratio > 1.0


def _full_rank_worker(rank, p):
    psgd = PowerSGD(rank=64)  # >= every matrix's smaller side: nothing is compressed
    psgd.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    flat, ref = grad_of(rank, 0), grad_of(rank, 0)
    psgd.reduce(flat, None)
    dist.all_reduce(ref)
    return flat, ref


@pytest.mark.timeout(120)
def test_powersgd_sends_dense_what_would_not_shrink_and_then_equals_allreduce():
    for flat, ref in run_workers(_full_rank_worker, 2):
        torch.testing.assert_close(flat, ref, rtol=0, atol=1e-5)


# --- in-ring error feedback ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_inring_local_decode_is_the_ring_chunk_encode_and_invariant_holds(name):
    comp = get_compressor(name, error_feedback=True)
    red = InRing(comp)
    x = grad_of(0, 0)
    decoded = red.local_decode(x, 3)
    chunk = x[: (NUMEL + 2) // 3]                 # rank 0's first ring hop sends chunk 0 encoded
    payload, ctx = comp.compress(chunk)
    assert torch.equal(decoded[: chunk.numel()], comp.decompress(payload, ctx))
    red.memory.update(x, decoded)
    torch.testing.assert_close(decoded + red.memory.residual, x, rtol=0, atol=1e-7)
    assert red.memory.residual.abs().max() > 0


def _inring_worker(rank, p, name):
    comp = get_compressor(name, error_feedback=True)
    red = InRing(comp)
    red.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    out = []
    for step in range(2):
        flat = grad_of(rank, step)
        corrected = flat + (red.memory.residual if red.memory.residual is not None else 0)
        expected = corrected.clone()
        ring_allreduce(expected, comp)             # what the plain ring does with the corrected input
        red.reduce(flat, None)
        out.append((flat, expected, corrected - red.local_decode(corrected, p), red.memory.residual.clone()))
    return out


@pytest.mark.timeout(120)
def test_inring_error_feedback_rides_the_unchanged_ring():
    for step_results in run_workers(_inring_worker, 2, "int8"):
        for flat, expected, residual_ref, residual in step_results:
            assert torch.equal(flat, expected)
            assert torch.equal(residual, residual_ref)


def test_error_feedback_flag_is_off_by_default_and_validated():
    assert InRing(get_compressor("int8")).memory is None
    with pytest.raises(ValueError, match="error_feedback must be true or false"):
        get_compressor("bf16", error_feedback="yes")
    with pytest.raises(ValueError, match=r"compressor.ratio=0.*\(0, 1\]"):
        TopK(ratio=0)
    with pytest.raises(ValueError, match=r"compressor.rank=0"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="allowed: .*int8.*powersgd.*topk"):
        resolve("gzip")


# --- the engine: residuals in checkpoints ---------------------------------------------------------

def _resume_worker(rank, p, compressor):
    return [_train_with_split(rank, compressor, split_at) for split_at in (None, 7)]


def _train_with_split(rank, compressor, split_at):
    def make(spec):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        return model, opt, PipeSGD(opt, model.parameters(), width=2, compressor=resolve(spec))

    model, opt, engine = make(compressor)
    ratios = []
    for t in range(STEPS):
        if t == split_at:
            state = copy.deepcopy((model.state_dict(), opt.state_dict(), engine.state_dict()))
            assert state[2]["reduction"]["residual"].numel() == engine._reducer.numel
            engine.close()
            model, opt, engine = make(compressor)
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
            engine.load_state_dict(state[2])
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        stats = engine.step()
        if stats.applied:
            ratios.append(stats.comm.ratio)
    engine.flush()
    engine.close()
    return flat_params(model), ratios


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compressor", ["topk", "powersgd"])
def test_residuals_are_checkpointed_and_resume_is_exact(compressor):
    (straight, resumed), (straight1, _) = run_workers(_resume_worker, 2, compressor)
    assert torch.equal(straight[0], resumed[0])
    assert min(straight[1]) > 1.0, "the engine reports the measured compression ratio per step"
    assert torch.equal(straight[0], straight1[0]), "replicas stay identical"


def test_inring_error_feedback_with_the_native_cast_feeds_back_the_cast_error():
    from pipesgd.comm import native_allreduce

    red = InRing(get_compressor("bf16", error_feedback=True))
    red.bind(SHAPES, native_allreduce, torch.device("cpu"))
    x = grad_of(0, 0)
    assert torch.equal(red.local_decode(x, 2), x.to(torch.bfloat16).float())


# --- a zeroed share (trainer.mode=live: a healer's stale gradient) -------------------------------

def _zeroed_share_worker(rank, p, name):
    """One reduction over all three ranks; then rank 2's share zeroed (``zeroed=True``,
    ``contributors=2``) beside the same reduction over ranks 0 and 1 alone, from the same state."""
    reduction = {"topk": lambda: TopK(ratio=0.2), "powersgd": lambda: PowerSGD(rank=1),  # rank 1: both matrices
                 "int8-ef": lambda: InRing(get_compressor("int8", error_feedback=True))}[name]()
    reduction.bind(SHAPES, ring_allreduce, torch.device("cpu"))
    pair = dist.new_group([0, 1])
    reduction.reduce(grad_of(rank, 0), None)
    before = copy.deepcopy(reduction.state_dict())
    alone = copy.deepcopy(reduction)
    flat = torch.zeros(NUMEL) if rank == 2 else grad_of(rank, 1)
    theirs = flat.clone()
    reduction.reduce(flat, None, zeroed=rank == 2, contributors=2)
    if rank < 2:
        alone.reduce(theirs, pair)
    return flat, before, reduction.state_dict(), theirs, alone.state_dict()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["topk", "powersgd", "int8-ef"])
def test_a_zeroed_share_reaches_the_sum_as_zeros_and_keeps_its_residual(name):
    """What the live engine relies on: a healer's zeroed share neither adds its residual nor
    changes it, and the others' result, residuals and PowerSGD's warm start are theirs without
    it (PowerSGD's average over the 2 contributors, not the 3 ranks): bit for bit against the
    reduction over the two of them alone (top-k gathers; PowerSGD sums two values and zeros).
    The int8 ring re-encodes partial sums hop by hop, so 3 hops are not 2: there the result is
    the same on every rank and the contributors' residuals are their own encode errors."""
    got = run_workers(_zeroed_share_worker, 3, name)
    flats = [g[0] for g in got]
    assert all(torch.equal(f, flats[0]) for f in flats)
    healer_before, healer_after = got[2][1], got[2][2]
    assert torch.equal(healer_before["residual"], healer_after["residual"])  # neither added nor changed
    if name == "int8-ef":
        ring = InRing(get_compressor("int8", error_feedback=True))
        ring.bind(SHAPES, ring_allreduce, torch.device("cpu"))
        for rank in (0, 1):
            corrected = grad_of(rank, 1) + got[rank][1]["residual"]
            assert torch.equal(got[rank][2]["residual"], corrected - ring.local_decode(corrected, 3))
        return
    for rank in (0, 1):
        _, _, state, alone_flat, alone_state = got[rank]
        assert torch.equal(flats[rank], alone_flat)
        assert torch.equal(state["residual"], alone_state["residual"])
    if name == "powersgd":
        assert all(torch.equal(a, b) for a, b in zip(got[2][2]["q"], got[1][4]["q"]))  # from the summed values
