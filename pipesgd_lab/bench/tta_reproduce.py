"""``python -m pipesgd_lab.bench.tta_reproduce RECORD [--dir DIR] [Hydra overrides]``: rerun a curve
record's first evaluation here and say whether it comes out to the digit.

The answer is one of :data:`REPRODUCED`, :data:`DIFFERS` (exit status 1), or :data:`OTHER_HOST`
(exit status 2, nothing is run; 3: no answer, the record cannot be rerun as it ran): a curve reruns to the digit on the kind of host it was produced on
and not on another (:mod:`pipesgd.observability.hostinfo`), so a rerun elsewhere proves nothing either way. A
record that does not say its host is rerun, and the answer says that its host is unknown.

The rerun is the record's own training command (its first segment's overrides; the recipe, the
arm's overrides and the seed for a record without one) with ``trainer.stop_after_step`` at the
first evaluation's step: the schedule, the data order and a pipeline's in-flight reduction are the
whole run's, so the evaluation scores the same weights. It compares the test accuracy and, where
the record has it, the test loss, exactly. A rerun whose config differs from the record's (beyond
the bookkeeping keys) is an error, not an answer: the code or the overrides changed the recipe.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from pipesgd.reliability.checkpoint import config_diff, hashed_config
from pipesgd.observability.hostinfo import UNKNOWN, fingerprint, host_kind, kind_differences

from .runner import CellFailed, recorded, run_logged
from .tta_records import respelled

log = logging.getLogger("pipesgd_lab.bench.tta")

REPRODUCED = "reproduced"
DIFFERS = "differs"
OTHER_HOST = "recorded on another kind of host: not comparable here"
EXIT = {REPRODUCED: 0, DIFFERS: 1, OTHER_HOST: 2}
RERUN_SETTINGS = ("trainer.stop_after_step", "trainer.checkpoint_every", "trainer.resume", "hydra.run.dir")
"""Overrides the rerun sets itself (any the recorded command had are replaced)."""


class NotRerunnable(ValueError):
    """The record cannot be rerun as it ran (no curve, another config): no answer is given."""


def _train_args(record: Mapping) -> list[str]:
    """The overrides of the record's training command: its first segment's, else rebuilt."""
    for segment in record.get("segments") or []:
        words = shlex.split(segment.get("command") or "")
        if "pipesgd.train" in words:
            return respelled(words[words.index("pipesgd.train") + 1:])
    return [f"+experiment={record['recipe']}", *record["arm_overrides"], f"seed={record['seed']}",
            *([f"dist.nproc={record['world_size']}"] if record.get("world_size") else [])]


def rerun_command(record: Mapping, run_dir: Path, overrides: Sequence[str] = (),
                  python: str = sys.executable) -> list[str]:
    """``python -m pipesgd.train`` with the record's overrides, then ``overrides`` (e.g. this
    machine's ``data.root``), stopping right after the record's first evaluation."""
    if not record.get("curve"):
        raise NotRerunnable(f"record {record.get('arm')} seed {record.get('seed')} has no evaluation to rerun")
    keep = [w for w in _train_args(record) if w.partition("=")[0].lstrip("+") not in RERUN_SETTINGS]
    first = int(record["curve"][0][0])
    return [python, "-m", "pipesgd.train", *keep, *_outer_as_run(record, keep), *overrides, f"trainer.stop_after_step={first}",
            "trainer.checkpoint_every=null", "trainer.resume=never", f"hydra.run.dir={run_dir}"]


def _outer_as_run(record: Mapping, words: Sequence[str]) -> list[str]:
    """The outer step the record ran with, spelled key by key, where its command left it to the
    config's default (a default that has since changed: it follows H and M now, pipesgd.outer)."""
    config = record.get("config") or {}
    outer = config.get("outer_optimizer") or {}
    if (config.get("trainer") or {}).get("sync_every", 1) <= 1 or outer.get("_target_") != "torch.optim.SGD":
        return []
    if any(w.lstrip("+").startswith("outer_optimizer") for w in words):
        return []
    return [f"outer_optimizer.{k}={str(outer[k]).lower() if isinstance(outer[k], bool) else outer[k]}"
            for k in ("lr", "momentum", "nesterov") if outer.get(k) is not None]


def compare(record: Mapping, summary: Mapping) -> dict:
    """The rerun's first evaluation (``summary``: its summary.json) against the record's: same
    step, accuracy and (where recorded) loss to the last bit. :class:`NotRerunnable` if the rerun
    composed another config than the record's."""
    diff = config_diff(hashed_config(record["config"]), hashed_config(summary["config"]))
    if diff:
        raise NotRerunnable(f"the rerun composed another config than the record's: {'; '.join(diff)} (the code "
                            "or the overrides changed the recipe since the record was made)")
    if not summary.get("evals"):
        raise NotRerunnable("the rerun made no evaluation")
    got = summary["evals"][0]
    step, accuracy = record["curve"][0]
    want = {"step": step, "test_accuracy_pct": accuracy}
    have = {"step": got["step"], "test_accuracy_pct": 100 * got["test_accuracy"]}
    losses = record.get("eval_loss") or []
    if losses and losses[0] is not None:
        want["test_loss"], have["test_loss"] = losses[0], got.get("test_loss")
    return {"recorded": want, "rerun": have, "verdict": REPRODUCED if want == have else DIFFERS}


def reproduce(record: Mapping, work: Path, overrides: Sequence[str] = (), here: Mapping | None = None,
              run: Callable[[list[str], Path], None] | None = None) -> dict:
    """The answer for ``record`` on this host (``here``: its fingerprint, default measured): the
    verdict, what was compared, and both hosts. ``run(cmd, log_path)`` runs the rerun (default: a
    logged subprocess); it is not called for a record of another kind of host."""
    here = dict(fingerprint() if here is None else here)
    recorded_host = record.get("host")
    out = {"record": f"{record.get('arm')} seed {record.get('seed')}", "host_recorded": host_kind(recorded_host),
           "host_here": host_kind(here)}
    differences = kind_differences(recorded_host, here)
    if differences:
        return out | {"verdict": OTHER_HOST, "host_differences": differences}
    if recorded_host is None:
        out["note"] = f"the record does not say which host it ran on ({UNKNOWN}): the answer holds for this host only"
    run_dir = work / "rerun"
    cmd = rerun_command(record, run_dir, overrides)
    out["command"] = recorded(cmd)
    (run or (lambda c, p: run_logged(c, p, 86400.0)))(cmd, work / "rerun.log")
    return out | compare(record, json.loads((run_dir / "summary.json").read_text()))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipesgd_lab.bench.tta_reproduce", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("record", type=Path, help="a curve record, e.g. results/time-to-accuracy/runs/sync-s0.json")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for this machine, e.g. data.root=PATH")
    p.add_argument("--dir", type=Path, default=None, help="where the rerun runs (default: a temporary directory)")
    a = p.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"unexpected argument(s) {bad}: positional arguments after RECORD are Hydra overrides key=value")
    record = json.loads(a.record.read_text())
    try:
        with tempfile.TemporaryDirectory(prefix="tta-reproduce-") as tmp:
            answer = reproduce(record, (a.dir or Path(tmp)).resolve(), a.overrides)
    except (NotRerunnable, CellFailed) as e:
        log.error("%s: %s", a.record, e)
        return 3
    print(json.dumps(answer, indent=2))
    print(f"{a.record}: {answer['verdict']}")
    return EXIT[answer["verdict"]]


if __name__ == "__main__":
    sys.exit(main())
