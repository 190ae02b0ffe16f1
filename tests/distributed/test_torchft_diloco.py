"""trainer.mode=torchft_diloco, torchft's own DiLoCo, against single-process references: blocking
DiLoCo and streaming DiLoCo without a delay are the period-H engine's blocking rule (tests/
diloco_reference.py, width 1); with torchft's fragment_sync_delay τ, a small reference of its own
rule (the pseudo-gradient taken τ steps before the sync, the fragment's τ later inner steps dropped).
Two replica groups in processes of their own behind a lighthouse in this one, on loopback.
Skipped without torchft (pip install '.[live]'), except under CI=true, where it fails."""

from __future__ import annotations

import os

import pytest
import torch

from needs_torchft import require_torchft

require_torchft()

from diloco_reference import INNER, OUTER, diloco_reference  # noqa: E402
from engine_reference import flat_params, loss_of, make_model  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402
from torchft_diloco_worker import gather, train  # noqa: E402

P = 2


def _run(sync_every: int, fragments: int, delay: int, steps: int) -> list[tuple]:
    """Both groups' (global weights, local weights, bytes sent per step, summary), by replica."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum tick at info
    with Lighthouse(LighthouseOptions(min_replicas=P, join_timeout_ms=60_000)) as lighthouse:
        results = dict((r, rest) for r, *rest in gather(
            [(train, r, lighthouse.address, sync_every, fragments, delay, steps) for r in range(P)]))
    return [results[r] for r in range(P)]


def _delayed_reference(sync_every: int, sizes: list[int], delay: int, steps: int) -> torch.Tensor:
    """torchft's streaming rule in one process: fragment f (of ``sizes`` parameter tensors each)
    launches its pseudo-gradient global - local at the step τ before each of its syncs, which come
    every H/F steps in turn (fragment 0 first); at the sync the fragment takes the global weights,
    the outer optimizer steps them with the replicas' average, and the local weights are those."""
    models = [make_model() for _ in range(P)]
    inners = [INNER(m.parameters()) for m in models]
    cuts = [sum(sizes[:f]) for f in range(len(sizes) + 1)]
    params = [[list(m.parameters())[cuts[f]:cuts[f + 1]] for f in range(len(sizes))] for m in models]
    glob = [[q.detach().clone().requires_grad_(True) for q in params[0][f]] for f in range(len(sizes))]
    outers = [OUTER(g) for g in glob]
    period, launched, turn = sync_every // len(sizes), None, 0
    for t in range(1, steps + 1):
        for m in range(P):
            inners[m].zero_grad()
            loss_of(models[m], m, t - 1).backward()
            inners[m].step()
        local = (t - 1) % period + 1
        if local == period - delay:
            launched = [sum(g.detach() - q.detach() for q in qs) / P
                        for g, qs in zip(glob[turn], zip(*[params[m][turn] for m in range(P)]))]
        if local == period:
            for g, d in zip(glob[turn], launched):
                g.grad = d
            outers[turn].step()
            with torch.no_grad():
                for m in range(P):
                    for q, g in zip(params[m][turn], glob[turn]):
                        q.copy_(g)
            turn = (turn + 1) % len(sizes)
    return torch.cat([g.detach().reshape(-1) for frag in glob for g in frag])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fragments", [1, 2])
def test_torchft_diloco_without_a_delay_is_blocking_diloco(fragments):
    h, steps = 4, 16  # whole rounds: torchft has no flush
    # split() cuts the reference model's four tensors (320, 32, 96, 3 values) at half its numel: [w1], [b1, w2, b2]
    sizes = None if fragments == 1 else [1, 3]
    expected = diloco_reference(P, h, 1, steps, "none", fragments=sizes)[0]
    if fragments == 2:
        # the reference's flush ends the one fragment's partial round; torchft leaves it local. Fragment
        # 0 (w1, 320 values) last synced at step 14, so its global weights are the reference's at 14
        expected[:320] = diloco_reference(P, h, 1, steps - h // 2, "none", fragments=sizes)[0][:320]
    runs = _run(h, fragments, 0, steps)
    for replica, (glob, local, sent, summary) in enumerate(runs):
        assert (glob - expected).abs().max() <= 1e-6, f"replica {replica}'s global weights"
        if fragments == 1:  # at whole rounds the model just synced: the local weights are the global ones
            assert torch.equal(local, glob)
        else:  # fragment 1 just synced; fragment 0 took two inner steps since its sync at 14
            assert torch.equal(local[320:], glob[320:]) and not torch.equal(local[:320], glob[:320])
        period = h // fragments
        assert [t for t, b in enumerate(sent, 1) if b] == list(range(period, steps + 1, period))
        assert summary["rounds"] == steps // h and summary["live_skipped_commits"] == 0
    # fp32 ring bytes: 2(p-1)/p of the model per round, each fragment once
    numel = expected.numel()
    assert sum(runs[0][2]) == pytest.approx(steps // h * 4 * numel, rel=1e-6)
    assert not torch.equal(expected, flat_params(make_model())), "the reference trained nothing"


@pytest.mark.timeout(240)
def test_the_sync_delay_launches_early_and_drops_the_fragments_late_steps_as_torchft_does():
    h, fragments, delay, steps = 6, 2, 1, 18
    expected = _delayed_reference(h, [1, 3], delay, steps)
    runs = _run(h, fragments, delay, steps)
    for replica, (glob, _, sent, summary) in enumerate(runs):
        assert (glob - expected).abs().max() <= 1e-6, f"replica {replica}'s global weights"
        assert [t for t, b in enumerate(sent, 1) if b] == [t for t in range(1, steps + 1) if t % 3 == 2]
        assert summary["sync_delay"] == delay
    # the delay changes the result (the rule is not the blocking one under another name)
    blocking = diloco_reference(P, h, 1, steps, "none", fragments=[1, 3])[0]
    assert (expected - blocking).abs().max() > 1e-4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("h, f, delay, match", [(4, 3, 0, "does not divide"), (4, 2, 2, "must be below"),
                                                (0, 1, 0, "sync_every=0"), (4, 1, -1, "sync_delay=-1")])
def test_a_schedule_torchft_refuses_is_named_before_it_starts(h, f, delay, match):
    from pipesgd.live.diloco import _check_schedule

    with pytest.raises(ValueError, match=match):
        _check_schedule(h, f, delay)
