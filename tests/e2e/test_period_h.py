"""The period-H engine (trainer.sync_every > 1) as a user runs it: a worker SIGKILLed mid-round and
mid-flight resumes bit-identical; a pseudo-gradient NaN on one rank drops the round on every rank;
replica checks compare the anchors; a multirun sweeps H, width, compressor and rule; whatever
cannot run at sync_every > 1 is refused before any worker starts, naming the option
(docs/period-h.md)."""

from __future__ import annotations

import json

import pytest

from runs import killed_and_resumed, needs_mnist, run, summary

# 30 steps per epoch (60000 / 2 ranks / 1000); rounds of 3 steps: checkpoints at 8, 16, 24, 30, 32, 40
# fall inside rounds (32 = ten rounds and 2 steps, the tenth's exchange in flight at width 2)
MNIST = ["+experiment=mnist_mlp", "trainer.max_steps=40", "data.batch_size=1000", "optimizer.lr=0.05",
         "trainer.lr_reference_batch=null", "trainer.checkpoint_every=8", "trainer.log_every=10",
         "dist.threads_per_worker=1", "trainer.eval_every_steps=12", "trainer.sync_every=3"]


@needs_mnist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("rule,compressor,outer,fragments,delay,alpha", [("eager", "int8", "nesterov", 1, 0, None),
                                                                         ("none", "none", "sgd", 1, 1, "auto"),
                                                                         ("eager", "none", "nesterov", 3, 0, None)])
def test_killed_worker_resumes_mid_round_bit_identical(rule, compressor, outer, fragments, delay, alpha, tmp_path):
    """The checkpoint at step 32 holds each rank's own weights and inner optimizer mid-round, the
    anchor, the outer optimizer's momentum, the round in flight and (eager) each rank's own term;
    with three streaming fragments (one a step), every fragment's; with trainer.sync_delay=1 each
    round's average lands a step after its launch, mixed at the share that follows M (1/4 here)."""
    args = [*MNIST, f"staleness={rule}", f"compressor={compressor}", f"outer_optimizer={outer}",
            f"trainer.fragments={fragments}", f"trainer.sync_delay={delay}",
            *([f"trainer.landing_alpha={alpha}"] if alpha else []),
            "trainer.check_every=4" if rule == "none" else "trainer.check_every=null"]
    a, _ = killed_and_resumed(args, tmp_path, rank=1, at=35, checkpoint=32, steps=40)
    assert a["sync_every"] == 3 and a["rounds"] == 14 and a["outer_rule"] == rule  # 13 rounds + the partial one
    assert a["fragments"] == fragments and a["sync_delay"] == delay
    assert a["landing_alpha"] == (0.25 if alpha else None)  # the share that ran
    assert a["test_accuracy"] > 0.4, "the run must really train, or equality proves little"
    if fragments > 1:  # a fragment's average lands at every step from the second round on
        return
    # a round's bytes count at the step its average lands (width 2): rounds 1-12 at the ends of
    # rounds 2-13 (steps 6, 9, ..., 39); 13 and the partial 14th in the final flush, after the loop;
    # landing a step after the launch, rounds 1-13 land in the loop (steps 4, 7, ..., 40)
    landed = 13 if delay else 12
    assert a["mean_bytes_per_step"] == pytest.approx(a["bytes_per_step"] * landed / 40, rel=0.01)
    assert 0 < a["compute_utilization"] <= 1


@needs_mnist
@pytest.mark.timeout(300)
def test_nonfinite_pseudo_gradient_on_one_rank_drops_the_round_everywhere(tmp_path):
    """A NaN in rank 1's gradient at step 7 poisons its round 3 (steps 7-9); that round's average is
    waited for at the end of round 4 (width 2, step 12) and dropped by both ranks; replica checks
    at every step compare the anchors, identical throughout."""
    run_dir = tmp_path / "run"
    r = run(*MNIST, "trainer.max_steps=18", "trainer.nonfinite=skip", "trainer.check_every=1",
            f"hydra.run.dir={run_dir}", tmp=tmp_path, fault="nan:1:7")
    assert r.returncode == 0, r.stderr[-3000:]
    skips = [line for line in r.stderr.splitlines() if "non-finite gradient at step 3 (NaN/inf on rank(s) 1)" in line]
    assert len(skips) == 2, r.stderr[-3000:]
    s = summary(run_dir)
    assert s["nonfinite_skipped_steps"] == [3] and s["steps"] == 18 and s["test_accuracy"] > 0.3


@needs_mnist
@pytest.mark.timeout(400)
def test_multirun_sweeps_period_width_compressor_and_rule(tmp_path):
    sweep = tmp_path / "sweep"
    r = run("-m", "+experiment=mnist_mlp", "trainer.max_steps=8", "data.batch_size=1000",
            "dist.threads_per_worker=1", "trainer.sync_every=2,4", "staleness=none,eager", "compressor=none,int8",
            "trainer.check_every=null", f"hydra.sweep.dir={sweep}", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted((s["sync_every"], s["outer_rule"], s["compressor"]) for s in runs) == sorted(
        (h, rule, c) for h in (2, 4) for rule in ("none", "eager") for c in ("none", "int8"))
    assert all(s["rounds"] == 8 // s["sync_every"] for s in runs)


@needs_mnist
@pytest.mark.timeout(300)
def test_multirun_sweeps_the_width_at_a_period(tmp_path):
    """Width 1 (blocking DiLoCo), 2 and 3 (rounds in flight) at H = 4: one job each, each its rounds."""
    sweep = tmp_path / "sweep"
    r = run("-m", "+experiment=mnist_mlp", "trainer.max_steps=12", "data.batch_size=1000", "dist.threads_per_worker=1",
            "trainer.sync_every=4", "trainer.width=1,2,3", f"hydra.sweep.dir={sweep}", tmp=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted((s["width"], s["rounds"], s["outer_rule"]) for s in runs) == [(1, 3, "none"), (2, 3, "none"),
                                                                                (3, 3, "none")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides,message", [
    ("trainer.sync_every=4 trainer.mode=ddp", "trainer.sync_every=4 is not available with trainer.mode=ddp"),
    ("trainer.sync_every=4 staleness=lookahead", "staleness=lookahead is a rule for per-step gradients"),
    ("trainer.sync_every=4 staleness=eager trainer.width=3", "staleness=eager keeps exactly one outer step"),
    ("trainer.sync_every=4 staleness=eager trainer.mode=sync", "trainer.mode=sync runs at width 1"),
    ("trainer.mode=torchft_diloco staleness=none trainer.sync_every=4 trainer.warmup_sync_steps=10",
     "trainer.warmup_sync_steps=10 is not used by trainer.mode=torchft_diloco"),
    ("trainer.sync_every=4 trainer.landing_alpha=0.5", "trainer.landing_alpha=0.5 mixes the weights where a round lands"),
    ("trainer.sync_every=4 trainer.fragment_layout=strided", "trainer.fragment_layout=strided deals a model's layers"),
    ("trainer.sync_every=4 trainer.fragments=2 trainer.fragment_layout=diagonal",
     "trainer.fragment_layout='diagonal' is not known"),
    ("trainer.sync_every=4 trainer.sync_delay=1 trainer.landing_alpha=2", "trainer.landing_alpha=2 is invalid"),
    ("trainer.sync_every=4 staleness=eager trainer.check_every=5", "trainer.check_every=5 cannot check"),
    ("trainer.sync_every=4 trainer.mode=live", "trainer.sync_every=4 is not available with trainer.mode=live"),
    ("trainer.sync_every=4 trainer.mode=ps_sync", "trainer.sync_every=4 is not available with trainer.mode=ps_sync"),
    ("trainer.sync_every=0", "trainer.sync_every=0 is invalid: must be an integer >= 1"),
    ("outer_optimizer=sgd", "outer_optimizer is not used at trainer.sync_every=1"),
    ("trainer.fragments=2", "trainer.fragments=2 is not used at trainer.sync_every=1"),
    ("trainer.sync_every=4 trainer.fragments=3", "trainer.fragments=3 does not divide trainer.sync_every=4"),
    ("outer_optimizer.lr=0.5", "outer_optimizer.lr is not used at trainer.sync_every=1"),
    ("staleness=eager", "staleness=eager is a rule for the outer step of trainer.sync_every > 1"),
    ("trainer.sync_every=4 outer_optimizer.lr=-1", "outer_optimizer.lr=-1 is invalid"),
    ("trainer.sync_every=4 trainer.sync_delay=1 trainer.mode=sync", "trainer.sync_delay=1 is not used by trainer.mode=sync"),
    ("trainer.sync_every=4 trainer.sync_delay=1 trainer.width=3", "trainer.sync_delay=1 says when the one round in flight lands and needs width 2"),
    ("trainer.sync_delay=1", "trainer.sync_delay=1 delays a round's exchange and is not used at trainer.sync_every=1"),
    ("trainer.sync_every=4 trainer.fragments=2 trainer.sync_delay=2",
     "trainer.sync_delay=2 must be below trainer.sync_every / trainer.fragments = 2"),
    ("trainer.mode=torchft_diloco staleness=none", "trainer.mode=torchft_diloco runs rounds of inner steps"),
    ("trainer.mode=torchft_diloco staleness=none trainer.sync_every=4 trainer.fragments=2 trainer.sync_delay=2",
     "trainer.sync_delay=2 must be below trainer.sync_every / trainer.fragments = 2"),
    ("trainer.mode=torchft_diloco staleness=none trainer.sync_every=4 compressor=int8",
     "compressor=int8 is not available with trainer.mode=torchft_diloco"),
    ("trainer.mode=torchft_diloco staleness=none trainer.sync_every=4 trainer.nonfinite=skip",
     "trainer.nonfinite=skip"),
    ("trainer.mode=pipe trainer.live.timeout_s=5", "only trainer.mode=live|torchft_diloco read trainer.live.*"),
    ("trainer.mode=torchft_diloco staleness=none trainer.sync_every=4 trainer.checkpoint_every=10",
     "trainer.checkpoint_every=10 is not a multiple of trainer.sync_every / trainer.fragments = 4"),
])
def test_what_cannot_run_in_rounds_is_refused_before_workers_start(overrides, message, tmp_path):
    r = run("+experiment=mnist_mlp", *overrides.split(), f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "] - training " not in r.stderr, "no worker may have started"
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.timeout(120)
def test_a_config_with_several_problems_gets_them_all_in_one_refusal(tmp_path):
    """gpt_shakespeare's per-step rule (lookahead) cannot run in rounds, and 3 fragments do not
    divide a round of 10: both are named in the one refusal, not one per try, before any worker
    starts (its synchronous warm-up of 300 steps now runs before the rounds)."""
    r = run("+experiment=gpt_shakespeare", "trainer.sync_every=10", "trainer.fragments=3",
            f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "2 problems in this config:" in r.stderr, r.stderr[-2000:]
    assert "1. staleness=lookahead is a rule for per-step gradients" in r.stderr
    assert "2. trainer.fragments=3 does not divide trainer.sync_every=10" in r.stderr
    assert "Traceback" not in r.stderr and "] - training " not in r.stderr, "no worker may have started"
    assert not (tmp_path / "run").exists()
