"""One replica group of a live run, for tests/distributed/test_live.py: a small model trained with
LiveEngine until ``--stop`` exists; after every step one JSON line: the engine's step, torchft's
committed step, whether the update was applied or skipped, the replica checks passed so far, the
weights' sha256, that of the weights the groups agree on (``consistent_params``: dga's without
this group's pending local step) and PowerSGD's warm start's. A replica check that fails ends it
with status 3, its message in ``<out>.mismatch``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipesgd.live.engine import COMMS, STALENESSES, LiveEngine  # noqa: E402
from pipesgd.reliability.faults import Fault, Faults  # noqa: E402
from pipesgd.live.options import LiveOptions  # noqa: E402
from pipesgd.reliability.replicas import ReplicaMismatch, digest  # noqa: E402
from pipesgd.staleness import make_staleness  # noqa: E402

MISMATCH = 3  # the exit status of a replica check that failed


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4))


def make_optimizer(model: torch.nn.Module):
    """The optimizer and a schedule that moves the lr at every update (a healer must take its donor's)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: 1.0 / (1 + 0.01 * n))


def batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of replica group ``replica`` at its ``step`` (0-based): it follows the group."""
    g = torch.Generator().manual_seed(10_000 * replica + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def compressor(name: str, options: str | None):
    """``--compressor`` with ``--compressor-options`` (JSON: e.g. ``{"ratio": 0.1}`` for top-k,
    ``{"error_feedback": true}`` for a per-chunk compressor): a compressor or a reduction."""
    from pipesgd.compress import get_compressor
    from pipesgd.reduction import get_reduction, reductions

    kwargs = json.loads(options) if options else {}
    return get_reduction(name, **kwargs) if name in reductions() else get_compressor(name, **kwargs)


def warm_start_digest(engine: LiveEngine) -> str | None:
    """sha256 of PowerSGD's warm-start factors after the reduction launched at this step (the
    engine's state_dict waits for it), the same on every group that took part in it; None for a
    reduction without them."""
    if not hasattr(engine.reduction, "q"):
        return None
    return digest(torch.cat([x.reshape(-1) for x in engine.state_dict()["reduction"]["q"]]))


def residual_sum(engine: LiveEngine) -> float | None:
    """The sum of |residual| of this group's error feedback now; None where there is none yet (or
    the reduction keeps none). Read, not waited for: a reduction swaps in a new residual whole."""
    memory = getattr(engine.reduction, "memory", None)
    residual = None if memory is None else memory.residual
    return None if residual is None else float(residual.abs().sum())


def stop_in_reduction(engine: LiveEngine, n: int) -> None:
    """SIGSTOP this process in the engine's ``n``-th reduction with a peer (a quorum of more than
    this group), on the communication thread, after the quorum formed and before its first hop:
    its peers' hops to it are then in flight."""
    reduce, calls = engine._reduce, [0]

    def stopping(buf, group, *args):
        calls[0] += group.size() > 1
        if calls[0] == n and group.size() > 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return reduce(buf, group, *args)

    engine._reduce = stopping


def replica_arguments() -> argparse.ArgumentParser:
    """The options every test replica group takes: where its run is, which group it is, where it writes."""
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--out", required=True)
    return p


def main() -> None:
    p = replica_arguments()
    p.add_argument("--stop", required=True)
    p.add_argument("--max-steps", type=int, default=3000)
    p.add_argument("--checkpoint-every-step", action="store_true",
                   help="take engine.state_dict() after every step, as the trainer's checkpoint hook does")
    p.add_argument("--staleness", default="none", choices=STALENESSES)
    p.add_argument("--dc-adaptive", action="store_true", help="staleness=dc's adaptive λ (its mean square)")
    p.add_argument("--same-init", action="store_true", help="every group starts from the same weights (seed 0)")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--init-sync", type=int, default=1, help="torchft's step-0 sync (1) or none (0)")
    p.add_argument("--comm", default="native", choices=COMMS, help="the allreduce over torchft's group")
    p.add_argument("--compressor", default="none", help="a per-chunk compressor (int8: the ring only), topk or powersgd")
    p.add_argument("--compressor-options", help="its options, as JSON (e.g. '{\"error_feedback\": true}')")
    p.add_argument("--check-every", type=int, default=None, help="committed updates between replica checks")
    p.add_argument("--timeout-s", type=float, default=10, help="trainer.live.timeout_s: Gloo's, a hop's limit")
    p.add_argument("--stop-in-reduction", type=int, default=None,
                   help="SIGSTOP this whole process in its N-th reduction, before its first hop (a hang with "
                        "a hop of its peers in flight)")
    p.add_argument("--perturb", help="once this file exists, perturb the weights after the next backward "
                                     "(PIPESGD_FAULT's perturb: silent drift of this group)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"[replica {a.replica}] %(name)s %(message)s")
    torch.set_num_threads(1)
    model = make_model(0 if a.same_init else a.replica)  # by default different: a healer must take its donor's
    optimizer, scheduler = make_optimizer(model)
    engine = LiveEngine(model, optimizer, LiveOptions(a.lighthouse, a.run_id, a.replica, timeout_s=a.timeout_s,
                                                      quorum_timeout_s=20, min_replicas=a.min_replicas,
                                                      init_sync=bool(a.init_sync)),
                        staleness=make_staleness(a.staleness, dc_adaptive=a.dc_adaptive),
                        compressor=compressor(a.compressor, a.compressor_options),
                        allreduce=a.comm, check_every=a.check_every)
    engine.register_state("scheduler", scheduler.state_dict, scheduler.load_state_dict)
    if a.stop_in_reduction is not None:
        stop_in_reduction(engine, a.stop_in_reduction)
    out = open(a.out, "a", buffering=1)
    perturbed = False
    try:
        while not os.path.exists(a.stop) and engine.steps < a.max_steps:
            x, y = batch(a.replica, engine.steps)
            optimizer.zero_grad(set_to_none=True)
            with engine.forward_context():
                F.cross_entropy(model(x), y).backward()
            if a.perturb and not perturbed and os.path.exists(a.perturb):
                Faults([Fault("perturb", a.replica, engine.steps + 1)], a.replica).after_backward(engine.steps + 1,
                                                                                                  model)
                perturbed = True
            stats = engine.step()
            if stats.applied:
                scheduler.step()
            if a.checkpoint_every_step:
                engine.state_dict()
            weights = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            out.write(json.dumps({"step": engine.steps, "committed": engine.manager.current_step(),
                                  "applied": stats.applied, "skipped": stats.skipped, "healed": engine.healed,
                                  "valid": stats.metrics.get("live/valid"), "wire": stats.comm.wire_bytes,
                                  "checks": engine.replica_checks, "perturbed": perturbed,
                                  "lr": optimizer.param_groups[0]["lr"], "digest": digest(weights),
                                  "consistent": digest(engine.consistent_params()),
                                  "q": warm_start_digest(engine), "residual": residual_sum(engine)}) + "\n")
        engine.flush()
    except ReplicaMismatch as e:
        Path(f"{a.out}.mismatch").write_text(str(e))
        sys.exit(MISMATCH)
    finally:
        engine.close()
        out.close()


if __name__ == "__main__":
    main()
