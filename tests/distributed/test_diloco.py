"""The period-H engine (PipeDiLoCo) against single-process references of its rules: blocking DiLoCo,
the pipelined outer step under ``none`` and ``eager``, H = 1 against synchronous SGD and Pipe-SGD,
int8 in the ring within its rounding, streaming fragments, the average landing ``sync_delay`` steps
after its launch, and resume mid-round and mid-flight bit for bit."""

from functools import partial

import pytest
import torch

from diloco_reference import INNER, OUTER, diloco_reference
from distributed_utils import run_workers
from engine_reference import STEPS, flat_params, loss_of, make_model, reference
from pipesgd.engine.diloco import PipeDiLoCo

H = 3  # 20 steps: six whole rounds and a partial one that flush() ends


def _run(rank, p, sync_every, width, rule, compressor="none", outer=OUTER, steps=STEPS):
    model = make_model()
    opt = INNER(model.parameters())
    with PipeDiLoCo(opt, model.parameters(), sync_every, width=width, outer_optimizer=outer, staleness=rule,
                    compressor=compressor, allreduce="ring") as engine:
        comm = []
        for t in range(steps):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            stats = engine.step()
            assert stats.applied
            comm.append(stats.comm.wire_bytes > 0)
        engine.flush()
        assert engine.in_flight == 0
    return flat_params(model), comm


@pytest.mark.timeout(180)
@pytest.mark.parametrize("width,rule", [(1, "none"), (2, "none"), (2, "eager"), (3, "none")])
def test_period_h_equals_reference(width, rule):
    expected = diloco_reference(2, H, width, STEPS, rule)
    results = run_workers(_run, 2, H, width, rule)
    for rank, (params, comm) in enumerate(results):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
        # bytes move once per round only: at the ends of rounds whose average was applied then
        assert not any(c for t, c in enumerate(comm) if (t + 1) % H), "an exchange outside a round's end"
    if rule == "none":
        assert torch.equal(results[0][0], results[1][0]), "replicas differ under staleness=none"
    else:  # each eager replica's own fresh terms went through its outer momentum: replicas differ
        assert not torch.equal(results[0][0], results[1][0])
    # the rules really differ from each other and from blocking DiLoCo (the comparisons can fail)
    blocking = diloco_reference(2, H, 1, STEPS, "none")[0]
    if width > 1:
        assert (blocking - expected[0]).abs().max() > 1e-4


def test_eager_differs_from_none():
    assert (diloco_reference(2, H, 2, STEPS, "eager")[0] - diloco_reference(2, H, 2, STEPS, "none")[0]).abs().max() > 1e-4


@pytest.mark.timeout(180)
def test_h1_with_plain_outer_step_is_synchronous_sgd_and_pipe_sgd():
    """An outer SGD step of lr 1 without momentum on one inner SGD-momentum step per round: at
    width 1 the average of the inner steps is synchronous SGD's step (momentum and weight decay
    are linear), at width 2 under ``none`` it is Pipe-SGD's width-2 rule with staleness=none."""
    plain = partial(torch.optim.SGD, lr=1.0)
    for width in (1, 2):
        results = run_workers(_run, 2, 1, width, "none", "none", plain)
        for params, _ in results:
            assert (params - reference(2, width)).abs().max() <= 1e-6, f"width {width}"


def _int8_round(rank, p):
    """One round at width 1 with a plain outer step: the anchor moves by the averaged pseudo-gradient."""
    model = make_model()
    opt = INNER(model.parameters())
    start = flat_params(model)
    with PipeDiLoCo(opt, model.parameters(), H, width=1, outer_optimizer=partial(torch.optim.SGD, lr=1.0),
                    compressor="int8", allreduce="ring") as engine:
        for t in range(H):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            engine.step()
        stats = engine.last
    return start - flat_params(model), stats.comm.wire_bytes, stats.comm.raw_bytes


@pytest.mark.timeout(120)
def test_int8_in_the_ring_on_pseudo_gradients_within_its_rounding():
    """int8 rounds each value to within max|block|/254 per encoding; a p=2 ring encodes a chunk on
    the reduce-scatter hop and its sum on the all-gather hop: within 2 x max|Δ| / 254 of the exact average."""
    models = [make_model() for _ in range(2)]
    deltas = []
    for m, model in enumerate(models):
        opt = INNER(model.parameters())
        start = flat_params(model)
        for t in range(H):
            opt.zero_grad()
            loss_of(model, m, t).backward()
            opt.step()
        deltas.append(start - flat_params(model))
    exact = sum(deltas) / 2
    bound = 2 * max(d.abs().max() for d in deltas).item() / 254
    for moved, wire, raw in run_workers(_int8_round, 2):
        err = (moved - exact).abs().max().item()
        assert err <= bound, f"int8 average off by {err:.3g} > {bound:.3g}"
        assert err > 0, "int8 carried the pseudo-gradient exactly: was it compressed at all?"
        assert wire < raw / 3, "int8 should send about a quarter of fp32's bytes"


def _resume(rank, p, width, rule, stop, fragments=1, h=H, delay=0):
    """Train to ``stop``, save every part of the state, rebuild everything and continue to STEPS."""
    return _run_warm(rank, p, h, width, rule, 0, fragments, delay, stop=stop, steps=STEPS)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("width,rule,stop,fragments,h,delay", [
    (2, "eager", 7, 1, H, 0), (2, "none", 10, 1, H, 0), (1, "none", 4, 1, H, 0), (2, "eager", 7, 2, 4, 0),
    (2, "eager", 9, 1, 4, 2), (2, "none", 8, 2, 4, 1)])
def test_resume_mid_round_and_mid_flight_is_bit_exact(width, rule, stop, fragments, h, delay):
    """stop=7 and 4: inside a round (in_round 1) with, at width 2, a round in flight; 10: also;
    with two fragments of rounds of 4, step 7 is inside both fragments' rounds, both in flight;
    rounds of 4 landing 2 steps late: step 9 is after round 2's launch (8) and before it lands (10);
    two fragments landing a step late under none: fragment 1, launched at step 8, trains on from its
    weights there, which the checkpoint after step 8 holds."""
    resumed = run_workers(_resume, 2, width, rule, stop, fragments, h, delay)
    uninterrupted = run_workers(_resume, 2, width, rule, STEPS + 1, fragments, h, delay)
    for a, b in zip(resumed, uninterrupted):
        assert torch.equal(a, b)


def test_refusals_name_their_option():
    model = make_model()
    opt = INNER(model.parameters())
    with pytest.raises(ValueError, match="staleness=eager .* needs width 2, got width 1"):
        PipeDiLoCo(opt, model.parameters(), H, width=1, staleness="eager")
    with pytest.raises(ValueError, match="staleness=lookahead is a rule for per-step gradients"):
        PipeDiLoCo(opt, model.parameters(), H, width=2, staleness="lookahead")
    with pytest.raises(ValueError, match="sync_every=0 is invalid: must be an integer >= 1"):
        PipeDiLoCo(opt, model.parameters(), 0)


def test_inner_optimizer_is_the_engines():
    model = make_model()
    opt = INNER(model.parameters())
    engine = PipeDiLoCo(opt, model.parameters(), H)
    loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="call engine.step"):
        opt.step()
    engine.close()
    opt.step()  # released


def test_lone_process_runs_the_same_rule():
    for width, rule in ((1, "none"), (2, "eager")):
        params, _ = _run(0, 1, H, width, rule)
        assert (params - diloco_reference(1, H, width, STEPS, rule)[0]).abs().max() <= 1e-6


def test_sync_every_1_is_todays_engine_and_config():
    """The default builds today's PipeSGD with no outer optimizer, and the config digest a run had
    before sync_every existed (its keys are dropped at 1), so old checkpoints still resume."""
    from pipesgd.reliability.checkpoint import hashed_config
    from pipesgd.engine import ModeArgs
    from pipesgd.engine.build import build
    from pipesgd.engine.pipe import PipeSGD

    model = make_model()
    args = dict(model=model, optimizer=INNER(model.parameters()), width=2, compressor="none", allreduce="ring",
                group=None, world_size=1, warmup_sync_steps=0, device=torch.device("cpu"))
    _, engine = build("pipe", ModeArgs(**args))
    assert type(engine) is PipeSGD
    engine.close()
    _, engine = build("pipe", ModeArgs(**args, sync_every=4, outer_optimizer=OUTER))
    assert type(engine) is PipeDiLoCo and engine.sync_every == 4
    engine.close()
    old = {"trainer": {"mode": "pipe", "width": 2}, "optimizer": {"lr": 0.1}}
    new = {"trainer": {"mode": "pipe", "width": 2, "sync_every": 1}, "optimizer": {"lr": 0.1},
           "outer_optimizer": {"_target_": "torch.optim.SGD", "lr": 0.7}}
    assert hashed_config(new) == hashed_config(old)
    assert hashed_config({**new, "trainer": {**new["trainer"], "sync_every": 4}}) != hashed_config(old)


def _elastic(rank, world, saved):
    """Ranks of a 3-rank world load a 2-rank run's step-7 state as an elastic resume does (a new
    rank takes a surviving rank's per-rank state through state_for_new_rank) and train on."""
    from pipesgd.reliability.elastic import rank_state

    model = make_model()
    opt = INNER(model.parameters())
    engine = PipeDiLoCo(opt, model.parameters(), H, width=2, allreduce="ring")
    shared = {k: saved[0][k] for k in engine.shared_state}
    ranks = [{"engine": {k: v for k, v in s.items() if k not in engine.shared_state}} for s in saved]
    mine = rank_state(ranks, rank, engine.state_for_new_rank)
    engine.load_state_dict({**mine["engine"], **shared})
    for t in range(7, STEPS):
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        engine.step()
    engine.flush()
    engine.check_replicas()  # the anchors agree on the new world (none)
    engine.close()
    return flat_params(model), mine.get("new_rank", False)


def _saved_states(rank, world):
    model = make_model()
    opt = INNER(model.parameters())
    with PipeDiLoCo(opt, model.parameters(), H, width=2, allreduce="ring", outer_optimizer=OUTER) as engine:
        for t in range(7):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            engine.step()
        return engine.state_dict()


@pytest.mark.timeout(180)
def test_elastic_resume_onto_more_ranks():
    saved = run_workers(_saved_states, 2)
    out = run_workers(_elastic, 3, saved)
    assert [new for _, new in out] == [False, False, True]
    assert torch.equal(out[0][0], out[2][0]) and torch.equal(out[0][0], out[1][0])


def _run_fragments(rank, p, width, rule):
    model = make_model()
    opt = INNER(model.parameters())
    with PipeDiLoCo(opt, model.parameters(), 4, width=width, staleness=rule, allreduce="ring",
                    fragments=2, outer_optimizer=OUTER) as engine:
        sent = []
        for t in range(STEPS + 1):  # 21 steps: both fragments end on a partial round
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            sent.append(engine.step().comm.raw_bytes)
        engine.flush()
    return flat_params(model), sent


@pytest.mark.timeout(180)
@pytest.mark.parametrize("width,rule", [(1, "none"), (2, "none"), (2, "eager")])
def test_streaming_fragments_equal_their_reference(width, rule):
    """Two fragments of the test model (its first weight, 320 values; the rest, 131), rounds of 4:
    fragment 0 ends rounds at steps 2, 6, 10, ..., fragment 1 at 4, 8, 12, ..., each pipelined."""
    from pipesgd.engine.diloco import split

    assert [len(f) for f in split(list(make_model().parameters()), 2)] == [1, 3]
    expected = diloco_reference(2, 4, width, STEPS + 1, rule, fragments=[1, 3])
    whole = diloco_reference(2, 4, width, STEPS + 1, rule)
    for rank, (params, sent) in enumerate(run_workers(_run_fragments, 2, width, rule)):
        assert (params - expected[rank]).abs().max() <= 1e-6
        # a fragment's bytes at the steps its average lands: alternately the first weight's and the rest's
        lands = [s for s in sent if s]
        assert len(set(lands)) == 2 and all(a != b for a, b in zip(lands, lands[1:]))
    assert (expected[0] - whole[0]).abs().max() > 1e-4, "streaming differs from the whole-model rounds"


def _run_delayed(rank, p, h, fragments, delay, rule, outer=OUTER):
    model = make_model()
    opt = INNER(model.parameters())
    with PipeDiLoCo(opt, model.parameters(), h, width=2, staleness=rule, allreduce="ring", fragments=fragments,
                    sync_delay=delay, outer_optimizer=outer) as engine:
        sent = []
        for t in range(STEPS + 1):
            opt.zero_grad()
            loss_of(model, rank, t).backward()
            sent.append(engine.step().comm.raw_bytes)
        engine.flush()
        assert engine.summary()["sync_delay"] == delay
    return flat_params(model), sent


@pytest.mark.timeout(180)
@pytest.mark.parametrize("h,fragments,delay,rule", [(4, 1, 1, "none"), (4, 1, 3, "eager"), (4, 2, 1, "eager"),
                                                    (6, 2, 2, "none")])
def test_delayed_landing_equals_its_reference(h, fragments, delay, rule):
    """sync_delay: each round's average lands ``delay`` steps after its launch (its bytes counted
    there), the weights keep the steps trained since; the reference does the same in one process."""
    sizes = [1, 3] if fragments == 2 else None
    expected = diloco_reference(2, h, 2, STEPS + 1, rule, fragments=sizes, delay=delay)
    period = h // fragments
    for rank, (params, sent) in enumerate(run_workers(_run_delayed, 2, h, fragments, delay, rule)):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
        landed = [t + 1 for t, s in enumerate(sent) if s]
        assert landed and all((t - delay) % period == 0 for t in landed), landed
    # landing early differs from landing a round late, and from blocking rounds
    assert (expected[0] - diloco_reference(2, h, 2, STEPS + 1, rule, fragments=sizes)[0]).abs().max() > 1e-4
    assert (expected[0] - diloco_reference(2, h, 1, STEPS + 1, "none", fragments=sizes)[0]).abs().max() > 1e-4


@pytest.mark.timeout(180)
def test_delayed_eager_with_plain_outer_step_keeps_the_steps_since_launch():
    """A plain outer step (lr 1): a landed round moves the anchor by minus the average under either
    rule (eager's own part early, the rest at the landing), so after the flush the replicas agree
    under eager too; eager and none still differ, by the gradients the early own step changed."""
    plain = partial(torch.optim.SGD, lr=1.0)
    eager = run_workers(_run_delayed, 2, 4, 1, 2, "eager", plain)
    none = run_workers(_run_delayed, 2, 4, 1, 2, "none", plain)
    for (a, _), (b, _) in zip(eager, none):
        assert (a - b).abs().max() > 1e-6, "eager's own early step changes the gradients after the launch"
    # own / M at the launch plus the rest at the landing is the average, up to float rounding
    assert (eager[0][0] - eager[1][0]).abs().max() <= 1e-6, "after the flush every replica holds the anchor"
    assert (eager[0][0] - diloco_reference(2, 4, 2, STEPS + 1, "eager", outer=plain, delay=2)[0]).abs().max() <= 1e-6


def test_sync_delay_refusals_name_the_value():
    model = make_model()
    opt = INNER(model.parameters())
    with pytest.raises(ValueError, match="sync_delay=1 says when .* needs width 2, got width 1"):
        PipeDiLoCo(opt, model.parameters(), 4, width=1, sync_delay=1)
    with pytest.raises(ValueError, match="sync_delay=2 must be below sync_every / fragments = 2"):
        PipeDiLoCo(opt, model.parameters(), 4, fragments=2, sync_delay=2)
    with pytest.raises(ValueError, match="sync_delay=-1 is invalid: must be an integer >= 0"):
        PipeDiLoCo(opt, model.parameters(), 4, sync_delay=-1)


def test_fragments_must_divide_the_period():
    model = make_model()
    with pytest.raises(ValueError, match="fragments=3 does not divide sync_every=4"):
        PipeDiLoCo(INNER(model.parameters()), model.parameters(), 4, fragments=3)
    with pytest.raises(ValueError, match="fragments=8 is more than the model's 4 parameter tensors"):
        PipeDiLoCo(INNER(model.parameters()), model.parameters(), 8, fragments=8)


def _run_warm(rank, p, h, width, rule, warmup, fragments=1, delay=0, alpha=None, stop=None, steps=STEPS + 1,
              layout="contiguous"):
    """``warmup`` synchronous steps, then rounds; ``stop``: save every part of the state before that
    step, rebuild everything and continue to ``steps``."""
    def build():
        model = make_model()
        opt = INNER(model.parameters())
        return model, opt, PipeDiLoCo(opt, model.parameters(), h, width=width, staleness=rule, allreduce="ring",
                                      fragments=fragments, sync_delay=delay, warmup_sync_steps=warmup,
                                      landing_alpha=alpha, fragment_layout=layout, module=model,
                                      outer_optimizer=OUTER)

    model, opt, engine = build()
    for t in range(steps):
        if t == stop:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "engine": engine.state_dict()}
            engine.close()
            model, opt, engine = build()
            model.load_state_dict(saved["model"])
            engine.load_state_dict(saved["engine"])
        opt.zero_grad()
        loss_of(model, rank, t).backward()
        engine.step()
    engine.flush()
    engine.close()
    return flat_params(model)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("h,width,rule,warmup,fragments,delay", [
    (4, 1, "none", 3, 1, 0), (4, 2, "eager", 5, 1, 0), (4, 2, "none", 6, 2, 1), (4, 2, "none", 30, 1, 0)])
def test_rounds_after_synchronous_steps_equal_their_reference(h, width, rule, warmup, fragments, delay):
    """trainer.warmup_sync_steps at sync_every > 1: that many steps of the averaged gradient (the
    replicas identical), then rounds counted from there, starting from the weights it left; a
    warm-up longer than the run is synchronous SGD throughout."""
    sizes = [1, 3] if fragments == 2 else None
    expected = diloco_reference(2, h, width, STEPS + 1, rule, fragments=sizes, delay=delay, warmup=warmup)
    for rank, params in enumerate(run_workers(_run_warm, 2, h, width, rule, warmup, fragments, delay)):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
    assert (expected[0] - diloco_reference(2, h, width, STEPS + 1, rule, fragments=sizes, delay=delay)[0]
            ).abs().max() > 1e-4, "the warm-up changes the run"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stop", [2, 9])
def test_resume_during_and_after_the_warm_up_is_bit_exact(stop):
    """A checkpoint inside the synchronous steps (2) and inside a delayed round after them (9)."""
    resumed = run_workers(_run_warm, 2, 4, 2, "none", 3, 2, 1, None, stop)
    uninterrupted = run_workers(_run_warm, 2, 4, 2, "none", 3, 2, 1)
    for a, b in zip(resumed, uninterrupted):
        assert torch.equal(a, b)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("alpha,rule", [(0.0, "none"), (0.5, "none"), (0.5, "eager"), ("auto", "none")])
def test_the_alpha_mix_at_a_landing_equals_its_reference(alpha, rule):
    """landing_alpha=α: where a round's average lands (sync_delay), θ ← α·θ + (1 − α)·anchor
    (streaming DiLoCo's merge; α = 0 drops the steps since the launch, as torchft does); "auto":
    the share that follows the replicas (pipesgd.outer.landing_alpha: 1/4 at these two)."""
    from pipesgd.outer import landing_alpha

    expected = diloco_reference(2, 4, 2, STEPS + 1, rule, delay=2, alpha=landing_alpha(2) if alpha == "auto" else alpha)
    for rank, params in enumerate(run_workers(_run_warm, 2, 4, 2, rule, 0, 1, 2, alpha)):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
    assert (expected[0] - diloco_reference(2, 4, 2, STEPS + 1, rule, delay=2)[0]).abs().max() > 1e-4


def test_warm_up_and_mix_refusals_name_the_value():
    model = make_model()
    for kwargs, match in (({"warmup_sync_steps": -1}, "warmup_sync_steps=-1 is invalid: must be an integer >= 0"),
                          ({"landing_alpha": 1.5, "sync_delay": 1}, r"landing_alpha=1.5 is invalid: must be a number in \[0, 1\]"),
                          ({"fragment_layout": "zigzag"}, "fragment_layout='zigzag' is not known"),
                          ({"landing_alpha": 0.5}, "landing_alpha=0.5 mixes the weights")):
        with pytest.raises(ValueError, match=match):
            PipeDiLoCo(INNER(model.parameters()), model.parameters(), 4, **kwargs)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rule,fragments,delay,warmup", [
    ("delayed_nesterov", 1, 0, 0), ("delayed_nesterov", 2, 1, 3), ("damped", 1, 0, 0), ("damped", 2, 1, 0)])
def test_staleness_aware_outer_steps_equal_their_reference(rule, fragments, delay, warmup):
    """delayed_nesterov: eager with the outer momentum fed the arrived average alone, the own fresh
    part a plain step of the outer rate; damped: the late average scaled by 1 / (1 + lateness),
    a round (width 2) or delay / H late. Each against the single-process reference, and each a
    different run from its parent rule (eager, none)."""
    sizes = [1, 3] if fragments == 2 else None
    expected = diloco_reference(2, 4, 2, STEPS + 1, rule, fragments=sizes, delay=delay, warmup=warmup)
    for rank, params in enumerate(run_workers(_run_warm, 2, 4, 2, rule, warmup, fragments, delay)):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
    parent = "eager" if rule == "delayed_nesterov" else "none"
    assert (expected[0] - diloco_reference(2, 4, 2, STEPS + 1, parent, fragments=sizes, delay=delay,
                                           warmup=warmup)[0]).abs().max() > 1e-4


def test_delayed_nesterov_with_a_plain_outer_step_is_eager():
    """Without momentum there is nothing for the own terms to ring in: the two rules agree."""
    plain = partial(torch.optim.SGD, lr=0.7)
    dn = diloco_reference(2, 4, 2, STEPS + 1, "delayed_nesterov", outer=plain)
    eager = diloco_reference(2, 4, 2, STEPS + 1, "eager", outer=plain)
    assert (dn[0] - eager[0]).abs().max() <= 1e-6 and (dn[1] - eager[1]).abs().max() <= 1e-6


def test_strided_fragments_deal_whole_layers_round_robin():
    """fragment_layout=strided: layer g (its parameters' names up to the first index) to fragment
    g mod F, so each fragment spans the depth; whole layers, never cut."""
    from torch import nn

    from pipesgd.engine.diloco import layer_of, split_strided

    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(6)))
    names = [n for n, _ in model.named_parameters()]
    parts = split_strided(list(model.parameters()), names, 3)
    by_name = {id(p): n for n, p in model.named_parameters()}
    assert [sorted({layer_of(by_name[id(p)]) for p in part}) for part in parts] == [["0", "3"], ["1", "4"], ["2", "5"]]
    assert layer_of("blocks.3.attn.c_attn.weight") == "blocks.3" and layer_of("wte.weight") == "wte.weight"
    with pytest.raises(ValueError, match="fragments=7 is more than the model's 6 layers"):
        split_strided(list(model.parameters()), names, 7)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("width,delay", [(1, 0), (2, 1)])
def test_strided_fragments_equal_their_reference(width, delay):
    """The reference model's two layers dealt to two fragments ([0.weight, 0.bias], [2.weight,
    2.bias]), where the contiguous cut by size is [0.weight], [the rest]: blocking and delayed."""
    expected = diloco_reference(2, 4, width, STEPS + 1, "none", fragments=[[0, 1], [2, 3]], delay=delay)
    for rank, params in enumerate(run_workers(_run_warm, 2, 4, width, "none", 0, 2, delay, None, None, STEPS + 1,
                                              "strided")):
        assert (params - expected[rank]).abs().max() <= 1e-6, f"rank {rank}"
    assert (expected[0] - diloco_reference(2, 4, width, STEPS + 1, "none", fragments=[1, 3], delay=delay)[0]
            ).abs().max() > 1e-4, "strided differs from contiguous here"
