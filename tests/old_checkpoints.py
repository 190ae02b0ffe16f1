"""Checkpoints as format 1 wrote them, for the tests that such a checkpoint is refused and that
``python -m pipesgd.reliability.checkpoint convert`` makes it resume: built from a format-2 state the way the
removed shim hashed a config (the ``staleness`` group as ``trainer.staleness`` / ``trainer.dc_*``,
the digest over that form)."""

from __future__ import annotations

import hashlib
import json

from pipesgd.staleness import available, rule_class


def as_format_1(state: dict, oldest: bool = False) -> dict:
    """``state`` (format 2) in format 1's layout, in place. ``oldest``: also the data position as
    ``batch`` (batches of the epoch), no ``evals``, and each rank's CUDA RNG (when it has one) as a
    list of every visible GPU's, its own at index ``rank``, as the first format-1 checkpoints had."""
    config = state["config"]
    group = config.pop("staleness")
    name = next(n for n in available()
                if f"{rule_class(n).__module__}.{rule_class(n).__qualname__}" == group["_target_"])
    config["trainer"].update(staleness=name, dc_lambda=group.get("dc_lambda", 0.04),
                             dc_adaptive=group.get("dc_adaptive", False))
    if group.get("dc_momentum", 0.95) != 0.95:
        config["trainer"]["dc_momentum"] = group["dc_momentum"]
    state.update(format=1, config_digest=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest())
    if oldest:
        state["batch"] = state.pop("consumed") // (config["data"]["batch_size"] * state["world_size"])
        state.pop("evals")
        for rank, mine in enumerate(state["ranks"]):
            if mine["rng"].get("cuda") is not None:
                mine["rng"]["cuda"] = [mine["rng"]["cuda"].clone() * 0 + i for i in range(rank)] + [mine["rng"]["cuda"]]
    return state
