"""What the time-to-accuracy report may use, and the checks that keep it from mixing or dropping runs.

Every finished curve and validation run becomes a small JSON **record**
(``results/time-to-accuracy/runs/`` by default, committed: the run directories are hours of work on a disk that may not be there next
time). A record keeps the run's curve, its final accuracy, its resolved config and that config's
digest (the one checkpoints use), the arm facts that summary.json states, and one row per process
that worked on it (commit, start, end). The report reads records only, and:

* uses a curve only if its run finished the recipe's full step count (``complete``) with the arm's
  settings; any other run is listed as unfinished with the reason, never composed;
* refuses (:class:`Refused`) runs whose configs differ by anything but the arm's overrides and the
  seed, and timing records measured on another recipe.

Pure data: no torch, no Hydra.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path

from pipesgd.reliability.checkpoint import NOT_HASHED, config_diff, config_digest, drop_keys, hashed_config, mode_sections
from pipesgd.observability.hostinfo import UNKNOWN, host_kind

from pipesgd_lab.emulate.cli import REPLICA_KEY

from .tta_compose import ACCURACY, Metric

SUMMARY_FACTS = {"trainer.mode": "mode", "trainer.width": "width", "staleness": "staleness",
                 "compressor": "compressor"}
"""Arm override key -> the summary.json field that states what ran."""
TIMING_PHASE_KEYS = ("trainer.max_steps", "trainer.warmup_sync_steps", "trainer.eval_every_steps",
                     "trainer.log_every", "trainer.checkpoint_every", "trainer.resume", "hydra.run.dir",
                     "dist.nproc", "seed", "compressor.ddp_start_iter")
"""Overrides the timing and validation phases set themselves (not the recipe's identity). The
warm-ups (a pipe arm's synchronous steps, the PowerSGD hook's plain allreduce steps) are priced at
the rate of the arm that runs them, so a timing run turns them off to time the arm's own step."""


RESPELLED = {"trainer.staleness": "staleness", "trainer.dc_lambda": "staleness.dc_lambda",
             "trainer.dc_adaptive": "staleness.dc_adaptive"}
"""A key the recorded commands and configs of earlier runs spell by its removed alias -> its name now
(the aliases meant exactly the group and its dc settings: docs/convergence.md). Commands stay as
they ran; readers respell them."""


def respelled(overrides: Iterable[str]) -> list[str]:
    """``overrides`` with each :data:`RESPELLED` key under its name now (``trainer.staleness=none``:
    ``staleness=none``)."""
    out = []
    for override in overrides:
        key, sep, value = override.partition("=")
        name = RESPELLED.get(key.lstrip("+"))
        out.append(f"{name}={value}" if sep and name else override)
    return out


class Refused(ValueError):
    """The report would mix runs or timings of different recipes: it stops instead."""


def _split(override: str) -> tuple[str, str]:
    key, _, value = override.partition("=")
    return key.lstrip("+"), value


def override_keys(overrides: Iterable[str]) -> set[str]:
    """The config keys a list of overrides sets (a group choice such as ``compressor=int8`` is the
    whole ``compressor`` node)."""
    return {_split(o)[0] for o in overrides}


def recipe_config(config: Mapping, drop: Iterable[str], world_size: int | None = None) -> dict:
    """The hashed config without the ``drop`` keys and the seed, plus the world size (which the
    checkpoint digest leaves out for elastic resume)."""
    return drop_keys(hashed_config(dict(config)) | {"world_size": world_size}, [*drop, "seed"])


def lookup(config: Mapping, key: str):
    """The value at dotted ``key`` in ``config``, :data:`MISSING` where it has none."""
    node = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


MISSING = object()


def _spelled(value: object) -> str:
    """A config value as an override spells it: ``None`` is ``null`` (case aside)."""
    return "null" if value is None else str(value).lower()


def arm_mismatch(summary_facts: Mapping, arm_overrides: Sequence[str], config: Mapping | None = None) -> str | None:
    """None if the run is the arm: summary.json's mode/width/staleness/compressor, and every dotted
    key of the arm's overrides in the run's config, are what the overrides ask for."""
    for override in arm_overrides:
        key, value = _split(override)
        field = SUMMARY_FACTS.get(key)
        if field is not None and summary_facts.get(field) is not None and str(summary_facts[field]) != value:
            return f"{key}={value} asked, {field}={summary_facts[field]} ran"
        if config is not None and field is None:
            found = lookup(config, key)
            if found is not MISSING and _spelled(found) != _spelled(value):
                return f"{key}={value} asked, {found} ran"
    return None


STAMPED = "stamped"
"""``host_source`` of a record whose run's summary.json did not say its host, stamped with the host
that built the record on request (``--stamp-host``: a run that ran here under code from before the
fingerprint)."""


def host_fields(summary: Mapping, stamp: Mapping | None = None) -> dict:
    """``host``, ``host_source`` and ``host_kind`` of a record: summary.json's fingerprint where it
    has one; else ``stamp`` (the host building the record, only when asked); else unknown, never
    guessed."""
    if summary.get("host"):
        host, source = dict(summary["host"]), "summary.json"
    elif stamp:
        host, source = dict(stamp), f"{STAMPED} at {now()} (summary.json has no host)"
    else:
        host, source = None, None
    return {"host": host, "host_source": source, "host_kind": host_kind(host)}


def ran_config(summary: Mapping) -> dict:
    """summary.json's config with what ran in place of what was left to the run: the outer step's
    lr, momentum and nesterov that ``outer_optimizer=auto`` filled (its ``outer_step``) where the
    config has them null."""
    config = dict(summary["config"])
    step, outer = summary.get("outer_step"), config.get("outer_optimizer")
    if isinstance(step, Mapping) and isinstance(outer, Mapping):
        config["outer_optimizer"] = {**outer, **{k: step[k] for k in ("lr", "momentum", "nesterov")
                                                 if outer.get(k) is None and k in step}}
    return config


def curve_record(arm: str, seed: int, arm_overrides: Sequence[str], recipe: str, summary: Mapping,
                 segments: Sequence[Mapping], stamp_host: Mapping | None = None,
                 metric: Metric = ACCURACY) -> dict:
    """The record of a run that wrote summary.json. ``complete``: it ran the recipe's whole step
    count (summary.json's ``total_steps``; for a summary written before that field existed, the
    step of its last evaluation, which the trainer runs at the end). Its host is summary.json's
    (:func:`host_fields`; ``stamp_host`` only where the summary has none)."""
    evals = list(summary.get("evals") or [])
    total = summary.get("total_steps") or (evals[-1]["step"] if evals else None)
    facts = {field: summary.get(field) for field in SUMMARY_FACTS.values()}
    mismatch = arm_mismatch(facts, arm_overrides, ran_config(summary))
    steps = summary.get("steps")
    return {
        "kind": "curve", "arm": arm, "seed": seed, "recipe": recipe, "arm_overrides": list(arm_overrides),
        "complete": steps is not None and steps == total and mismatch is None,
        "why_incomplete": mismatch if mismatch else (None if steps == total else f"{steps} of {total} steps"),
        "steps": steps, "total_steps": total, "metric": metric.key,
        f"final_{metric.key}": metric.scale * summary[metric.key],
        "curve": [[e["step"], metric.scale * e[metric.key]] for e in evals],
        "eval_elapsed_s": [e.get("elapsed_s") for e in evals], "eval_s": [e.get("eval_s") for e in evals],
        "eval_loss": [e.get("test_loss") for e in evals],
        "facts": facts, "config": hashed_config(summary["config"]), "config_digest": config_digest(summary["config"]),
        "world_size": summary.get("world_size"), "git_commit_at_end": summary.get("git_commit_at_end", summary.get("git_commit")),
        "segments": list(segments), **host_fields(summary, stamp_host),
    }


def seed_hosts(used: Sequence[Mapping], allow_mixed: bool = False) -> dict[str, dict]:
    """Per arm: ``kinds`` (host kind -> the seeds run on it) and ``mixed``. Raises :class:`Refused`
    for an arm whose seeds ran on more than one kind of host (a record without a fingerprint counts
    as a kind of its own, :data:`~pipesgd.observability.hostinfo.UNKNOWN`) unless ``allow_mixed``; the arm then
    says ``composed_across_host_kinds``."""
    out: dict[str, dict] = {}
    for r in used:
        kind = r.get("host_kind") or host_kind(r.get("host"))
        out.setdefault(r["arm"], {"kinds": {}})["kinds"].setdefault(kind, []).append(r["seed"])
    for arm, block in out.items():
        block["mixed"] = len(block["kinds"]) > 1
        if block["mixed"] and not allow_mixed:
            listing = "; ".join(f"seeds {seeds} on {kind}" for kind, seeds in block["kinds"].items())
            raise Refused(f"{arm}'s seeds ran on {len(block['kinds'])} kinds of host ({listing}): their curves "
                          "are not reruns of one another; report them apart, or compose them anyway with "
                          "--mixed-hosts (the JSON then says so)")
        if block["mixed"]:
            block["composed_across_host_kinds"] = True
        block["unknown"] = UNKNOWN in block["kinds"]
    return out


def record_path(records: Path, arm: str, seed: int, kind: str = "curve", suffix: str = "", shape: str = "") -> Path:
    """A curve's ``<arm><shape>-s<seed>.json`` or a validation's ``validate-<arm><suffix>.json`` (its
    suffix carries the shape); ``shape``: :attr:`~.tta_shape.Shape.label`, empty at one rank per replica."""
    name = f"{arm}{shape}-s{seed}" if kind == "curve" else f"validate-{arm}{suffix}"
    return records / f"{name}.json"


def usable_curves(records: Mapping[tuple[str, int], dict]) -> tuple[list[dict], list[dict]]:
    """``(used, unfinished)`` from the records of the requested (arm, seed) pairs. Raises
    :class:`Refused`, naming the two runs and their differences, if any two complete runs differ in
    anything but the keys either arm's overrides set, the seed (and the bookkeeping keys checkpoints
    ignore): one report composes one recipe."""
    used = [r for r in records.values() if r.get("complete")]
    unfinished = [r for r in records.values() if not r.get("complete")]
    for i, one in enumerate(used):
        for other in used[i + 1:]:
            drop = override_keys(one["arm_overrides"]) | override_keys(other["arm_overrides"])
            # a config keeping both spellings: an alias goes with its name, or with the group holding it
            drop |= {alias for alias, name in RESPELLED.items()
                     if any(name == key or name.startswith(f"{key}.") for key in drop)}
            if "trainer.mode" in drop:  # a mode's own section (trainer.live) goes with the mode
                drop |= set(mode_sections())
            diff = config_diff(recipe_config(one["config"], drop, one.get("world_size")),
                               recipe_config(other["config"], drop, other.get("world_size")))
            if diff:
                raise Refused(f"{other['arm']} seed {other['seed']} ran another config than {one['arm']} seed "
                              f"{one['seed']} (beyond the arms' overrides and the seed): {'; '.join(diff)}; "
                              "one report composes one recipe: rerun it, or report it apart (--records)")
    return used, unfinished


EMULATORS = ("pipesgd_lab.emulate", "pipesgd_lab.bench.live_groups", "pipesgd.tools.emulate", "pipesgd.emulate")
"""The emulated cluster's modules, as records of each layout name them (today's first; live_groups runs
torchft's arms there, one replica group per node)."""


def link_mtu(command: str) -> int | None:
    """The emulated link's MTU a recorded command ran on: its ``--mtu``, else 1500 (the only link
    before the option existed); None for a loopback run. Records name the emulator by the module
    path of their day (:data:`EMULATORS`)."""
    words = shlex.split(command)
    if not any(name in words for name in EMULATORS):
        return None
    own = words[:words.index("--")] if "--" in words else words  # the emulator's options, not the job's
    if "--rate" in own and own[own.index("--rate") + 1] == "loopback":  # torchft's groups of several ranks
        return None
    return int(own[own.index("--mtu") + 1]) if "--mtu" in own else 1500


def timing_window(row: Mapping) -> dict:
    """The steps a timing row timed: ``first`` (index of its first timed step) and ``steps``. Rows from
    before the row said so are read off their command: the run stopped at ``trainer.max_steps``, and
    its last ``len(iter_ms)`` steps were the window."""
    if row.get("window"):
        return dict(row["window"])
    given = dict(_split(w) for w in shlex.split(row["command"]) if "=" in w)
    total = given.get("trainer.max_steps")
    steps = len(row["iter_ms"])
    return {"first": None if total is None else int(total) - steps, "steps": steps, "warmup": None}


SHAPE_KEYS = (REPLICA_KEY,)
"""The study's shape, which every timing row states (``replicas``, ``ranks_per_replica``) and the report
checks apart (tta_shape.py); torchft's arms are given their group's ranks by torchrun instead."""


def _hashed_overrides(overrides: Iterable[str], ignore: Iterable[str]) -> dict[str, str]:
    """``key -> value`` of the overrides that change what is trained (not run bookkeeping)."""
    skip = set(ignore) | set(NOT_HASHED) | set(TIMING_PHASE_KEYS) | set(SHAPE_KEYS)
    return {k: v for k, v in map(_split, overrides) if k not in skip and not k.startswith("hydra.")}


def check_timing(records: Sequence[Mapping], recipe: str, arms: Mapping[str, Sequence[str]],
                 overrides: Sequence[str]) -> list[Mapping]:
    """The timing records of the arms in ``arms``, each checked against the recipe from its own
    recorded command: ``+experiment=<recipe>``, the arm's overrides as they are now, and the same
    recipe-changing overrides as the curves' (``overrides``). Raises :class:`Refused` otherwise."""
    want = _hashed_overrides(overrides, ())
    kept = []
    for r in records:
        if r["arm"] not in arms:
            continue
        words = shlex.split(r["command"])
        args = respelled(words[words.index("--") + 1:] if "--" in words else words[3:])
        given = dict(map(_split, args))
        where = f"timing record {r['link']} {r['arm']} round {r['repeat']} ({r.get('date', '?')})"
        if given.get("experiment") != recipe:
            raise Refused(f"{where} ran +experiment={given.get('experiment')}, not {recipe}")
        arm = dict(map(_split, arms[r["arm"]]))
        if any(given.get(k) != v for k, v in arm.items()):
            raise Refused(f"{where} ran the arm as {[f'{k}={given.get(k)}' for k in arm]}, not {list(arms[r['arm']])}")
        theirs = _hashed_overrides(args, ["experiment", *arm])
        if theirs != want:
            raise Refused(f"{where} ran with overrides {theirs}, the curves with {want}")
        kept.append(r)
    return kept


def now() -> str:
    """UTC, to the second: the stamp of every record's start, end and date."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def segments_path(run_dir: Path) -> Path:
    """``<arm>-s<seed>.segments.json`` beside the run dir: one row per process that worked on the
    run (its commit, start, end and exit), so a curve resumed across commits says so."""
    return run_dir.parent / f"{run_dir.name}.segments.json"


def read_segments(run_dir: Path) -> list[dict]:
    path = segments_path(run_dir)
    return json.loads(path.read_text()) if path.exists() else []
