"""The time-to-accuracy study's arms (docs/time-to-accuracy.md): each one a set of overrides on the
recipe, spelled here only, for the driver (tta.py) and the report (tta_report.py)."""

from __future__ import annotations

from . import tta_compose as compose

RECIPE = "resnet_cifar_tta"
_K1 = ("trainer.width=1", "trainer.warmup_sync_steps=0", "trainer.staleness=none")
ARMS: dict[str, tuple[str, ...]] = {
    "ddp": ("trainer.mode=ddp", *_K1, "compressor=none"),
    "ddp-fp16": ("trainer.mode=ddp", *_K1, "compressor=fp16"),
    # torch's powerSGD_hook at rank 2, warm start and error feedback on, its default 1000 plain steps
    "ddp-powersgd": ("trainer.mode=ddp", *_K1, "compressor=powersgd", "compressor.rank=2"),
    "sync": ("trainer.mode=sync", *_K1, "compressor=none"),
    "pipe": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=none", "compressor=none"),
    "pipe+lookahead": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead", "compressor=none"),
    "pipe+lookahead-int8": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead",
                            "compressor=int8"),
    "pipe+lookahead-fp16": ("trainer.mode=pipe", "trainer.width=2", "trainer.staleness=lookahead",
                            "compressor=fp16"),
    compose.COMPUTE_ARM: ("trainer.mode=local", *_K1, "compressor=none"),
}
"""Arm name (as in the bench grid) -> its overrides on the recipe. Spelled here only."""
TIMING_OVERRIDES = {"ddp-powersgd": ("compressor.ddp_start_iter=2",)}
"""What a timing run adds to an arm so that it times the arm's own step: torch's PowerSGD hook
compresses from its third step (not its 1001st); the composition charges the curve's plain steps
at the ``ddp`` arm's rate."""
TIMING_ONLY = (compose.COMPUTE_ARM,)
"""Arms that are timed but never trained to a curve: ``compute`` (every worker trains alone, no
communication) is the ceiling, the step time no scheme can beat on this machine."""
