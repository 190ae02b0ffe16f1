"""``python -m pipesgd_lab.bench.live_groups --workers N --rate R [--ranks-per-replica K] [--timeout-s T] --
OVERRIDES``: one ``pipesgd.train`` job of a mode of the live launcher (``trainer.mode=torchft_diloco``,
``live``) on an emulated cluster, one replica group per node, each its own torchrun job of K ranks
(K > 1: torchft_diloco only, data parallel inside the group), the lighthouse on node 0
(:func:`pipesgd_lab.bench.live_drill_torchrun.run_groups`, the drill's launcher without a fault);
``--rate loopback``: every group on this host's loopback, no namespaces (a curve).
What ``pipesgd_lab.emulate`` is to the other modes, for the period-H study's torchft arms
(docs/period-h.md). ``hydra.run.dir`` names the run directory (required). Exit status 1 if a group
failed, 2 for bad arguments."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pipesgd_lab.emulate.netns import DEFAULT_MTU

from .live_drill_torchrun import check, run_groups
from .runner import CellFailed

log = logging.getLogger("pipesgd_lab.bench.live_groups")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.live_groups", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="replica groups, one node each")
    p.add_argument("--rate", required=True, help="every link's tc rate, e.g. 5mbit, or loopback")
    p.add_argument("--ranks-per-replica", type=int, default=1, metavar="K",
                   help="processes in each replica group, one torchrun job (default 1)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="the most the job may run (default 3600)")
    p.add_argument("--mtu", type=int, default=DEFAULT_MTU, help=f"the links' MTU (default {DEFAULT_MTU})")
    p.add_argument("overrides", nargs="*", help="pipesgd.train's Hydra overrides (after --)")
    a = p.parse_args(argv)
    for option, value in (("--workers", a.workers), ("--ranks-per-replica", a.ranks_per_replica)):
        if value < 1:
            p.error(f"argument {option}: must be an integer >= 1, got {value}")
    dirs = [o.split("=", 1)[1] for o in a.overrides if o.split("=", 1)[0].lstrip("+") == "hydra.run.dir"]
    if not dirs:
        p.error("name the run directory: hydra.run.dir=PATH among the overrides")
    check(p, argparse.Namespace(overrides=a.overrides, rate=a.rate))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run_groups(a.overrides, a.workers, Path(dirs[-1]), a.rate, None, a.timeout_s, mtu=a.mtu,
                   ranks=a.ranks_per_replica)
    except CellFailed as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
