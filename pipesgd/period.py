"""The rule of a round's schedule, judged in one place: ``(H, F, τ)`` = (``sync_every``,
``fragments``, ``sync_delay``) is a schedule when F divides H and τ < H/F, and the widths it runs
at allow it (a delay and an outer rule of eager's kind keep one round in flight: width 2). The config
checks, PipeDiLoCo, torchft's DiLoCo and the timing model all ask :func:`problems`; standard
library only, so the torch-free timing model can import it."""

from __future__ import annotations

from collections.abc import Sequence

LAYOUTS = ("contiguous", "strided")
"""How ``fragments`` cut the model: contiguous runs of tensors, or its layers dealt round-robin
across the depth (streaming DiLoCo's strided fragments; :mod:`pipesgd.engine.diloco`)."""

AUTO = "auto"
"""``landing_alpha`` that follows the number of replicas (:func:`pipesgd.outer.landing_alpha`)."""


def invalid(sync_every: object, fragments: object = 1, sync_delay: object = 0, prefix: str = "") -> list[str]:
    """The settings of ``(sync_every, fragments, sync_delay)`` that are not integers in range, one
    message each (``prefix`` + the setting's name); the rest of the rule needs them to be."""
    out = []
    for name, value, low, what in (("sync_every", sync_every, 1, "inner steps per round"),
                                   ("fragments", fragments, 1, "streaming fragments of a round"),
                                   ("sync_delay", sync_delay, 0, "inner steps a round's exchange runs before it "
                                                                 "is waited for")):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            out.append(f"{prefix}{name}={value!r} is invalid: must be an integer >= {low} ({what})")
    return out


def problems(sync_every: object, fragments: object = 1, sync_delay: object = 0, *, width: int | None = None,
             rule: str | None = None, rule_period: str | None = None, rule_agrees: bool = True,
             round_rules: Sequence[str] = (), prefix: str = "", runs: str = "") -> list[str]:
    """Every way ``(sync_every, fragments, sync_delay)`` is not a schedule, one message each naming
    the setting (``prefix`` + its name, e.g. ``trainer.``), the bad value and what is allowed; []
    when it is one. ``width``: the width the rounds' pipe runs at, which ``sync_delay`` > 0 and the
    ``eager`` rule need to be 2; None where that is not judged (torchft's own schedule lands by
    ``sync_delay`` at width 1). ``rule``, ``rule_period``: the staleness rule of the outer step and
    its declared ``sync_period``; a ``"step"`` rule cannot apply a round's pseudo-gradient (then
    ``round_rules`` are the ones that can); ``rule_agrees``: its declared ``agrees``, False for a
    rule whose replicas each apply a term of their own (eager's kind), which keeps exactly one
    round in flight. ``runs``: how the width came about, for the message
    (default ``got width W``)."""
    p, out = prefix, invalid(sync_every, fragments, sync_delay, prefix)
    typed, at = not out, runs or f"got width {width}"
    if width is not None and typed and sync_delay and width != 2:
        out.append(f"{p}sync_delay={sync_delay} says when the one round in flight lands and needs width 2, {at}")
    if rule_period == "step":
        out.append(f"staleness={rule} is a rule for per-step gradients and cannot apply a round's "
                   f"pseudo-gradient at {p}sync_every={sync_every}; use staleness={'|'.join(round_rules)}")
    if not rule_agrees and width is not None and width != 2:
        out.append(f"staleness={rule} keeps exactly one outer step in flight and needs width 2, {at}")
    if not typed:
        return out
    if sync_every % fragments:
        out.append(f"{p}fragments={fragments} does not divide {p}sync_every={sync_every}: the fragments' rounds end "
                   f"sync_every / fragments steps apart; use a divisor of {sync_every}")
    elif sync_delay >= sync_every // fragments:
        out.append(f"{p}sync_delay={sync_delay} must be below {p}sync_every / {p}fragments = "
                   f"{sync_every // fragments}: a fragment's exchange lands before the next one launches")
    return out


def merge_problems(warmup_sync_steps: object = 0, landing_alpha: object = None, sync_delay: object = 0,
                   fragment_layout: object = "contiguous", prefix: str = "") -> list[str]:
    """What the rounds' start and landing cannot take, one message each naming the setting
    (``prefix`` + its name): ``warmup_sync_steps`` (an integer >= 0), ``fragment_layout`` (one of
    :data:`LAYOUTS`), ``landing_alpha`` (None, ``"auto"`` or a number in [0, 1] with ``sync_delay``
    > 0: the mix happens where a round lands late). Whether the mode reads them is the caller's to say."""
    p, out = prefix, []
    if isinstance(warmup_sync_steps, bool) or not isinstance(warmup_sync_steps, int) or warmup_sync_steps < 0:
        out.append(f"{p}warmup_sync_steps={warmup_sync_steps!r} is invalid: must be an integer >= 0 (synchronous "
                   "steps before the first round)")
    if fragment_layout not in LAYOUTS:
        out.append(f"{p}fragment_layout={fragment_layout!r} is not known; allowed: {', '.join(LAYOUTS)}")
    if landing_alpha is None:
        return out
    if landing_alpha != AUTO and (isinstance(landing_alpha, bool) or not isinstance(landing_alpha, (int, float))
                                  or not 0 <= landing_alpha <= 1):
        out.append(f"{p}landing_alpha={landing_alpha!r} is invalid: must be a number in [0, 1] (the local weights' "
                   f"share at a landing: θ ← α·θ + (1 − α)·anchor), {AUTO} (the share that follows the number of "
                   "replicas, pipesgd.outer.landing_alpha) or null (keep the steps since the launch)")
    elif not sync_delay:
        out.append(f"{p}landing_alpha={landing_alpha} mixes the weights where a round lands {p}sync_delay steps "
                   f"after its launch: at {p}sync_delay=0 every round restarts from the anchor; set {p}sync_delay > 0 "
                   "or leave it unset")
    return out


def check(*args, **kwargs) -> None:
    """:func:`problems`, raised: one ValueError holding every message (``; `` between them)."""
    found = problems(*args, **kwargs)
    if found:
        raise ValueError("; ".join(found))
