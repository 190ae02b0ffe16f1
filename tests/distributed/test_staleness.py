"""Staleness strategies against hand-computed updates.

``none`` must be the plain stale rule bit for bit (torch.equal against the reference loop of
test_engine, itself the rule of the core engine). Each compensation is checked on a model with a
closed-form gradient: one weight vector w, loss_t = 0.5·Σ a_t⊙(w - c_t)², gradient a_t⊙(w - c_t).
"""

import copy

import pytest
import torch
from torch import nn

from distributed_utils import run_workers
from pipesgd import PipeSGD
from pipesgd.registry import registry
from pipesgd.staleness import available, make_staleness
from engine_reference import LR, MOMENTUM, STEPS, flat_params, loss_of, make_model, reference

# every registered rule for per-step gradients (eager, the outer step's, is tests/distributed/test_diloco.py's)
COMPENSATIONS = [name for name in available() if name != "none"
                 and registry("staleness").facts(name)["sync_period"] != "round"]

ETA, LAMBDA = 0.1, 0.5


def data(rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + t)
    return torch.rand(4, generator=g, dtype=torch.float64) + 0.5, torch.randn(4, generator=g, dtype=torch.float64)


def grad(w: torch.Tensor, rank: int, t: int) -> torch.Tensor:
    a, c = data(rank, t)
    return a * (w - c)


class Quadratic(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64))

    def loss(self, rank: int, t: int) -> torch.Tensor:
        a, c = data(rank, t)
        return 0.5 * (a * (self.w - c) ** 2).sum()


def run_engine(staleness, steps=4, width=2, momentum=0.0, rank=0, trace=None):
    """Train Quadratic through PipeSGD; ``trace`` collects the weights each gradient was taken at."""
    model = Quadratic()
    opt = torch.optim.SGD(model.parameters(), lr=ETA, momentum=momentum)
    engine = PipeSGD(opt, model.parameters(), width=width, staleness=staleness)
    for t in range(steps):
        opt.zero_grad()
        before = model.w.detach().clone()
        with engine.forward_context():
            if trace is not None:
                trace.append(model.w.detach().clone())
            model.loss(rank, t).backward()
        assert torch.equal(model.w.detach(), before), "the forward context must restore the weights exactly"
        engine.step()
    engine.flush()
    return model.w.detach(), engine


# --- none: the plain rule, bit for bit -------------------------------------------------------------

@pytest.mark.parametrize("width,warm", [(1, 0), (2, 0), (3, 0), (2, 5)])
def test_none_is_the_plain_rule_bit_for_bit(width, warm):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine = PipeSGD(opt, model.parameters(), width=width, warmup_sync_steps=warm, staleness="none")
    for t in range(STEPS):
        opt.zero_grad()
        with engine.forward_context():
            loss_of(model, 0, t).backward()
        engine.step()
    engine.flush()
    assert torch.equal(flat_params(model), reference(1, width, warmup_sync_steps=warm))


def _two_rank_plain(rank, p, staleness):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    with PipeSGD(opt, model.parameters(), width=2, staleness=staleness) as engine:
        for t in range(STEPS):
            opt.zero_grad()
            with engine.forward_context():
                loss_of(model, rank, t).backward()
            engine.step()
        engine.flush()
    return flat_params(model)


@pytest.mark.timeout(120)
def test_none_is_the_plain_rule_bit_for_bit_on_two_ranks():
    """p = 2: the ring's one addition a+b then /2 is exactly the reference's (a+b)/2."""
    expected = reference(2, 2)
    for params in run_workers(_two_rank_plain, 2, "none"):
        assert torch.equal(params, expected)


@pytest.mark.parametrize("name", COMPENSATIONS)  # every registered rule, so a new one is tested too
def test_every_compensation_is_the_plain_rule_at_width_1(name):
    """Synchronous steps have no staleness: w_now = w_then, nothing to extrapolate, nothing pending."""
    plain, _ = run_engine("none", steps=6, width=1, momentum=0.9)
    ours, _ = run_engine(name, steps=6, width=1, momentum=0.9)
    if name in ("dga", "lookahead"):
        assert torch.equal(ours, plain)
    else:
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-15)


# --- dc ------------------------------------------------------------------------------------------

def test_dc_against_hand_computed_update():
    """Width 2, plain SGD: the gradient taken at w_then is corrected to w_now before it is applied."""
    w0 = Quadratic().w.detach().clone()
    g0 = grad(w0, 0, 0)                       # step 0: launched at w0, nothing applied
    g1 = grad(w0, 0, 1)                       # step 1: launched at w0; g0 applied (w_now = w_then = w0)
    w1 = w0 - ETA * g0
    g2 = grad(w1, 0, 2)                       # step 2: launched at w1; g1 applied, taken at w0
    w2 = w1 - ETA * (g1 + LAMBDA * g1 * g1 * (w1 - w0))
    g3 = grad(w2, 0, 3)                       # step 3: launched at w2; g2 applied, taken at w1
    w3 = w2 - ETA * (g2 + LAMBDA * g2 * g2 * (w2 - w1))
    w4 = w3 - ETA * (g3 + LAMBDA * g3 * g3 * (w3 - w2))   # flush: g3, taken at w2
    ours, _ = run_engine(make_staleness("dc", dc_lambda=LAMBDA))
    torch.testing.assert_close(ours, w4, rtol=0, atol=1e-12)
    plain, _ = run_engine("none")
    assert (plain - w4).abs().max() > 1e-4, "the correction must matter in this test"


def test_dc_adaptive_scales_lambda_by_the_mean_square():
    m = 0.5
    w0 = Quadratic().w.detach().clone()
    g0, g1 = grad(w0, 0, 0), grad(w0, 0, 1)
    ms = g0 * g0                               # first average: the mean square starts at g⊙g
    w1 = w0 - ETA * g0                         # w_now = w_then: no correction
    g2 = grad(w1, 0, 2)
    ms = m * ms + (1 - m) * g1 * g1
    w2 = w1 - ETA * (g1 + LAMBDA * g1 * g1 / (ms + 1e-12).sqrt() * (w1 - w0))
    ours, _ = run_engine(make_staleness("dc", dc_lambda=LAMBDA, dc_adaptive=True, dc_momentum=m), steps=3)
    # run_engine(steps=3) flushes g2 too: one more corrected update, taken at w1.
    ms = m * ms + (1 - m) * g2 * g2
    w3 = w2 - ETA * (g2 + LAMBDA * g2 * g2 / (ms + 1e-12).sqrt() * (w2 - w1))
    torch.testing.assert_close(ours, w3, rtol=0, atol=1e-12)


# --- predict -------------------------------------------------------------------------------------

def test_predict_against_hand_computed_update():
    """Width 2, momentum SGD: gradients are taken at w_t + (w_t - w_{t-1}), applied to w_t."""
    mu = 0.9
    w0 = Quadratic().w.detach().clone()
    trace = []
    ours, _ = run_engine("predict", steps=4, momentum=mu, trace=trace)

    at = [w0, w0]                              # step 0: delay 0; step 1: nothing applied yet
    g = [grad(w0, 0, 0), grad(w0, 0, 1)]
    v = g[0].clone()                           # torch SGD: first momentum buffer = the gradient
    w1 = w0 - ETA * v                          # step 1 applies g0
    at.append(w1 + (w1 - w0))                  # step 2 forward, one update ahead
    g.append(grad(at[2], 0, 2))
    v = mu * v + g[1]
    w2 = w1 - ETA * v                          # step 2 applies g1
    at.append(w2 + (w2 - w1))
    g.append(grad(at[3], 0, 3))
    v = mu * v + g[2]
    w3 = w2 - ETA * v                          # step 3 applies g2
    v = mu * v + g[3]
    w4 = w3 - ETA * v                          # flush applies g3
    for mine, hand in zip(trace, at):
        torch.testing.assert_close(mine, hand, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours, w4, rtol=0, atol=1e-12)


# --- dga -----------------------------------------------------------------------------------------

def _dga_worker(rank, p, momentum, steps):
    """Run dga on Quadratic; per step: working weights and consistent weights."""
    model = Quadratic()
    opt = torch.optim.SGD(model.parameters(), lr=ETA, momentum=momentum)
    working, consistent = [], []
    with PipeSGD(opt, model.parameters(), width=2, staleness="dga") as engine:
        for t in range(steps):
            opt.zero_grad()
            with engine.forward_context():
                model.loss(rank, t).backward()
            engine.step()
            working.append(model.w.detach().clone())
            consistent.append(engine.consistent_params())
            with engine.consistent_weights():
                assert torch.equal(model.w.detach(), consistent[-1])
            assert torch.equal(model.w.detach(), working[-1]), "consistent_weights() must restore exactly"
        engine.flush()
    return working, consistent, model.w.detach().clone()


@pytest.mark.timeout(120)
def test_dga_against_the_dga_rule_and_replicas_agree_on_consistent_weights():
    """Plain SGD, width 2: w_{t+1} = w_t - η(g_t - g_{t-1} + ḡ_{t-1}) on each rank."""
    steps, p = 4, 2
    results = run_workers(_dga_worker, p, 0.0, steps)
    w = [Quadratic().w.detach().clone() for _ in range(p)]
    prev = [torch.zeros(4, dtype=torch.float64) for _ in range(p)]
    prev_avg = torch.zeros(4, dtype=torch.float64)
    expected = []
    for t in range(steps):
        g = [grad(w[r], r, t) for r in range(p)]
        w = [w[r] - ETA * (g[r] - prev[r] + prev_avg) for r in range(p)]
        prev, prev_avg = g, sum(g) / p
        expected.append(w)
    final = [w[r] + ETA * prev[r] - ETA * prev_avg for r in range(p)]  # flush swaps the last step
    for r, (working, consistent, last) in enumerate(results):
        for t in range(steps):
            torch.testing.assert_close(working[t], expected[t][r], rtol=0, atol=1e-12)
        torch.testing.assert_close(last, final[r], rtol=0, atol=1e-12)
    for t in range(steps):
        assert torch.equal(results[0][1][t], results[1][1][t]), f"consistent weights differ at step {t}"
    assert not torch.equal(results[0][0][1], results[1][0][1]), "working weights differ by the local step"
    assert torch.equal(results[0][2], results[1][2]), "after flush the replicas are identical"


@pytest.mark.timeout(120)
def test_dga_with_momentum_follows_the_documented_definition():
    """Momentum acts on averages at the consistent weights; the local step is -η·g (no momentum)."""
    mu, steps, p = 0.9, 4, 2
    results = run_workers(_dga_worker, p, mu, steps)
    base = Quadratic().w.detach().clone()        # w̄
    v = None
    local = [None] * p                           # pending -η·g_t^local per rank
    for t in range(steps):
        working = [base if local[r] is None else base + local[r] for r in range(p)]
        g = [grad(working[r], r, t) for r in range(p)]
        if t >= 1:                               # apply ḡ_{t-1} to w̄
            avg = sum(prev) / p
            v = avg.clone() if v is None else mu * v + avg
            base = base - ETA * v
        local = [-ETA * g[r] for r in range(p)]
        prev = g
        for r in range(p):
            torch.testing.assert_close(results[r][1][t], base, rtol=0, atol=1e-12)
            torch.testing.assert_close(results[r][0][t], base + local[r], rtol=0, atol=1e-12)


# --- lookahead -----------------------------------------------------------------------------------

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM, weight_decay=1e-3, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),  # state includes a step count
}


def _one_rank(width, staleness, warm=0, optimizer="sgd"):
    """make_model trained on rank 0's data; per step the weights the forward saw, and the final
    weights and optimizer state."""
    model = make_model()
    opt = OPTIMIZERS[optimizer](model.parameters())
    engine = PipeSGD(opt, model.parameters(), width=width, staleness=staleness, warmup_sync_steps=warm)
    seen = []
    for t in range(STEPS):
        opt.zero_grad()
        before = flat_params(model)
        with engine.forward_context():
            seen.append(flat_params(model))
            loss_of(model, 0, t).backward()
        assert torch.equal(flat_params(model), before), "the forward context must restore the weights exactly"
        engine.step()
    engine.flush()
    return seen, flat_params(model), opt.state_dict()


@pytest.mark.parametrize("width,warm,optimizer", [(2, 0, "sgd"), (3, 0, "sgd"), (3, 4, "sgd"), (2, 0, "adam")])
def test_lookahead_on_one_rank_is_synchronous_training_bit_for_bit(width, warm, optimizer):
    """With one rank the local gradient IS the average, so every forward sees exactly the weights
    its gradient will be applied to: the run is synchronous training, step for step and bit for bit
    (the lookahead steps must also leave the optimizer state exactly as it was)."""
    sync_seen, sync_final, sync_opt = _one_rank(1, "none", optimizer=optimizer)
    seen, final, opt = _one_rank(width, "lookahead", warm, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(seen, sync_seen))
    assert torch.equal(final, sync_final)
    assert opt["state"].keys() == sync_opt["state"].keys()
    for a, b in zip(opt["state"].values(), sync_opt["state"].values()):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    _, plain, _ = _one_rank(width, "none", warm, optimizer)
    assert (plain - sync_final).abs().max() > 1e-3, "staleness must matter in this test"


def _lookahead_worker(rank, p, steps):
    model = Quadratic()
    opt = torch.optim.SGD(model.parameters(), lr=ETA, momentum=0.9)
    seen = []
    with PipeSGD(opt, model.parameters(), width=2, staleness="lookahead") as engine:
        for t in range(steps):
            opt.zero_grad()
            with engine.forward_context():
                seen.append(model.w.detach().clone())
                model.loss(rank, t).backward()
            engine.step()
        engine.flush()
    return seen, model.w.detach().clone()


@pytest.mark.timeout(120)
def test_lookahead_against_hand_computed_update_on_two_ranks():
    """Width 2, momentum SGD (v <- μv + g, w <- w - ηv): rank r computes step t's gradient at
    w_t - η(μ v_t + g_{t-1}^r), the step the optimizer will take with the average, taken with its own
    gradient instead; the weights themselves follow the plain stale rule on every rank."""
    mu, steps, p = 0.9, 5, 2
    results = run_workers(_lookahead_worker, p, steps)
    w, v = Quadratic().w.detach().clone(), None
    seen = [[] for _ in range(p)]
    prev = None                                  # per rank: g_{t-1}^r, in flight during step t
    for t in range(steps):
        at = [w if prev is None else w - ETA * (prev[r] if v is None else mu * v + prev[r]) for r in range(p)]
        g = [grad(at[r], r, t) for r in range(p)]
        for r in range(p):
            seen[r].append(at[r])
        if prev is not None:                     # step t applies the average of step t-1
            avg = sum(prev) / p
            v = avg.clone() if v is None else mu * v + avg
            w = w - ETA * v
        prev = g
    avg = sum(prev) / p                          # flush
    w = w - ETA * (mu * v + avg)
    for r, (mine, last) in enumerate(results):
        for t in range(steps):
            torch.testing.assert_close(mine[t], seen[r][t], rtol=0, atol=1e-12)
        torch.testing.assert_close(last, w, rtol=0, atol=1e-12)
    assert not torch.equal(results[0][0][2], results[1][0][2]), "each rank looks ahead with its own gradient"
    assert torch.equal(results[0][1], results[1][1]), "the weights themselves stay identical"


# --- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", COMPENSATIONS)  # every registered rule, so a new one is tested too
def test_state_dict_round_trip_resumes_exactly(name):
    """Stop mid-pipeline (width 3: two steps in flight), restore into fresh objects: identical."""
    def run(split_at=None):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        engine = PipeSGD(opt, model.parameters(), width=3, staleness=name)
        for t in range(STEPS):
            if t == split_at:
                state = copy.deepcopy((model.state_dict(), opt.state_dict(), engine.state_dict()))
                model = make_model()
                opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
                engine = PipeSGD(opt, model.parameters(), width=3, staleness=name)
                model.load_state_dict(state[0])
                opt.load_state_dict(state[1])
                engine.load_state_dict(state[2])
            opt.zero_grad()
            with engine.forward_context():
                loss_of(model, 0, t).backward()
            engine.step()
        engine.flush()
        return flat_params(model)

    assert torch.equal(run(), run(split_at=7))


def test_unknown_staleness_and_bad_lambda_name_the_value():
    with pytest.raises(ValueError, match="staleness='late'.*allowed: none, damped, dc, eager, delayed_nesterov, dga, lookahead, predict"):
        make_staleness("late")
    with pytest.raises(ValueError, match=r"staleness.dc_lambda=-1.*>= 0"):
        make_staleness("dc", dc_lambda=-1)


def test_the_outer_rule_is_refused_on_per_step_gradients():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"staleness=eager applies only the outer step of rounds; run it with "
                                         r"sync_every > 1"):
        PipeSGD(opt, model.parameters(), width=2, staleness="eager")
