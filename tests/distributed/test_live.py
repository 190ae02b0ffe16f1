"""Live recovery on torchft (trainer.mode=live): two replica groups in their own processes behind an
in-process lighthouse on loopback; one is SIGKILLed mid-run, the survivor trains on having lost at
most one update, and the restarted group heals from it with bit-identical weights at the first
step they apply together. Replica checks ride on the reductions throughout, and catch a group
perturbed at the end. A peer of another run is refused the state. Skipped without torchft
(pip install '.[live]'), except under CI=true, where it fails."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

from needs_torchft import require_torchft  # noqa: E402

require_torchft()

from listening import listening, on_every_interface  # noqa: E402
from live_replica import MISMATCH  # noqa: E402
from pipesgd.live.lighthouse import Lighthouse, LighthouseOptions  # noqa: E402


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half written


def _wait_until(condition, timeout_s: float, what: str, procs: list[subprocess.Popen]) -> None:
    """Poll ``condition`` (a replica's progress in its file) until true; fail naming ``what`` when
    ``timeout_s`` passes or a replica that should be running has exited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        dead = [p.args[p.args.index("--replica") + 1] for p in procs if p.poll() is not None]
        if dead:
            pytest.fail(f"replica {', '.join(dead)} exited while waiting for {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


def _replica(lighthouse: Lighthouse, replica: int, out: Path, tmp_path: Path, *extra: str) -> subprocess.Popen:
    """tests/live_replica.py as replica group ``replica``, writing its steps to ``out``; it stops
    when ``tmp_path/stop`` exists (or at ``--max-steps``)."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "live_replica.py"), "--lighthouse", lighthouse.address,
         "--run-id", "live-test", "--replica", str(replica), "--out", str(out), "--stop", str(tmp_path / "stop"),
         *extra], env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "RUST_LOG": "warn"}, cwd=tmp_path)


def _on_loopback_only(pid: int, servers: int) -> None:
    """Process ``pid`` listens on none of every interface's addresses, and on loopback (the run's
    address here) with at least ``servers`` sockets (docs/reliability.md, "Security")."""
    sockets = listening(pid)
    assert not on_every_interface(sockets), f"listening on every interface: {on_every_interface(sockets)}"
    assert sum(a.is_loopback for a, _, _ in sockets) >= servers, sockets


def _all_exit_0(procs: list[subprocess.Popen], timeout_s: float) -> None:
    for p in procs:
        assert p.wait(timeout=timeout_s) == 0


def _kill_left(procs: list[subprocess.Popen]) -> None:
    """No replica outlives its test, on any path."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


# none: the plain rule, over the ring with int8 (a lost peer fails a ring hop; the count stays exact);
# lookahead: a rule with per-replica state (kept local gradients) that must travel with the heal for
# the healer to stay bit-identical, over torchft's Gloo allreduce; dc (adaptive): the weights the
# gradient in flight was computed at and the mean square travel; dga: each group holds its own
# pending local step, the groups agree on the consistent weights, which the heal must hand over
# (and the checks compare). A replica check rides on every reduction: one dies with the killed
# group, the healer's zeroed shares take no part (its own weights differ until it heals), and a
# perturbation of the healed group is caught on both (not under dga, whose next update puts the
# agreed weights back and so undoes it: there the run is stopped).
# powersgd: a reduction with state of its own (error feedback, the warm start), none of which the
# heal carries: the healer's zeroed shares leave its (empty) residual alone, and its warm start
# is its donor's from its first reduction on, computed from the summed values.
# topk (ratio 0.1) and int8 with error feedback: a residual of their own, and top-k's all_gather
# of (index, value) pairs, in which the healer's zeroed share sends k zeros.
@pytest.mark.parametrize("staleness, comm, compressor, options", [
    ("none", "ring", "int8", None), ("lookahead", "native", "none", None), ("dc", "native", "none", None),
    ("dga", "ring", "none", None), ("none", "ring", "powersgd", None), ("none", "ring", "topk", '{"ratio": 0.1}'),
    ("none", "ring", "int8", '{"error_feedback": true}')])
@pytest.mark.timeout(170)
def test_a_killed_replica_costs_the_survivor_at_most_one_update_and_heals_bit_identical(tmp_path, staleness, comm,
                                                                                          compressor, options):
    procs: list[subprocess.Popen] = []
    lighthouse = Lighthouse(LighthouseOptions(heartbeat_timeout_ms=1000, join_timeout_ms=500))
    compressing = ("--compressor", compressor) + (() if options is None else ("--compressor-options", options))

    def start(replica: int, out: Path, *extra: str) -> subprocess.Popen:
        p = _replica(lighthouse, replica, out, tmp_path, "--staleness", staleness, "--comm", comm, *compressing,
                     "--check-every", "1", "--dc-adaptive", *extra)
        procs.append(p)
        return p

    a, b, b2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "b2.jsonl"
    try:
        # the survivor checkpoints after every step: a heal must not wait on a checkpoint, nor it on the heal
        survivor, victim = start(0, a, "--checkpoint-every-step"), start(1, b)
        applied = lambda path: sum(r["applied"] for r in _records(path))  # noqa: E731
        _wait_until(lambda: applied(a) >= 5 and applied(b) >= 5, 100, "both replicas applying updates", procs)
        for p in (survivor, victim):  # its store, its Manager's server and its state server (Gloo's too)
            _on_loopback_only(p.pid, servers=3)
        victim.send_signal(signal.SIGKILL)
        victim.wait(timeout=10)
        procs.remove(victim)
        killed_at = len(_records(a))
        _wait_until(lambda: applied(a) >= killed_at + 20, 60, "the survivor training on alone", procs)
        rejoined_at = len(_records(a))
        start(1, b2, "--perturb", str(tmp_path / "perturb"))
        healed_applied = lambda: sum(r["applied"] and r["healed"] > 0 for r in _records(b2))  # noqa: E731
        _wait_until(lambda: healed_applied() >= 5, 100, "the restarted replica healing and training", procs)
        (tmp_path / ("stop" if staleness == "dga" else "perturb")).touch()
        ends = [0, 0] if staleness == "dga" else [MISMATCH, MISMATCH]
        assert [p.wait(timeout=30) for p in procs] == ends
    finally:
        _kill_left(procs)
        lighthouse.shutdown()

    alone = _records(a)[killed_at:rejoined_at]
    assert sum(r["skipped"] for r in alone) <= 1, f"the survivor lost more than one update: {alone[:5]}"
    assert sum(r["applied"] for r in alone) >= 15
    healed_before = _records(a)[killed_at - 1]["healed"]  # it may have healed at the start (torchft's init sync)
    assert all(r["healed"] == healed_before for r in _records(a)[killed_at:]), "the survivor loaded a peer's state"
    # "consistent": the weights the groups agree on (under dga without a group's pending local
    # step; else the weights themselves). The healer's hold no local step of its donor's.
    first = next(r for r in _records(b2) if r["applied"] and r["healed"])
    donor = {r["committed"]: r for r in _records(a) if r["applied"]}
    assert first["committed"] in donor and first["digest"] == first["consistent"]
    assert first["consistent"] == donor[first["committed"]]["consistent"], \
        "the healer's weights differ from its donor's"
    assert first["lr"] == donor[first["committed"]]["lr"], "the healer's schedule differs from its donor's"
    # The healer's first reduction (torchft's, while it fetched) and its next (a gradient of its
    # pre-heal weights) carry nothing from it: one valid contribution, the donor's, not two.
    healer = [r for r in _records(b2) if r["applied"] and r["healed"]]
    assert [r["valid"] for r in healer[:3]] == [1.0, 1.0, 2.0], healer[:3]
    joint = [r for r in _records(b2) if r["applied"] and r["committed"] in donor and not r["perturbed"]]
    assert len(joint) >= 5 and all(r["consistent"] == donor[r["committed"]]["consistent"] for r in joint)
    assert all(r["q"] == donor[r["committed"]]["q"] for r in joint)  # PowerSGD's warm start (None for the others)
    # Error feedback: the healer's residual is empty while its shares are zeroed (none of the donor's,
    # none of its own pre-heal one), then its own from its first valid share on.
    if compressor in ("powersgd", "topk") or options == '{"error_feedback": true}':
        assert healer[0]["residual"] is None and healer[-1]["residual"] > 0, healer
    # Replica checks: passed together before the kill, none counted alone, none by the healer's
    # zeroed shares (its first two reductions), passed together again after the heal.
    checks = [r["checks"] for r in _records(a)]
    assert checks[killed_at - 1] > 0 and checks[rejoined_at - 1] - checks[killed_at - 1] <= 1, checks  # 1: in flight
    assert [r["checks"] for r in healer[:2]] == [0, 0] and healer[-1]["checks"] >= 3, healer
    if staleness == "dga":
        return
    # The perturbation is caught at the next check, the one the perturbed weights launched, on both groups.
    last = {path: _records(path)[-1] for path in (a, b2)}
    assert last[b2]["perturbed"] and [r["perturbed"] for r in _records(b2)].count(True) == 1
    for path in (a, b2):
        why = Path(f"{path}.mismatch").read_text()
        assert "with two groups the sums cannot tell which one is odd" in why, why
        assert int(re.search(r"diverged at update (\d+)", why)[1]) == last[path]["committed"] == \
            last[b2]["committed"], why


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP: state T in /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "Tt"


# A hung group keeps its sockets open: a hop waiting on it would hold the survivor until Gloo's
# timeout (60 s here). The victim stops in a reduction, after its quorum formed and before its first
# hop, so the survivor's hop to it is in flight; the survivor must give that reduction up once the
# lighthouse stops hearing the victim (1 s), lose that one update, and train on while the victim is
# still stopped. Continued, the victim's reduction fails or completes on the old quorum's group, and
# it heals from the survivor, bit-identical at the first update they apply together.
# PowerSGD: a reduction with state of its own (error feedback, the warm start) runs on a copy of it,
# so the reduction given up cannot change the state the survivor's next one reads (the warm start
# the two agree on after the heal is checked).
@pytest.mark.parametrize("comm, compressor", [("ring", "none"), ("native", "none"), ("ring", "powersgd")])
@pytest.mark.timeout(240)
def test_a_hung_group_holds_the_survivor_only_until_the_lighthouse_stops_hearing_it(tmp_path, comm, compressor):
    procs: list[subprocess.Popen] = []
    lighthouse = Lighthouse(LighthouseOptions(heartbeat_timeout_ms=1000, join_timeout_ms=500))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    common = ("--comm", comm, "--compressor", compressor, "--timeout-s", "60", "--max-steps", "1000000")
    try:
        survivor = _replica(lighthouse, 0, a, tmp_path, *common)
        victim = _replica(lighthouse, 1, b, tmp_path, *common, "--stop-in-reduction", "20")
        procs += [survivor, victim]
        _wait_until(lambda: _stopped(victim.pid), 100, "the victim stopping in its 20th reduction with the survivor",
                    procs)
        stopped_at = len(_records(a))
        applied = lambda path: sum(r["applied"] for r in _records(path))  # noqa: E731
        before = applied(a)
        # 30 s: half of Gloo's timeout, so only a reduction given up early lets the survivor get there
        _wait_until(lambda: applied(a) >= before + 20, 30, "the survivor training on while the victim is stopped",
                    [survivor])
        assert _stopped(victim.pid)
        went_on_at = len(_records(a))
        heals = _records(b)[-1]["healed"]  # torchft's init sync may have healed it once at the start
        victim.send_signal(signal.SIGCONT)
        healed_applied = lambda: sum(r["applied"] and r["healed"] > heals for r in _records(b))  # noqa: E731
        # its own hop may wait for Gloo's timeout before it fails and the victim heals
        _wait_until(lambda: healed_applied() >= 5, 90, "the continued victim healing and training", procs)
        (tmp_path / "stop").touch()
        _all_exit_0(procs, 30)
    finally:
        _kill_left(procs)
        lighthouse.shutdown()

    during = _records(a)[stopped_at - 1:went_on_at]  # from the step whose reduction the victim stopped in
    assert sum(r["skipped"] for r in during) <= 1, f"the survivor lost more than one update: {during[:5]}"
    assert all(r["healed"] == _records(a)[stopped_at - 1]["healed"] for r in _records(a)[stopped_at:])
    donor = {r["committed"]: r for r in _records(a) if r["applied"]}
    joint = [r for r in _records(b) if r["applied"] and r["healed"] > heals and r["committed"] in donor]
    assert len(joint) >= 5 and all(r["digest"] == donor[r["committed"]]["digest"] for r in joint), \
        "the healed victim's weights differ from its donor's"
    assert all(r["q"] == donor[r["committed"]]["q"] for r in joint)  # PowerSGD's warm start (None for the others)


# dc (adaptive: its mean square too) corrects by the weights each gradient was computed at, so it
# departs from pipe unless the rule sees each gradient before the update in flight lands; dga's
# groups differ by their own pending local step, each group's weights against its own rank's.
# For these two the simulation is checked against the pipe engine itself.
@pytest.mark.parametrize("staleness", ["none", "lookahead", "predict", "dc", "dga"])
@pytest.mark.timeout(150)
def test_live_with_a_staleness_rule_and_no_fault_is_pipe_sgd_width_2_with_that_rule(tmp_path, staleness):
    """Two replica groups of one process each, in every quorum (min_replicas=2, no step-0 sync:
    they start alike), against width-2 Pipe-SGD over two simulated ranks with the library's rule:
    each group's weights and the weights the groups agree on after every step, bit for bit, with
    a replica check riding on every second reduction (it changes nothing of the update, and
    passes: it compares the agreed weights)."""
    steps = 12
    adaptive = ("--dc-adaptive",) if staleness == "dc" else ()
    outs = _in_every_quorum(tmp_path, steps, "--staleness", staleness, "--check-every", "2", *adaptive)
    expected = _pipe_reference(staleness, steps, len(outs))
    if staleness in ("dc", "dga"):
        from distributed_utils import run_workers

        engine = run_workers(_pipe_worker, len(outs), "ring", "none", None, steps, staleness, timeout=90)
        assert [[{k: r[k] for k in ("applied", "digest", "consistent")} for r in rank] for rank in expected] == engine
    for out, want in zip(outs, expected):
        got = [{k: r[k] for k in ("applied", "valid", "digest", "consistent")} for r in _records(out)]
        assert got == want, f"{out.name} departs from the reference at step " \
                            f"{next(i for i, (g, e) in enumerate(zip(got, want)) if g != e) + 1}"
        # launched after 2, 4, ..., 10 committed updates (steps 3, 5, ..., 11), voted a step later
        assert [r["checks"] for r in _records(out)][3::2] == [1, 2, 3, 4, 5]
    if staleness == "dga":  # the groups hold weights of their own, and agree on the consistent ones
        assert all(a["digest"] != b["digest"] and a["consistent"] == b["consistent"]
                   for a, b in zip(*expected[:2]) if a["applied"])


def _in_every_quorum(tmp_path: Path, steps: int, *extra: str) -> list[Path]:
    """Two replica groups of one process each, in every quorum (min_replicas=2, no step-0 sync:
    they start alike), ``steps`` steps each; the files they wrote their steps to."""
    sys.path.insert(0, str(ROOT / "tests"))
    outs = [tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"]
    procs: list[subprocess.Popen] = []
    with Lighthouse(LighthouseOptions(min_replicas=2)) as lighthouse:
        try:
            procs = [_replica(lighthouse, r, out, tmp_path, "--same-init", "--min-replicas", "2", "--init-sync", "0",
                              "--max-steps", str(steps), *extra) for r, out in enumerate(outs)]
            _all_exit_0(procs, 100)
        finally:
            _kill_left(procs)
    return outs


# ring/none against the reference the native allreduce meets above (so: bit-identical to live + native);
# the others against the pipe engine with that allreduce and compressor, run on Gloo: ring/int8,
# native/fp16 (a cast) and the tree, plain and with int8, ride the buffer; top-k (an all_gather),
# PowerSGD (two dense allreduces, over the ring, the native one or the tree) and int8 with error
# feedback reduce the gradient apart, with state kept from step to step (each with comm=tree too;
# top-k gathers whatever the comm, so there it checks only that the tree setting takes nothing
# from it). ``ratio``: what the compressor at least divides the bytes sent by.
@pytest.mark.parametrize("comm, compressor, options, ratio", [
    ("ring", "none", None, 1), ("ring", "int8", None, 1.9), ("native", "fp16", None, 1.9),
    ("tree", "none", None, 1), ("tree", "int8", None, 1.9),
    ("ring", "topk", '{"ratio": 0.1}', 1.9), ("ring", "powersgd", None, 1.3), ("native", "powersgd", None, 1.3),
    ("ring", "int8", '{"error_feedback": true}', 1.9), ("tree", "topk", '{"ratio": 0.1}', 1.9),
    ("tree", "powersgd", None, 1.3), ("tree", "int8", '{"error_feedback": true}', 1.9)])
@pytest.mark.timeout(120)
def test_the_ring_and_its_compressors_over_torchfts_group_are_pipe_sgds(tmp_path, comm, compressor, options, ratio):
    """Two replica groups in every quorum, no fault, reducing with ``comm`` and ``compressor``
    through torchft's group's own send / recv / allreduce / allgather: the weights after every
    step, bit for bit, against width-2 Pipe-SGD of the same data; the count of valid
    contributions and a replica check's sums (on every reduction) stay exact under a lossy
    compressor, and the compressor did compress. PowerSGD's warm start is the same on both groups."""
    steps = 8
    extra = () if options is None else ("--compressor-options", options)
    outs = _in_every_quorum(tmp_path, steps, "--comm", comm, "--compressor", compressor, "--check-every", "1", *extra)
    if (comm, compressor, options) == ("ring", "none", None):
        expected = _pipe_reference("none", steps, len(outs))[0]
    else:
        from distributed_utils import run_workers

        expected, other = run_workers(_pipe_worker, len(outs), comm, compressor, options, steps, timeout=90)
        assert expected == other
    from live_replica import make_model

    from pipesgd.live.engine import TAIL
    from pipesgd.reliability.replicas import MOMENTS

    # fp32, the tail (flag, count, losses' sum) and the check's sums, sent whole once by each of the
    # two groups: the tree's up or down from the root; in a ring of two each rank sends each of the
    # two chunks once (its own in the reduce-scatter, the other in the all-gather), even or not
    numel = sum(p.numel() for p in make_model(0).parameters()) + TAIL + MOMENTS
    assert len(outs) == 2
    raw = numel * 4
    for out in outs:
        records = _records(out)
        got = [{k: r[k] for k in ("applied", "digest")} for r in records]
        want = [{k: e[k] for k in ("applied", "digest")} for e in expected]
        assert got == want, f"{out.name} departs from pipe at step " \
                            f"{next(i for i, (g, e) in enumerate(zip(got, want)) if g != e) + 1}"
        assert [r["valid"] for r in records[1:]] == [2.0] * (steps - 1)
        assert [r["checks"] for r in records] == [0, 0, 1, 2, 3, 4, 5, 6]  # from the reduction launched at step 2
        sent = records[-1]["wire"]  # bytes this replica sent in its last reduction (a lossy one's count apart)
        assert sent == raw if compressor == "none" else 0 < sent < raw / ratio
    q = [[r["q"] for r in _records(out)] for out in outs]
    assert q[0] == q[1] and (compressor != "powersgd" or None not in q[0]), q


def _pipe_worker(rank: int, world: int, comm: str, compressor: str, options: str | None, steps: int,
                 staleness: str = "none") -> list[dict]:
    """Width-2 Pipe-SGD (pipesgd.engine.pipe) on rank ``rank`` of a Gloo group, training what
    tests/live_replica.py trains on replica group ``rank``'s data, with the compressor it builds
    from ``compressor`` and ``options``: per step, whether an update was applied, the weights'
    digest and that of the consistent weights. On one thread, as the replicas run (PowerSGD's
    products and QR)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from live_replica import batch, make_model, make_optimizer
    from live_replica import compressor as build

    from pipesgd.engine.pipe import PipeSGD
    from pipesgd.reliability.replicas import digest
    from pipesgd.staleness import make_staleness

    torch.set_num_threads(1)
    model = make_model(0)
    optimizer, scheduler = make_optimizer(model)
    engine = PipeSGD(optimizer, model.parameters(), width=2, compressor=build(compressor, options), allreduce=comm,
                     staleness=make_staleness(staleness, dc_adaptive=True))
    out = []
    try:
        for step in range(steps):
            x, y = batch(rank, step)
            optimizer.zero_grad(set_to_none=True)
            with engine.forward_context():
                torch.nn.functional.cross_entropy(model(x), y).backward()
            applied = engine.step().applied
            if applied:
                scheduler.step()
            out.append({"applied": applied, "digest": digest(torch.cat([q.detach().reshape(-1)
                                                                        for q in model.parameters()])),
                        "consistent": digest(engine.consistent_params())})
    finally:
        engine.close()
    return out


def _pipe_reference(staleness: str, steps: int, replicas: int) -> list[list[dict]]:
    """Width-2 Pipe-SGD over ``replicas`` simulated ranks, each with its own instance of the rule
    (dc: adaptive), in PipeSGD's order (launch step t, then apply step t-1's average): per rank
    and step, whether an update was applied, the valid contributions, the digest of the rank's
    weights and of the consistent ones. On one thread, as the replicas run: another thread count
    may sum a matmul in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _simulated_pipe(staleness, steps, replicas)
    finally:
        torch.set_num_threads(threads)


def _simulated_pipe(staleness: str, steps: int, replicas: int) -> list[list[dict]]:
    from live_replica import batch, make_model, make_optimizer

    from pipesgd.reliability.replicas import digest
    from pipesgd.staleness import make_staleness

    outs = range(replicas)
    models = [make_model(0) for _ in outs]
    optimizers = [make_optimizer(m) for m in models]
    rules = [make_staleness(staleness, dc_adaptive=True) for _ in outs]
    for rule, model, (optimizer, _) in zip(rules, models, optimizers):
        rule.bind(list(model.parameters()), optimizer)
    expected, pending = [[] for _ in outs], None
    for step in range(steps):
        grads = []
        for r, (model, (optimizer, _), rule) in enumerate(zip(models, optimizers, rules)):
            optimizer.zero_grad(set_to_none=True)
            with rule.forward_context(0 if pending is None else 1):
                torch.nn.functional.cross_entropy(model(batch(r, step)[0]), batch(r, step)[1]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        for rule, g in zip(rules, grads):  # PipeSGD's order: launch step t, then apply step t-1's average
            rule.launched(g)
        if pending is not None:
            for (_, scheduler), rule in zip(optimizers, rules):
                rule.apply(pending.clone())
                scheduler.step()
        pending = torch.stack(grads).sum(0).div_(float(replicas))
        for model, rule, records in zip(models, rules, expected):
            weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            records.append({"applied": step > 0, "valid": float(replicas) if step > 0 else None,
                            "digest": digest(weights), "consistent": digest(rule.consistent_params())})
    return expected


def _reformed_ring(rank: int, world: int, comm: str) -> list[list[float]]:
    """``comm`` (plain and int8) over one torchft group, formed of all three ranks, then re-formed
    without rank 0: the survivors move down one rank. What each reduction summed, per rank."""
    from torchft.process_group import ProcessGroupGloo

    from pipesgd.comm import REGISTRY
    from pipesgd.live.group import TorchftGroup

    pg = ProcessGroupGloo(timeout=timedelta(seconds=20))
    group = TorchftGroup(pg)
    store = f"127.0.0.1:{os.environ['MASTER_PORT']}/live-ring"
    sums = []
    for quorum, (members, compressor) in enumerate([((0, 1, 2), "none"), ((1, 2), "none"), ((1, 2), "int8")]):
        if rank not in members:
            break
        if quorum < 2:  # the Manager's configure at a new quorum: its rank and size now
            pg.configure(f"{store}/{quorum}", str(rank), members.index(rank), len(members))
        t = torch.arange(5, dtype=torch.float32) + 10 * rank
        REGISTRY.get(comm)(t, compressor, group)
        sums.append(t.tolist())
    return sums


@pytest.mark.parametrize("comm", ["ring", "tree"])
@pytest.mark.timeout(90)
def test_the_ring_takes_each_quorums_rank_and_size_from_torchfts_group(comm):
    sys.path.insert(0, str(ROOT / "tests"))
    from distributed_utils import run_workers

    got = run_workers(_reformed_ring, 3, comm, timeout=60)
    whole = (torch.arange(5.0) * 3 + 30).tolist()
    without_0 = (torch.arange(5.0) * 2 + 30).tolist()
    assert got[0] == [whole]
    assert got[1][:2] == got[2][:2] == [whole, without_0]
    assert got[1][2] == got[2][2]  # every rank decodes the same bytes
    assert torch.allclose(torch.tensor(got[1][2]), torch.tensor(without_0), rtol=2 / 127)


def _transport(run_id: str, timeout_s: float = 10):
    from pipesgd.live.transport import RunTransport

    return RunTransport(run_id, "127.0.0.1", timedelta(seconds=timeout_s))


@pytest.mark.timeout(60)
def test_a_peer_of_another_run_is_refused_and_logged(caplog):
    from pipesgd.live.transport import StrangerRefused

    donor, stranger, peer = _transport("run-a", 2), _transport("run-b"), _transport("run-a")
    try:
        donor.send_checkpoint([1], 7, {"w": torch.arange(3.0)}, timedelta(seconds=10))
        with caplog.at_level(logging.WARNING, logger="pipesgd.live.transport"):
            with pytest.raises(StrangerRefused, match="not a peer of run 'run-b'"):
                stranger.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=10))
            forged = donor.metadata().replace("/run-a/", "/run-b/")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(f"{forged}7", timeout=10)
        assert refused.value.code == 403
        assert donor.refused == 1 and "refused a request" in caplog.text
        assert torch.equal(peer.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=10))["w"],
                           torch.arange(3.0))
        donor.disallow_checkpoint()  # after the vote, the state is no longer served
        with pytest.raises(StrangerRefused, match="404"):
            peer.recv_checkpoint(0, donor.metadata(), 7, timedelta(seconds=10))
    finally:
        for t in (donor, stranger, peer):
            t.shutdown()


@pytest.mark.timeout(60)
def test_a_healer_asking_before_its_donor_staged_the_state_waits_for_it():
    """The quorum names the donor before the donor has staged its state (it does so at its next
    step boundary): the request waits for it instead of failing the heal."""
    import threading

    donor, healer = _transport("run-a"), _transport("run-a")
    got = {}
    try:
        fetch = threading.Thread(target=lambda: got.update(
            state=healer.recv_checkpoint(0, donor.metadata(), 3, timedelta(seconds=10))))
        fetch.start()
        donor.send_checkpoint([1], 3, {"w": torch.ones(2)}, timedelta(seconds=10))
        fetch.join(timeout=20)
        assert torch.equal(got["state"]["w"], torch.ones(2))
    finally:
        donor.shutdown()
        healer.shutdown()


@pytest.mark.timeout(60)
def test_the_lighthouse_listens_on_loopback_only():
    with Lighthouse() as lighthouse:
        assert lighthouse.address.startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="every interface"):
        LighthouseOptions(host="")


class _Stop(Exception):
    pass


@pytest.mark.timeout(60)
def test_the_launcher_listens_on_the_runs_address_only(monkeypatch, tmp_path):
    """The live launcher's servers, the lighthouse and the store the replica groups start together
    on, all up when it starts the first group: on loopback (trainer.live.host's default) only."""
    from ipaddress import ip_address

    from pipesgd.live import launch as live_launch

    before, seen = listening(os.getpid()), {}

    class Context:  # notes what the launcher listens on as it would start the first replica group
        def Process(self, target, args, name):  # noqa: N802 (multiprocessing's spelling)
            seen["sockets"] = listening(os.getpid()) - before
            raise _Stop

    monkeypatch.setattr(live_launch.multiprocessing, "get_context", lambda method: Context())
    with pytest.raises(_Stop):
        live_launch.run(lambda *a: None, ({}, str(tmp_path)), nproc=2)
    assert not on_every_interface(seen["sockets"]), on_every_interface(seen["sockets"])
    assert sorted(a for a, _, _ in seen["sockets"]) == [ip_address("127.0.0.1")] * 2, seen["sockets"]


def _ipv6_loopback() -> bool:
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this machine")
@pytest.mark.timeout(60)
def test_a_replica_group_on_an_ipv6_address_listens_there(tmp_path):
    """trainer.live.host=::1: the lighthouse, the replica's store, its Manager's server (which
    advertises the address in brackets) and its state server on ::1, and it trains."""
    from ipaddress import ip_address

    from pipesgd.live.engine import LiveEngine
    from pipesgd.live.options import LiveOptions

    before = listening(os.getpid())
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Lighthouse(LighthouseOptions(host="::1")) as lighthouse:
        engine = LiveEngine(model, optimizer, LiveOptions(lighthouse.address, "v6", 0, host="::1", init_sync=False))
        try:
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.ones(4, 3)).sum().backward()
                stats = engine.step()
            sockets = listening(os.getpid()) - before
        finally:
            engine.close()
    assert stats.applied
    assert not on_every_interface(sockets), on_every_interface(sockets)
    assert sum(a == ip_address("::1") for a, _, _ in sockets) == 4, sockets  # Gloo's: the hostname's address


@pytest.mark.parametrize("host, bind", [("127.0.0.1", "127.0.0.1:4321"), ("::1", "[::1]:4321")])
def test_the_managers_server_binds_the_runs_address_with_torchfts_port(monkeypatch, host, bind):
    """What torchft 0.2.0's Manager hands its server (``[::]`` and the port it chose), rewritten."""
    import torchft.manager as tm

    from pipesgd.live import listen

    binds = []

    def server(**kw):
        binds.append(kw["bind"])

    monkeypatch.setattr(tm, "ManagerServer", server)
    monkeypatch.setattr(tm, "Manager", lambda **kw: tm.ManagerServer(bind="[::]:4321", store_addr="s"))
    listen.manager(host, rank=0)
    assert binds == [bind]
    assert tm.ManagerServer is server  # put back once the Manager is built


@pytest.mark.parametrize("server_binds, why", [(["0.0.0.0:0"], r"bind='0.0.0.0:0', not '\[::\]:<port>'"),
                                               ([], "called ManagerServer 0 times, not once")])
def test_a_torchft_shaped_otherwise_is_refused_rather_than_listening_everywhere(monkeypatch, server_binds, why):
    import torchft.manager as tm

    from pipesgd.live import listen

    shut = []

    class Manager:  # a torchft whose Manager starts its server differently from 0.2.0's
        def __init__(self, **kw):
            for bind in server_binds:
                tm.ManagerServer(bind=bind)

        def shutdown(self, wait: bool) -> None:
            shut.append(wait)

    server = tm.ManagerServer
    monkeypatch.setattr(tm, "Manager", Manager)
    with pytest.raises(RuntimeError, match=rf"torchft \S+ is not shaped as pipesgd expects \(its Manager .*{why}\).*"
                                           r"torchft==0\.2\.0"):
        listen.manager("127.0.0.1", rank=0)
    assert tm.ManagerServer is server
    assert shut == ([] if server_binds else [False])  # a Manager built with no server is shut down


def test_widths_other_than_two_are_refused():
    from pipesgd.live.engine import LiveEngine
    from pipesgd.live.options import LiveOptions

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="trainer.width=3 is not available with trainer.mode=live"):
        LiveEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), LiveOptions("http://127.0.0.1:1", "r", 0),
                   width=3)


@pytest.mark.parametrize("check_every, dtype, why", [
    (0, torch.float32, r"check_every=0 is invalid: committed updates between replica checks, an integer >= 1"),
    (2.5, torch.float32, r"check_every=2.5 is invalid"),
    (4, torch.bfloat16, r"check_every=4 needs float32 or float64 parameters.*these are torch.bfloat16")])
def test_a_replica_check_the_sums_cannot_make_exact_is_refused(check_every, dtype, why):
    from pipesgd.live.engine import LiveEngine
    from pipesgd.live.options import LiveOptions

    model = torch.nn.Linear(2, 2).to(dtype)
    with pytest.raises(ValueError, match=why):
        LiveEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), LiveOptions("http://127.0.0.1:1", "r", 0),
                   check_every=check_every)


@pytest.mark.timeout(60)
def test_the_state_a_donor_hands_over_is_a_copy_later_updates_do_not_reach():
    """torchft serializes the donor's state on its quorum thread while the training thread goes on
    updating the weights and the momentum in place: the snapshot must not alias them."""
    from pipesgd.engine.base import ModeArgs
    from pipesgd.live.engine import build

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, engine = build(ModeArgs(model, optimizer, 2, None, None, None, 1, 0, torch.device("cpu")))
    try:
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            engine.step()
        snapshot = engine._state()
        weight = snapshot["model"]["weight"].clone()
        momentum = snapshot["optimizer"]["state"][0]["momentum_buffer"].clone()
        engine.flush()  # one more update, in place
        assert not torch.equal(model.weight.detach(), weight)
        assert torch.equal(snapshot["model"]["weight"], weight)
        assert torch.equal(snapshot["optimizer"]["state"][0]["momentum_buffer"], momentum)
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_reduction_that_fails_is_reported_to_the_manager_and_its_update_dropped(caplog):
    """A ring hop that raises (a lost peer, a timeout) is the quorum's to vote on: the Manager
    hears of it, the vote fails, the update is skipped, and the next one applies."""
    from pipesgd.engine.base import ModeArgs
    from pipesgd.live.engine import build

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, engine = build(ModeArgs(model, optimizer, 2, "int8", "ring", None, 1, 0, torch.device("cpu")))
    ring, failures = engine._allreduce, []

    def failing_once(tensor, compressor, group):
        if not failures:
            failures.append(group.size())
            raise RuntimeError("ring allreduce reduce-scatter hop 1/1: Connection reset by peer")
        return ring(tensor, compressor, group)

    engine._allreduce = failing_once
    try:
        stats = []
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.ones(4, 3)).sum().backward()
            before = model.weight.detach().clone()
            with caplog.at_level(logging.WARNING, logger="pipesgd.live.engine"):
                stats.append(engine.step())
        assert failures == [1]  # the group of the quorum the reduction waited for: this replica alone
        assert [s.skipped for s in stats] == [False, True, False] and engine.skipped_commits == 1
        assert [s.applied for s in stats] == [False, False, True]
        assert not torch.equal(model.weight.detach(), before)
        assert "live reduction failed" in caplog.text and "Connection reset by peer" in caplog.text
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_a_heal_in_flush_leaves_the_next_gradient_valid():
    """A heal in the vote of ``step()`` zeroes the gradient that step launches (computed on the
    weights before the heal); one in the vote of ``flush()`` leaves no gradient in hand, so the
    one the next ``step()`` launches, computed on the healed weights, is sent whole."""
    from pipesgd.engine.base import ModeArgs
    from pipesgd.live.engine import build

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, engine = build(ModeArgs(model, optimizer, 2, None, None, None, 1, 0, torch.device("cpu")))
    vote, heals = engine.manager.should_commit, []

    def healing_vote(*args, **kwargs):  # torchft loads the donor's state inside the vote
        if heals:
            engine._load_peer_state(heals.pop())
        return vote(*args, **kwargs)

    engine.manager.should_commit = healing_vote

    def backward_and(call):
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        return call()

    try:
        backward_and(engine.step)
        heals.append(engine._state())
        backward_and(engine.step)  # healed in its vote: what it launches is stale
        stats = engine.flush()
        assert engine.healed == 1 and stats.skipped and stats.metrics["live/valid"] == 0.0
        backward_and(engine.step)
        heals.append(engine._state())
        assert engine.flush().applied and engine.healed == 2  # healed in flush's vote
        before = model.weight.detach().clone()
        backward_and(engine.step)
        stats = engine.flush()
        assert stats.applied and stats.metrics["live/valid"] == 1.0
        assert torch.allclose(model.weight.detach(), before - 0.1 * 4)  # d(sum)/dW: 4 rows of ones
    finally:
        engine.close()


# lookahead keeps the local gradient of the reduction in flight; dc (adaptive) the weights it was
# computed at and the mean square; dga this group's pending local step and the agreed weights
@pytest.mark.parametrize("staleness, kept", [("lookahead", {"local"}), ("dc", {"w_then", "mean_square"}),
                                             ("dga", {"local", "base"})])
@pytest.mark.timeout(60)
def test_a_healer_takes_the_donors_staleness_state(staleness, kept):
    """The state a donor hands over carries its rule's whole state, one entry for the reduction in
    flight, and loading it replaces the healer's."""
    from pipesgd.engine.base import ModeArgs
    from pipesgd.live.engine import build
    from pipesgd.staleness import make_staleness

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _, engine = build(ModeArgs(model, optimizer, 2, None, None, None, 1, 0, torch.device("cpu"),
                               staleness=make_staleness(staleness, dc_adaptive=True)))
    try:
        for step in range(3):
            optimizer.zero_grad()
            with engine.forward_context():
                model(torch.full((4, 3), float(step + 1))).sum().backward()
            engine.step()
        donor = engine._state()
        state = donor["engine"]["staleness"]
        assert set(state) == kept and all(len(v) == 1 for v in state.values() if isinstance(v, list))
        assert _tensors(state) == _tensors(engine.staleness.state_dict())
        own = {k: [torch.zeros_like(t) for t in v] if isinstance(v, list) else torch.zeros_like(v)
               for k, v in state.items()}
        engine.staleness.load_state_dict(own)  # a healer's own, stale
        engine._load_peer_state(donor)
        assert _tensors(engine.staleness.state_dict()) == _tensors(state)
        engine.flush()
    finally:
        engine.close()


def _tensors(state: dict) -> dict:
    """A rule's state, each tensor as a list of its values (comparable with ==)."""
    return {k: [t.tolist() for t in v] if isinstance(v, list) else v.tolist() for k, v in state.items()}


@pytest.mark.parametrize("compressor, options", [("powersgd", None), ("topk", '{"ratio": 0.1}'),
                                                  ("int8", '{"error_feedback": true}')])
@pytest.mark.timeout(60)
def test_a_heal_carries_no_reduction_state_and_starts_the_healers_residual_at_zero(compressor, options):
    """PowerSGD, top-k and int8 with error feedback: the donor's state has neither its residual (its
    own debt, which both would then send) nor PowerSGD's warm start (the healer computes its own from
    the summed values of the reduction it takes part in while it heals); loading it forgets the
    healer's residual (one it kept healing in its own process) and keeps its warm start."""
    from live_replica import compressor as build_compressor

    from pipesgd.engine.base import ModeArgs
    from pipesgd.live.engine import build

    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))  # 12 x 16: rank 4
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    _, engine = build(ModeArgs(model, optimizer, 2, build_compressor(compressor, options), "ring", None, 1, 0,
                               torch.device("cpu")))
    try:
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(32, 16, generator=torch.Generator().manual_seed(step))).square().sum().backward()
            engine.step()
        before = engine.state_dict()["reduction"]
        assert before["residual"].abs().sum() > 0
        donor = engine._state()
        assert not [t for t in _tensors_in(donor) if t.shape == before["residual"].shape]
        engine._load_peer_state(donor)
        after = engine.state_dict()["reduction"]
        assert set(after) == set(before) - {"residual"}  # PowerSGD's warm start kept, the residual forgotten
        assert all(torch.equal(a, b) for a, b in zip(after.get("q", []), before.get("q", [])))
        engine.flush()
    finally:
        engine.close()


def _tensors_in(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else []
    return [t for v in values for t in _tensors_in(v)]
