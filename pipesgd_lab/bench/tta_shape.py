"""A time-to-accuracy study's shape: M replicas of k ranks each (``--workers M --ranks-per-replica k``).

k = 1 is every study before the option: M processes, one replica each, the recipe's per-rank batch,
and records and run directories named as they always were. k > 1 runs M·k processes, k consecutive
ranks one replica (``dist.ranks_per_replica=k``: data parallel inside it, the DiLoCo exchange between
replicas), each rank at 1/k of the recipe's per-rank batch, so the global batch (and the learning
rate scaled from it) is the k = 1 study's; where the recipe evaluates a sample of the test set
(``trainer.eval_max_batches``), each rank evaluates 1/k as many batches, so the sample keeps its
size. Such a study's records, run directories, timing file and result carry the shape in their
names (``-<M>x<k>``) and every record says it (``replicas``, ``ranks_per_replica``), which the
report checks: a study of one shape never composes another's runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipesgd_lab.emulate.cli import REPLICA_KEY

from .tta_records import MISSING, lookup

SCALED = {"data.batch_size": "the recipe's per-rank batch", "trainer.eval_max_batches": "its evaluation batches"}
"""Keys a shape with k > 1 divides by k (key -> what it is, for the error)."""


@dataclass(frozen=True)
class Shape:
    """``replicas`` replicas of ``ranks_per_replica`` ranks; ``scaled``: the per-rank settings a
    k > 1 shape gives its ranks (key -> value; empty for k = 1)."""

    replicas: int
    ranks_per_replica: int = 1
    scaled: tuple[tuple[str, int], ...] = ()

    @property
    def world(self) -> int:
        return self.replicas * self.ranks_per_replica

    @property
    def label(self) -> str:
        """What the shape adds to a name: nothing for k = 1 (names as before the option), else ``-<M>x<k>``."""
        return "" if self.ranks_per_replica == 1 else f"-{self.replicas}x{self.ranks_per_replica}"

    def overrides(self, replica_key: bool = True) -> list[str]:
        """What makes a run this shape, after the user's overrides (they win over a user's batch: the
        value here was computed from it). ``replica_key`` False: without ``dist.ranks_per_replica``
        (torchft's arms, whose replica group is a torchrun job of k ranks)."""
        if self.ranks_per_replica == 1:
            return []
        key = [f"{REPLICA_KEY}={self.ranks_per_replica}"] if replica_key else []
        return [*key, *(f"{k}={v}" for k, v in self.scaled)]

    def fields(self) -> dict:
        """The shape as every record and timing row states it."""
        return {"replicas": self.replicas, "ranks_per_replica": self.ranks_per_replica}

    def holds(self, record: Mapping) -> bool:
        """Whether ``record`` (a curve or validation record, a timing row) ran in this shape: its ranks
        per replica (records from before the field: one), and for k > 1 its replicas. At k = 1 the
        replica count is not checked, as before the option (a torchft arm's summary is one group's,
        world size 1)."""
        k = record.get("ranks_per_replica", 1)
        return k == self.ranks_per_replica and (k == 1 or record.get("replicas") == self.replicas)

    def describe(self) -> str:
        return f"{self.replicas} replica(s) of {self.ranks_per_replica} rank(s)"


def shape_for(replicas: int, ranks_per_replica: int, recipe: Mapping | None = None) -> Shape:
    """The shape of ``replicas`` x ``ranks_per_replica``, whose per-rank settings (:data:`SCALED`)
    are the composed ``recipe``'s divided by k (``recipe``: the config with the study's overrides;
    not read for k = 1). ValueError naming ``--ranks-per-replica`` where one does not divide."""
    if ranks_per_replica < 1:
        raise ValueError(f"--ranks-per-replica must be an integer >= 1, got {ranks_per_replica}")
    if ranks_per_replica == 1:
        return Shape(replicas)
    assert recipe is not None, "a shape of several ranks per replica divides the recipe's settings"
    scaled = []
    for key, what in SCALED.items():
        value = lookup(recipe, key)
        if value is MISSING or value is None and key != "data.batch_size":  # null: the whole test set
            continue
        if not isinstance(value, int) or value % ranks_per_replica:
            raise ValueError(f"--ranks-per-replica {ranks_per_replica} divides {what} ({key}={value}) among a "
                             f"replica's ranks, and {value} is not a multiple of {ranks_per_replica}: choose a k "
                             f"that divides it, or set {key} among the overrides")
        scaled.append((key, value // ranks_per_replica))
    return Shape(replicas, ranks_per_replica, tuple(scaled))


def run_shape(summary: Mapping) -> dict:
    """:meth:`Shape.fields` of the run a summary.json describes, as it ran: its
    ``dist.ranks_per_replica`` (1 where the config has none) and its world size over that; a torchft
    replica group's summary (it states ``group_ranks``, its torchrun job's ranks) the groups its
    config names (``trainer.live.replicas``; None under the live launcher, which sets none)."""
    config = summary.get("config") or {}
    if "group_ranks" in summary:
        replicas = lookup(config, "trainer.live.replicas")
        return {"replicas": None if replicas is MISSING else replicas, "ranks_per_replica": summary["group_ranks"]}
    k = lookup(config, REPLICA_KEY)
    k = 1 if k is MISSING or k is None else int(k)
    world = summary.get("world_size")
    return {"replicas": None if world is None else world // k, "ranks_per_replica": k}


def compose_recipe(recipe: str, overrides: Sequence[str]) -> dict:
    """The training config ``+experiment=<recipe>`` with ``overrides`` composes to (Hydra's compose
    API: the config a run would start from, before any run directory exists)."""
    from importlib import resources

    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from pipesgd.schema import register

    register()  # the typed schema conf/config.yaml's defaults name first
    conf = str(resources.files("pipesgd") / "conf")
    given = [o for o in overrides if not o.lstrip("+~").startswith("hydra.")]  # the run's, not the config's
    try:
        with initialize_config_dir(config_dir=conf, version_base="1.3"):
            cfg = compose("config", overrides=[f"+experiment={recipe}", *given])
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"+experiment={recipe} with {given} does not compose ({e}), so its batch cannot be "
                         "divided among a replica's ranks") from None
    return OmegaConf.to_container(cfg, resolve=False)
