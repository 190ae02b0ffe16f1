"""Every engine's trajectory as a parameter checksum: a short run of each mode x width x rule on two
Gloo ranks (the reference model and batches of tests/engine_reference.py), the sha256 of every
rank's weights after a mid-run checkpoint round trip and after the flush.

``tests/trajectories.json`` holds the checksums taken on main at ca9ff32, before the in-flight
schedule was shared; tests/distributed/test_trajectories.py recomputes them and asserts
each is bit-identical. ``python tests/trajectories.py --record`` rewrites the file (only for a change
that means to move a trajectory, said in its commit).
"""

from __future__ import annotations

import hashlib
import json
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_reference import LR, MOMENTUM, make_model, loss_of  # noqa: E402

RECORD = Path(__file__).with_name("trajectories.json")
STEPS = 12


def _sha(model: nn.Module) -> str:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def cells() -> list[tuple[str, dict]]:
    """(name, settings) of every cell: the engine, its width, its rule and what else it varies."""
    out = []
    for width in (1, 2, 3):
        for rule in ("none", "lookahead", "predict", "dc", "dga"):
            if width == 1 and rule != "none":
                continue
            out.append((f"pipe/w{width}/{rule}", dict(engine="pipe", width=width, staleness=rule)))
    out.append(("pipe/w2/none/warmup3", dict(engine="pipe", width=2, staleness="none", warmup_sync_steps=3)))
    out.append(("pipe/w2/none/int8", dict(engine="pipe", width=2, staleness="none", compressor="int8")))
    out.append(("pipe/w3/none/skip", dict(engine="pipe", width=3, staleness="none", nonfinite="skip", nan_at=4)))
    for width, rule in ((1, "none"), (2, "none"), (3, "none"), (2, "eager")):
        for fragments, delay in ((1, 0), (2, 0), (2, 1)):
            if delay and width != 2:
                continue
            out.append((f"diloco/w{width}/{rule}/F{fragments}/d{delay}",
                        dict(engine="diloco", width=width, staleness=rule, fragments=fragments, sync_delay=delay)))
    out.append(("diloco/w2/none/F1/d0/int8", dict(engine="diloco", width=2, staleness="none", fragments=1, sync_delay=0,
                                                   compressor="int8")))
    for rule in ("none", "lookahead"):
        out.append((f"ddp/w2/{rule}", dict(engine="ddp", width=2, staleness=rule)))
    return out


def _engine(cell: dict, model: nn.Module, opt: torch.optim.Optimizer):
    from pipesgd import PipeDiLoCo, PipeSGD

    common = dict(compressor=cell.get("compressor", "none"), allreduce="ring", staleness=cell["staleness"],
                  nonfinite=cell.get("nonfinite", "abort"))
    if cell["engine"] == "pipe":
        return PipeSGD(opt, model.parameters(), width=cell["width"], module=model,
                       warmup_sync_steps=cell.get("warmup_sync_steps", 0), **common)
    return PipeDiLoCo(opt, model.parameters(), 4, width=cell["width"], module=model,
                      fragments=cell["fragments"], sync_delay=cell["sync_delay"],
                      outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), **common)


def _run_engine(rank: int, cell: dict, saved: dict | None = None, save_only: bool = False):
    """The cell's run: its checksums (after the mid-run round trip, after the flush). ``save_only``:
    the state at the mid-run checkpoint instead; ``saved``: resume from such a state (written by
    this code or an older one) and run to the end."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine = _engine(cell, model, opt)
    shas = []
    for step in range(STEPS // 2 + 1 if saved is not None else 0, STEPS):
        if step == STEPS // 2 + 1 and saved is not None:
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            engine.load_state_dict(saved["engine"])
        opt.zero_grad()
        with engine.forward_context():
            loss_of(model, rank, step).backward()
        if step == cell.get("nan_at") and rank == 1:
            next(model.parameters()).grad[0, 0] = float("nan")
        engine.step()
        if step == STEPS // 2:  # a checkpoint round trip mid-flight, into a fresh engine
            state = {"engine": engine.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
            engine.close()
            if save_only:
                return state
            model = make_model()
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            engine = _engine(cell, model, opt)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            engine.load_state_dict(state["engine"])
            shas.append(_sha(model))
    engine.flush()
    shas.append(_sha(model))
    engine.close()
    return shas


def _run_ddp(rank: int, cell: dict, saved: dict | None = None, save_only: bool = False):
    """The pipelined DDP hook's run, as :func:`_run_engine`'s (the width keyword only off width 2,
    which the hook took with the shared schedule)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd.hooks import PipelinedState, pipelined

    model = make_model()
    if saved is not None:
        model.load_state_dict(saved["model"])
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    width = {} if cell["width"] == 2 else {"width": cell["width"]}
    state = PipelinedState(ddp, optimizer=opt, staleness=cell["staleness"], **width)
    ddp.register_comm_hook(state, pipelined())
    if saved is not None:
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hook"])
    shas = []
    for step in range(STEPS // 2 + 1 if saved is not None else 0, STEPS):
        opt.zero_grad()
        with state.forward_context():
            loss_of(ddp, rank, step).backward()
        if state.ready():
            opt.step()
        if step == STEPS // 2:
            kept = state.state_dict()
            if save_only:
                return {"hook": kept, "model": model.state_dict(), "opt": opt.state_dict()}
            shas.append(_sha(model))
            rounds = kept["pending"] if isinstance(kept["pending"], list) else [kept["pending"]]  # before: a dict
            pending = torch.cat([r[n].reshape(-1) for r in rounds for n in sorted(r)])
            shas.append(hashlib.sha256(pending.numpy().tobytes()).hexdigest()[:16])
    state.flush(opt)
    shas.append(_sha(model))
    return shas


def later_cells() -> list[tuple[str, dict]]:
    """Cells added with the shared schedule (no record from before it): the hook at width 3."""
    return [(f"ddp/w3/{rule}", dict(engine="ddp", width=3, staleness=rule)) for rule in ("none", "lookahead")]


def run_all(rank: int, world: int, names: list[str] | None = None, saved_path: str | None = None,
            save_only: bool = False) -> dict:
    """Per cell: its checksums; ``save_only``: its mid-run state; ``saved_path`` (a file of
    :func:`save_all`): the checksums of the runs resumed from the states in it."""
    torch.use_deterministic_algorithms(True)
    saved = None if saved_path is None else torch.load(saved_path, weights_only=False)
    out = {}
    for name, cell in cells() + later_cells():
        if names is not None and name not in names:
            continue
        run = _run_ddp if cell["engine"] == "ddp" else _run_engine
        out[name] = run(rank, cell, None if saved is None else saved[name][rank], save_only)
    return out


def save_all(path: Path) -> None:
    """Every recorded cell's mid-run state, per rank, into ``path`` (tests/trajectories-ca9ff32.pt
    was written so by the code before the schedule was shared)."""
    from distributed_utils import run_workers

    names = [name for name, _ in cells()]
    per_rank = run_workers(run_all, 2, names, None, True, timeout=300)
    torch.save({name: [r[name] for r in per_rank] for name in names}, path)


def resume_all(path: Path) -> dict[str, list[list[str]]]:
    """Per cell, each rank's checksums of the runs resumed from the states in ``path``."""
    from distributed_utils import run_workers

    names = list(torch.load(path, weights_only=False))
    per_rank = run_workers(run_all, 2, names, str(path), timeout=300)
    return {name: [r[name] for r in per_rank] for name in names}


def measure(names: list[str] | None = None) -> dict[str, list[list[str]]]:
    """Per cell, each rank's checksums (two ranks)."""
    from distributed_utils import run_workers

    per_rank = run_workers(run_all, 2, names, timeout=300)
    return {name: [r[name] for r in per_rank] for name in per_rank[0]}


if __name__ == "__main__":
    if "--save" in sys.argv:
        save_all(Path(sys.argv[sys.argv.index("--save") + 1]))
        sys.exit(0)
    found = measure([name for name, _ in cells()])
    if "--record" in sys.argv:
        RECORD.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    else:
        print(json.dumps(found, indent=1, sort_keys=True))
