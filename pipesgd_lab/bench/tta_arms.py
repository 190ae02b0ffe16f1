"""The time-to-accuracy study's arms (docs/time-to-accuracy.md): each one a set of overrides on the
recipe, spelled here only, for the driver (tta.py) and the report (tta_report.py)."""

from __future__ import annotations

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
