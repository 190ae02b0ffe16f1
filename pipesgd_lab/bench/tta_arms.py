"""The time-to-accuracy study's arms (docs/time-to-accuracy.md): each one a set of overrides on the
recipe, spelled here only, for the driver (tta.py) and the report (tta_report.py)."""

from __future__ import annotations

from pipesgd.timing.rounds import streaming_schedule

from . import tta_compose as compose

RECIPE = "resnet_cifar_tta"
_K1 = ("trainer.width=1", "trainer.warmup_sync_steps=0", "staleness=none")
ARMS: dict[str, tuple[str, ...]] = {
    "ddp": ("trainer.mode=ddp", *_K1, "compressor=none"),
    "ddp-fp16": ("trainer.mode=ddp", *_K1, "compressor=fp16"),
    # torch's powerSGD_hook at rank 2, warm start and error feedback on, its default 1000 plain steps
    "ddp-powersgd": ("trainer.mode=ddp", *_K1, "compressor=powersgd", "compressor.rank=2"),
    "sync": ("trainer.mode=sync", *_K1, "compressor=none"),
    "pipe": ("trainer.mode=pipe", "trainer.width=2", "staleness=none", "compressor=none"),
    "pipe+lookahead": ("trainer.mode=pipe", "trainer.width=2", "staleness=lookahead", "compressor=none"),
    "pipe+lookahead-int8": ("trainer.mode=pipe", "trainer.width=2", "staleness=lookahead",
                            "compressor=int8"),
    "pipe+lookahead-fp16": ("trainer.mode=pipe", "trainer.width=2", "staleness=lookahead",
                            "compressor=fp16"),
    # DDP with the pipelined hook around torch's powerSGD_hook (docs/ddp-hook.md), the lookahead rule through
    # the hook's forward context; its warm-up is the hook's own 1000 plain (pipelined) allreduces
    "ddp-pipelined+lookahead-powersgd": ("trainer.mode=ddp", "trainer.width=2", "trainer.warmup_sync_steps=0",
                                         "staleness=lookahead", "compressor=powersgd", "compressor.rank=2"),
    compose.COMPUTE_ARM: ("trainer.mode=local", *_K1, "compressor=none"),
}
"""Arm name (as in the bench grid) -> its overrides on the recipe. Spelled here only."""
WARMUP_KEYS = {arm: "trainer.warmup_sync_steps" for arm, o in ARMS.items() if "trainer.mode=pipe" in o} | {
    arm: "compressor.ddp_start_iter" for arm, o in ARMS.items() if "trainer.mode=ddp" in o and "compressor=powersgd" in o}
"""Arm -> the setting that counts its warm-up steps, for the arms that have one: a pipe arm's
synchronous steps, and the plain allreduce steps torch's PowerSGD hook takes before it compresses.
A timing run sets it to time those steps as they run, then the arm's own steps."""
METRICS: dict[str, compose.Metric] = {"gpt_shakespeare": compose.LOSS}
"""Recipe -> what its study compares, where it is not test accuracy (higher is better): the GPT
recipe's target is sync's final validation loss + 1 % (lower is better)."""


def metric_for(recipe: str) -> compose.Metric:
    return METRICS.get(recipe, compose.ACCURACY)


TIMING_ONLY = (compose.COMPUTE_ARM,)
"""Arms that are timed but never trained to a curve: ``compute`` (every worker trains alone, no
communication) is the ceiling, the step time no scheme can beat on this machine."""


# --- the period-H study (docs/period-h.md, "Against torchft's DiLoCo"): the DiLoCo family at a round length H ---
STUDY_H = (2, 5, 25)
"""The H the study's links take from :data:`pipesgd.timing.rounds.H_CANDIDATES` (the smallest whose
int8 exchange hides under a round's compute, :func:`~pipesgd.timing.rounds.smallest_h`: 100 and 25
Mbit/s 2, 5 Mbit/s 5, 1 Mbit/s 25 here); its DiLoCo arms exist at each and at 2H and 4H (torchft's
best of three)."""
_ROUNDS = ("trainer.warmup_sync_steps=0", "trainer.check_every=null")
_BOTH = "trainer.live.min_replicas=2"
_PAPERS_OUTER = ("outer_optimizer.lr=0.7", "outer_optimizer.momentum=0.9", "outer_optimizer.nesterov=true")
"""The DiLoCo papers' outer step (conf/outer_optimizer/nesterov.yaml), the recipe's default when
these arms' records were made: pinned, so an arm stays what its records ran now that the default
follows H and M (pipesgd.outer)."""
_PLAIN_OUTER = ("outer_optimizer.lr=1.0", "outer_optimizer.momentum=0.0", "outer_optimizer.nesterov=false")
"""A plain outer step of lr 1, no momentum (conf/outer_optimizer/sgd.yaml, spelled key by key so a
record's config can be checked against it): the replicas' average move."""


def _diloco_arms() -> dict[str, tuple[str, ...]]:
    arms: dict[str, tuple[str, ...]] = {}
    for h in sorted({h * k for h in STUDY_H for k in (1, 2, 4)}):
        every = f"trainer.sync_every={h}"
        arms[f"diloco-eager-int8-h{h}"] = ("trainer.mode=pipe", "trainer.width=2", "staleness=eager",
                                           "compressor=int8", every, *_PAPERS_OUTER, *_ROUNDS)
        # the same with a plain outer step: no outer momentum to carry the late step's error forward
        # (docs/period-h.md, the diagnosis)
        arms[f"diloco-eager-sgd-int8-h{h}"] = ("trainer.mode=pipe", "trainer.width=2", "staleness=eager",
                                               "compressor=int8", every, *_PLAIN_OUTER, *_ROUNDS)
        arms[f"diloco-none-int8-h{h}"] = ("trainer.mode=pipe", "trainer.width=2", "staleness=none",
                                          "compressor=int8", every, *_PAPERS_OUTER, *_ROUNDS)
        # the staleness-aware outer steps, a whole round late (docs/period-h.md): eager with the outer
        # momentum fed arrived averages only, and the late average at half the outer rate
        arms[f"diloco-dn-int8-h{h}"] = ("trainer.mode=pipe", "trainer.width=2", "staleness=delayed_nesterov",
                                        "compressor=int8", every, *_PAPERS_OUTER, *_ROUNDS)
        arms[f"diloco-damped-int8-h{h}"] = ("trainer.mode=pipe", "trainer.width=2", "staleness=damped",
                                            "compressor=int8", every, *_PAPERS_OUTER, *_ROUNDS)
        arms[f"diloco-blocking-h{h}"] = ("trainer.mode=sync", "trainer.width=1", "staleness=none",
                                         "compressor=none", every, *_PAPERS_OUTER, *_ROUNDS)
        arms[f"diloco-blocking-int8-h{h}"] = ("trainer.mode=sync", "trainer.width=1", "staleness=none",
                                              "compressor=int8", every, *_PAPERS_OUTER, *_ROUNDS)
        # torchft 0.2.0's own DiLoCo behind a lighthouse, one replica group per worker (fp32 on the CPU);
        # every quorum holds both groups (a group a second late would otherwise sync alone)
        arms[f"torchft-diloco-h{h}"] = ("trainer.mode=torchft_diloco", "staleness=none", "compressor=none",
                                        every, *_PAPERS_OUTER, *_ROUNDS, _BOTH)
        fragments, delay = streaming_schedule(h)
        if delay >= 0:
            arms[f"torchft-streaming-h{h}"] = ("trainer.mode=torchft_diloco", "staleness=none", "compressor=none",
                                               every, f"trainer.fragments={fragments}", f"trainer.sync_delay={delay}",
                                               *_PAPERS_OUTER, *_ROUNDS, _BOTH)
        if fragments > 1:
            # the fragments alone, blocking (width 1, no delay): what streaming costs before any lateness
            arms[f"diloco-fragments-int8-h{h}"] = ("trainer.mode=sync", "trainer.width=1", "staleness=none",
                                                   "compressor=int8", every, f"trainer.fragments={fragments}",
                                                   *_PAPERS_OUTER, *_ROUNDS)
        if delay >= 1:
            # pipesgd's own streaming on torchft's schedule at this H (F fragments, each round's average
            # landing τ steps after its launch, the steps since kept), int8 in the ring, under each rule
            stream = ("trainer.mode=pipe", "trainer.width=2", "compressor=int8", every,
                      f"trainer.fragments={fragments}", f"trainer.sync_delay={delay}", *_ROUNDS)
            arms[f"diloco-streaming-none-int8-h{h}"] = (*stream, "staleness=none", *_PAPERS_OUTER)
            arms[f"diloco-streaming-none-sgd-int8-h{h}"] = (*stream, "staleness=none", *_PLAIN_OUTER)
            arms[f"diloco-streaming-eager-int8-h{h}"] = (*stream, "staleness=eager", *_PAPERS_OUTER)
            arms[f"diloco-streaming-eager-sgd-int8-h{h}"] = (*stream, "staleness=eager", *_PLAIN_OUTER)
            # streaming DiLoCo's merge at the landing (α = 0.5) instead of keeping the steps since the launch
            arms[f"diloco-streaming-mix-int8-h{h}"] = (*stream, "staleness=none", "trainer.landing_alpha=0.5", *_PAPERS_OUTER)
            # the streaming paper's strided fragments: layers dealt round-robin across the depth
            arms[f"diloco-streaming-strided-int8-h{h}"] = (*stream, "staleness=none", "trainer.fragment_layout=strided", *_PAPERS_OUTER)
    return arms


DEFAULT_ARMS = tuple(a for a in ARMS if a not in TIMING_ONLY)
"""The time-to-accuracy study's arms, what ``--arms`` runs when not given."""
ARMS.update(_diloco_arms())


def sync_every(arm: str) -> int:
    """The round length H of ``arm`` (1: it exchanges every step)."""
    for o in ARMS[arm]:
        if o.startswith("trainer.sync_every="):
            return int(o.split("=", 1)[1])
    return 1


def arm_mode(arm: str) -> str:
    """The ``trainer.mode`` ``arm`` runs (the recipe's, pipe, where it names none)."""
    for o in ARMS[arm]:
        if o.startswith("trainer.mode="):
            return o.split("=", 1)[1]
    return "pipe"
