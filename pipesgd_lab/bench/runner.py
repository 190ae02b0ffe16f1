"""Execute benchmark cells: calibrate each condition once, run every cell ``repeats`` times as a
separate process, skip warm-up steps, pool the rest, and write one record per cell.

Every command is a plain CLI invocation (``python -m pipesgd.train``, ``python -m pipesgd_lab.emulate
... -- ...``, ``python -m pipesgd_lab.bench.calibrate_cli``, ``python -m pipesgd_lab.bench.allreduce``), saved in
the record relative to the repository root, so any number can be reproduced by hand from a
checkout. Output of each process goes to a log file next to its run directory, never to the terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from pipesgd.comm import ring_bytes
from pipesgd_lab.emulate.netns import DEFAULT_MTU
from pipesgd.observability.hostinfo import fingerprint
from pipesgd.observability.runinfo import git_commit, write_json_atomic
from pipesgd.timing import allreduce_time, load_calibration, parse_bandwidth

from . import probe
from .grid import WORKLOADS, Cell

log = logging.getLogger("pipesgd_lab.bench")

STEP_FIELDS = ("iter_ms", "compute_ms", "exposed_comm_ms", "comm_ms", "update_ms")


class CellFailed(RuntimeError):
    """A command of a cell exited non-zero; the message names the command's log file."""


@dataclass
class Settings:
    """How cells are run. ``overrides`` are Hydra overrides given to every training run."""

    bench_dir: Path
    steps: int = 40
    skip: int = 10
    repeats: int = 2
    allreduce_repeats: int = 20
    quick: bool = False
    calibration_dir: Path | None = None
    overrides: Sequence[str] = ()
    python: str = sys.executable
    timeout_s: float = 1800.0
    mtu: int = DEFAULT_MTU  # emulated links' MTU, passed to every pipesgd_lab.emulate command (so its record says it)
    interleave: bool = False  # repeats as rounds: every cell once per round (run_rounds)
    calibrate_each_round: bool = False  # with interleave: calibrate afresh at each round's first cell of a condition
    probe_s: float = 0.0  # the host-speed probe before and after each training run (probe.py); 0: none
    commit: str = field(default_factory=git_commit)
    root: Path = field(default_factory=Path.cwd)  # where the records are read from (a clone's root)


def recorded(cmd: Sequence[str], s: Settings | None = None) -> str:
    """``cmd`` as a reader re-runs it from the repository root: ``python`` for the interpreter and
    paths under the root relative to it (a run dir outside the root stays absolute). Without
    ``s``: this interpreter and the current directory."""
    python, root = (s.python, s.root) if s is not None else (sys.executable, Path.cwd())
    return shlex.join("python" if a == python else a.replace(f"{root}/", "") for a in cmd)


def check_seeds_and_overrides(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """A study's ``--seeds`` (comma-separated, in ``a.seeds``) as a list of ints >= 0, and its
    positional Hydra overrides each ``key=value``; ``parser.error`` naming the bad argument."""
    try:
        a.seeds = [int(s) for s in a.seeds.split(",") if s]
    except ValueError:
        parser.error(f"argument --seeds: {a.seeds!r} is not a comma-separated list of integers")
    if not a.seeds or min(a.seeds) < 0:
        parser.error(f"argument --seeds: {a.seeds!r} must name at least one seed >= 0")
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        parser.error(f"unexpected argument(s) {bad}: positional arguments are Hydra overrides key=value")


# --- processes --------------------------------------------------------------------------------------


class Stopped(BaseException):
    """A bench driver got SIGTERM or SIGHUP (raised by :func:`stop_on_signals`; a BaseException, so
    only the cleanup on its way out sees it)."""

    def __init__(self, sig: signal.Signals):
        super().__init__(sig.name)
        self.sig = sig


@contextlib.contextmanager
def stop_on_signals(signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While the block runs, ``signals`` raise :class:`Stopped` in the main thread (which waits on
    its child in Python, so the handler runs at once): :func:`run_logged` stops the running child
    with its process group, as it does on Ctrl-C (KeyboardInterrupt), and the caller records what
    it had. Without it the default action ends the driver at once and leaves its child running:
    the child has a session of its own."""
    def raise_stopped(signum, frame):
        for s in signals:  # a second signal must not cut short the child's stop and the caller's record
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signal.Signals(signum))

    previous = {s: signal.signal(s, raise_stopped) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_logged(cmd: Sequence[str], log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
               append: bool = False, watch: Callable[[subprocess.Popen], None] | None = None) -> None:
    """Run ``cmd`` with its output in ``log_path`` (``env``: extra variables; ``append``: after what
    the file already holds, as a resumed run's next segment); raise CellFailed on a non-zero exit or
    timeout. ``watch(proc)``, if given, runs once the child has started (a drill acting on it while
    it runs); what it raises stops the child as a timeout does.

    The child gets its own process group, so a timeout or Ctrl-C here stops it and everything it
    started (pipesgd_lab.emulate tears its namespaces down on SIGTERM).
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")} | (env or {})
    with open(log_path, "a" if append else "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            if watch is not None:
                watch(proc)
            code = proc.wait(timeout=timeout_s)
        except BaseException:
            _stop(proc)
            raise
    if code != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
        raise CellFailed(f"exit status {code} from {shlex.join(cmd[:6])} ...; log {log_path}: "
                         + " | ".join(tail))


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def emulated(cmd_module: str, cell: Cell, args: Sequence[str], s: Settings) -> list[str]:
    """``python -m pipesgd_lab.emulate --workers p --rate R [--module M] -- args``."""
    module = [] if cmd_module == "pipesgd.train" else ["--module", cmd_module]
    return [s.python, "-m", "pipesgd_lab.emulate", "--workers", str(cell.world_size), "--rate", cell.link,
            "--timeout-s", str(int(s.timeout_s)), "--mtu", str(s.mtu), *module, "--", *args]


# --- CPU accounting -----------------------------------------------------------------------------------


class CpuSampler:
    """Samples the machine-wide ``cpu`` line of /proc/stat every ``interval_s`` in a thread, so a
    record can say where the CPU went during exactly its measured steps (all processes: on a shared
    machine this includes other people's work, which is the point of reporting it)."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s = interval_s
        self.samples: list[tuple[float, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bench-cpu", daemon=True)

    @staticmethod
    def read() -> list[int] | None:
        try:
            with open("/proc/stat") as f:
                return [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            counters = self.read()
            if counters is not None:
                self.samples.append((time.time(), counters))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> list[int] | None:
        """Counter deltas (ticks) between the first sample at or after ``start`` and the last at or
        before ``end``; None if fewer than two samples fall in the window."""
        inside = [c for t, c in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        return [b - a for a, b in zip(inside[0], inside[-1])]


def cpu_split(deltas: list[list[int]]) -> dict[str, float] | None:
    """Fractions of all CPU time: user (+nice), system, irq (+softirq), idle (+iowait), steal; and
    busy_cores = (1 − idle)·cores. The kernel's network path (TCP, veth, tbf) is system + softirq."""
    deltas = [d for d in deltas if d]
    if not deltas:
        return None
    tot = [sum(col) for col in zip(*deltas)] + [0] * 8
    user, nice, system, idle, iowait, irq, softirq, steal = tot[:8]
    total = user + nice + system + idle + iowait + irq + softirq + steal
    if total <= 0:
        return None
    idle_f = (idle + iowait) / total
    return {"user": (user + nice) / total, "system": system / total, "irq": (irq + softirq) / total,
            "idle": idle_f, "steal": steal / total, "busy_cores": (1 - idle_f) * (os.cpu_count() or 1)}


# --- calibration ---------------------------------------------------------------------------------------


def calibration_for(cell: Cell, s: Settings, cache: dict[tuple, Path], tag: str = "") -> Path:
    """The calibration file for the cell's (workload, p, link), measured once per ``cache`` (a bench
    run, or one round of it) and named with ``tag`` (e.g. ``-r1``; or taken from ``calibration_dir``
    when it already holds one of that name)."""
    key = cell.calibration_key
    if key in cache:
        return cache[key]
    workload, p, link = key
    w = WORKLOADS[workload]
    name = f"{workload}-p{p}-{link}{tag}.json"
    if s.calibration_dir is not None and (s.calibration_dir / name).exists():
        cache[key] = (s.calibration_dir / name).resolve()
        log.info("calibration %s: reusing %s", name, cache[key])
        return cache[key]
    target = (s.bench_dir / "calibration" / name).resolve()
    args = ["--model", w.model, "--batch-size", str(w.batch_size), "--threads", "1",
            *(f"--model-override={o}" for o in w.model_overrides), *(["--quick"] if s.quick else [])]
    if link == "loopback":
        cmd = [s.python, "-m", "pipesgd_lab.bench.calibrate_cli", *args, "--workers", str(p), "--out", str(target)]
    else:
        # hydra.run.dir: where emulate records the link (emulate.json), next to the calibration.
        cmd = emulated("pipesgd_lab.bench.calibrate_cli", Cell("train", "sync", p, link),
                       [*args, "--out", str(target), f"hydra.run.dir={target.with_suffix('')}"], s)
    t0 = time.perf_counter()
    log.info("calibrating %s ...", name)
    run_logged(cmd, target.with_suffix(".log"), s.timeout_s)
    cal = load_calibration(target)
    log.info("calibration %s: α %.3g ms, %.1f Mbit/s, compute %.1f ms, update %.2f ms, overlap slowdown %.3f "
             "(%.0fs)", name, cal["alpha_s"] * 1e3, 8e-6 / cal["beta_s_per_byte"], cal["compute_ms"],
             cal["update_ms"], cal.get("overlap_slowdown", 1.0), time.perf_counter() - t0)
    cache[key] = target
    return target


def _calibration_summary(path: Path) -> dict:
    cal = load_calibration(path)
    keep = ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "compress_s_per_byte", "compute_ms", "update_ms",
            "overlap_slowdown", "bandwidth_mbit_s", "powersgd_s_per_flop", "barrier_s", "created")
    return {"file": str(path), **{k: cal[k] for k in keep if k in cal},
            "ring_ms": cal.get("measurements", {}).get("ring_ms"),
            "ring_predicted_ms": cal.get("measurements", {}).get("ring_predicted_ms")}


# --- cells ---------------------------------------------------------------------------------------------


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def _spread(values: list[float]) -> dict:
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def train_command(cell: Cell, run_dir: Path, cal: Path, s: Settings) -> list[str]:
    w = WORKLOADS[cell.workload]
    overrides = [*w.train_overrides, *cell.train_overrides, "dist.threads_per_worker=1",
                 f"trainer.max_steps={s.skip + s.steps}", "trainer.warmup_sync_steps=0",
                 f"trainer.log_every={s.skip + s.steps}", "trainer.eval_max_batches=1", "data.eval_batch_size=100",
                 f"timing.calibration={cal}", *s.overrides, f"hydra.run.dir={run_dir}"]
    if cell.emulated:
        return emulated("pipesgd.train", cell, overrides, s)
    return [s.python, "-m", "pipesgd.train", *overrides]


def run_train_repeat(cell: Cell, cal: Path, s: Settings, r: int) -> dict:
    """One training run (repeat ``r``, a new process): its steps after ``skip``, median, prediction,
    CPU split and command, for :func:`train_record` to pool."""
    run_dir = (s.bench_dir / "cells" / _slug(cell.name) / f"r{r}").resolve()
    cmd = train_command(cell, run_dir, cal, s)
    load = list(os.getloadavg())
    with probe.around(s.probe_s) as host_speed, CpuSampler() as sampler:
        run_logged(cmd, run_dir.parent / f"r{r}.log", s.timeout_s)
    history = json.loads((run_dir / "history.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = len(history["iter_ms"])
    if steps <= s.skip:
        raise CellFailed(f"{cell.name}: the run recorded {steps} steps, not more than skip={s.skip}")
    start = history["wall_time"][s.skip - 1] if s.skip else history["wall_time"][0] - history["iter_ms"][0] / 1e3
    return {"steps": {k: history[k][s.skip:] for k in STEP_FIELDS},
            "median": statistics.median(history["iter_ms"][s.skip:]),
            "predicted": summary.get("predicted_iter_ms"), "summary": summary,
            "cpu": sampler.between(start, history["wall_time"][-1]), "run_dir": str(run_dir),
            "command": recorded(cmd, s), "loadavg_before": load,
            "host_speed": host_speed or None}


def train_record(cell: Cell, repeats: Sequence[dict]) -> dict:
    """A train cell's record from its runs (:func:`run_train_repeat`): medians over the pooled steps."""
    pooled: dict[str, list[float]] = {k: [] for k in STEP_FIELDS}
    for rep in repeats:
        for k in STEP_FIELDS:
            pooled[k] += rep["steps"][k]
    predicted = [rep["predicted"] for rep in repeats if rep["predicted"] is not None]
    summary = repeats[-1]["summary"]
    it = _spread(pooled["iter_ms"])
    pred = statistics.median(predicted) if predicted else None
    comm = [c for c in pooled["comm_ms"] if c > 0]  # steps that applied a reduction
    return {
        "n": it["n"], "median_iter_ms": it["median"], "min_iter_ms": it["min"], "max_iter_ms": it["max"],
        "repeat_median_iter_ms": [rep["median"] for rep in repeats],
        "predicted_iter_ms": pred, "predicted_from": summary.get("predicted_from"),
        "rel_error": None if pred is None else (pred - it["median"]) / it["median"],
        "median_compute_ms": statistics.median(pooled["compute_ms"]),
        "median_exposed_comm_ms": statistics.median(pooled["exposed_comm_ms"]),
        "median_comm_ms": statistics.median(comm) if comm else 0.0,
        "median_update_ms": statistics.median(pooled["update_ms"]),
        "bytes_per_step": summary.get("bytes_per_step"), "compression_ratio": summary.get("compression_ratio"),
        "params": WORKLOADS[cell.workload].params, "batch_size": WORKLOADS[cell.workload].batch_size,
        "model": WORKLOADS[cell.workload].model, "cpu": cpu_split([rep["cpu"] for rep in repeats if rep["cpu"]]),
        "command": repeats[0]["command"], "run_dirs": [rep["run_dir"] for rep in repeats],
        "host_speed": [rep.get("host_speed") for rep in repeats],
    }


def run_train_cell(cell: Cell, cal: Path, s: Settings) -> dict:
    """``repeats`` training runs one after another; medians over the pooled per-step data after ``skip`` steps."""
    return train_record(cell, [run_train_repeat(cell, cal, s, r) for r in range(s.repeats)])


def run_allreduce_cell(cell: Cell, cal: Path, s: Settings) -> dict:
    run_dir = (s.bench_dir / "cells" / _slug(cell.name)).resolve()
    args = [f"algo={cell.mode}", f"bytes={cell.nbytes}", f"repeats={s.allreduce_repeats}", "warmup=2"]
    if cell.emulated:
        cmd = emulated("pipesgd_lab.bench.allreduce", cell, [*args, f"hydra.run.dir={run_dir}"], s)
    else:
        cmd = [s.python, "-m", "pipesgd_lab.bench.allreduce", *args, f"nproc={cell.world_size}",
               f"hydra.run.dir={run_dir}"]
    run_logged(cmd, run_dir / "run.log", s.timeout_s)
    result = json.loads((run_dir / "allreduce.json").read_text())
    ms = [x * 1e3 for x in result["seconds"]]
    it = _spread(ms)
    cal_values = load_calibration(cal)
    p, nbytes = cell.world_size, result["bytes"]
    # The cost the cell's algorithm declares (pipesgd/comm/): the tree's is not the ring's.
    pred = allreduce_time(cell.mode, nbytes, p, cal_values["alpha_s"], cal_values["beta_s_per_byte"],
                          cal_values["gamma_s_per_byte"]) * 1e3
    moved = ring_bytes(nbytes, p, 1)  # bytes each rank sends in a bandwidth-optimal allreduce
    rate = parse_bandwidth(cell.link) if cell.emulated else None
    bound = None if rate is None else moved * 8 / rate * 1e3
    return {
        "n": it["n"], "median_iter_ms": it["median"], "min_iter_ms": it["min"], "max_iter_ms": it["max"],
        "predicted_iter_ms": pred, "predicted_from": "calibration (α, β, γ)",
        "rel_error": (pred - it["median"]) / it["median"], "bytes": nbytes,
        "busbw_mbit_s": moved * 8 / (it["median"] / 1e3) / 1e6, "bound_ms": bound,
        "rank_cpu_cores": {k: statistics.fmean(r[k] for r in result["cpu_cores_per_rank"]) for k in ("user", "system")},
        "fraction_of_bound": None if bound is None else bound / it["median"],
        "command": recorded(cmd, s), "run_dirs": [str(run_dir)],
    }


# --- the suite -----------------------------------------------------------------------------------------


def base_record(cell: Cell, s: Settings) -> dict:
    return {
        "name": cell.name, "kind": cell.kind, "mode": cell.mode, "comm": cell.comm if cell.kind == "train" else None,
        "width": cell.width, "compressor": cell.compressor, "world_size": cell.world_size, "link": cell.link,
        "workload": cell.workload if cell.kind == "train" else None, "commit": s.commit, "host": fingerprint(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "loadavg_before": list(os.getloadavg()),
        "config": {"steps": s.steps, "skip": s.skip, "repeats": s.repeats if cell.kind == "train" else 1,
                   "allreduce_repeats": s.allreduce_repeats, "quick": s.quick, "threads_per_worker": 1,
                   "interleaved": s.interleave, "calibrate_each_round": s.calibrate_each_round, "mtu": s.mtu,
                   "overrides": list(s.overrides), "cpus": os.cpu_count()},
    }


def run_cells(cells: Sequence[Cell], s: Settings) -> Iterator[dict]:
    """Yield one record per cell; a failed cell yields a record with ``error`` set. With
    ``s.interleave`` the train cells' repeats run in rounds (:func:`run_rounds`)."""
    if s.interleave:
        yield from run_rounds(cells, s)
        return
    calibrations: dict[tuple, Path] = {}
    for i, cell in enumerate(cells, 1):
        log.info("[%d/%d] %s", i, len(cells), cell.name)
        record = base_record(cell, s)
        t0 = time.perf_counter()
        try:
            cal = calibration_for(cell, s, calibrations)
            record["calibration"] = _calibration_summary(cal)
            run = run_train_cell if cell.kind == "train" else run_allreduce_cell
            record |= run(cell, cal, s)
        except (CellFailed, OSError, ValueError, KeyError) as e:
            log.error("%s failed: %s", cell.name, e)
            record["error"] = str(e)
        record["wall_s"] = time.perf_counter() - t0
        _log_record(record)
        yield record


def run_rounds(cells: Sequence[Cell], s: Settings) -> Iterator[dict]:
    """Interleaved repeats: round r runs every train cell once before round r + 1 starts, so a slow
    drift of the machine (another job, thermal state) spreads over every cell instead of landing on
    the cells that happened to run during it. Yields the cell's record, pooled over the rounds done
    so far, after each of its runs (a sweep stopped early keeps complete rounds). Allreduce cells
    run whole in round 0. A cell whose run fails yields a record with ``error`` and sits out the
    rounds after. With ``s.calibrate_each_round`` every round calibrates each condition afresh
    (files ``<condition>-r<round>.json``), its cells run against that round's calibration, and the
    record keeps each round's (``round_calibrations``): the model's compute then comes from the
    same rounds as the cells it predicts, not from one sample minutes before them."""
    calibrations: dict[tuple, Path] = {}
    runs: dict[str, list[dict]] = {c.name: [] for c in cells}
    records: dict[str, dict] = {}  # made at a cell's first run: its date and load are that run's
    for r in range(s.repeats):
        todo = [c for c in cells if "error" not in records.get(c.name, {}) and (c.kind == "train" or r == 0)]
        tag = f"-r{r}" if s.calibrate_each_round else ""
        if s.calibrate_each_round:
            calibrations = {}
        for i, cell in enumerate(todo, 1):
            log.info("round %d/%d [%d/%d] %s", r + 1, s.repeats, i, len(todo), cell.name)
            record = records.setdefault(cell.name, base_record(cell, s))
            t0 = time.perf_counter()
            try:
                cal = calibration_for(cell, s, calibrations, tag)
                record["calibration"] = _calibration_summary(cal)
                if s.calibrate_each_round:
                    record.setdefault("round_calibrations", []).append(record["calibration"])
                if cell.kind == "train":
                    runs[cell.name].append(run_train_repeat(cell, cal, s, r))
                    record |= train_record(cell, runs[cell.name])
                    record["round_loadavg_before"] = [rep["loadavg_before"] for rep in runs[cell.name]]
                else:
                    record |= run_allreduce_cell(cell, cal, s)
            except (CellFailed, OSError, ValueError, KeyError) as e:
                log.error("%s failed in round %d: %s", cell.name, r + 1, e)
                record["error"] = f"round {r + 1}: {e}"
            record["wall_s"] = record.get("wall_s", 0.0) + time.perf_counter() - t0
            record["config"]["rounds_done"] = len(runs[cell.name]) if cell.kind == "train" else 1
            _log_record(record)
            yield dict(record)


def _log_record(record: dict) -> None:
    if "error" in record:
        return
    err = record["rel_error"]
    log.info("    median %.1f ms (min %.1f, max %.1f, n=%d), predicted %s%s, %.0fs", record["median_iter_ms"],
             record["min_iter_ms"], record["max_iter_ms"], record["n"],
             "-" if record["predicted_iter_ms"] is None else f"{record['predicted_iter_ms']:.1f} ms",
             "" if err is None else f" ({100 * err:+.1f} %)", record["wall_s"])


def merge(existing: list[dict], new: list[dict], order: Sequence[str]) -> list[dict]:
    """``existing`` with same-named cells replaced by ``new`` ones, in grid ``order`` (unknown last)."""
    by_name = {c["name"]: c for c in existing} | {c["name"]: c for c in new}
    rank = {name: i for i, name in enumerate(order)}
    return sorted(by_name.values(), key=lambda c: (rank.get(c["name"], len(rank)), c["name"]))


def save(path: Path, result: object) -> None:
    """``result`` as JSON at ``path``, atomically, its directory made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
