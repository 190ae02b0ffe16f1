"""Pipe-SGD of width K inside PyTorch DDP: a comm hook that hands DDP the average of the step K-1
back (the previous one at the default width 2) and leaves this step's reduction in flight
(docs/ddp-hook.md).

    state = PipelinedState(ddp_model)                      # or PipelinedState(ddp_model, PowerSGDState(...))
    ddp_model.register_comm_hook(state, pipelined(inner))  # inner: allreduce_hook, fp16_compress_hook, ...
    ...
    loss.backward()
    if state.ready():                                      # False at the first step: nothing arrived yet
        optimizer.step()
    ...
    state.flush(optimizer)                                 # after the last step: apply what is in flight
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..inflight import InFlight
from .powersgd import HookState, PowerSGDHookState, powersgd_state

QUIESCE_S = 10.0  # at exit, how long unapplied reductions are given to complete (see _Round.quiesce)


class _Bucket:
    """A ``GradBucket`` whose buffer is the hook's private copy: what torch's hooks read (``buffer``,
    ``gradients``, ``index``, ``is_last``, ``parameters``) and write (``set_buffer``)."""

    def __init__(self, bucket, buffer: Tensor):
        self._bucket, self._buffer = bucket, buffer
        self._params = bucket.parameters()

    def index(self) -> int:
        return self._bucket.index()

    def is_last(self) -> bool:
        return self._bucket.is_last()

    def parameters(self) -> list[Tensor]:
        return self._params

    def buffer(self) -> Tensor:
        return self._buffer

    def set_buffer(self, buffer: Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[Tensor]:
        return [v.view_as(p) for p, v in zip(self._params, self._buffer.split([p.numel() for p in self._params]))]


class _Round:
    """One step's reductions: per parameter, the future of its bucket and where it sits in it."""

    def __init__(self, scale: float = 1.0):
        self.where: dict[int, tuple[torch.futures.Future, int, int]] = {}
        self.scale = scale  # the GradScaler's scale the gradients were taken at
        # find_unused_parameters=True: the ids of the parameters DDP gave a gradient at this step
        # (read once its backward is over; None: unknown, not compared)
        self.used: frozenset[int] | None = None
        self.read = False

    def values(self) -> dict[int, Tensor]:
        """Wait for every reduction; the flat average of each parameter, by ``id``."""
        return {i: fut.wait()[at:at + n] for i, (fut, at, n) in self.where.items()}

    def quiesce(self, within_s: float = QUIESCE_S) -> None:
        """Left unapplied at exit: give its reductions up to ``within_s`` to complete, so that no
        callback of theirs still runs on the backend's threads when the interpreter finalizes.
        Polled, not waited: a peer that is gone must not hold the exit for the backend's timeout."""
        deadline = time.monotonic() + within_s
        for fut in {id(f): f for f, _, _ in self.where.values()}.values():
            while not fut.done() and time.monotonic() < deadline:
                time.sleep(0.005)


class PipelinedState:
    """The state registered with :func:`pipelined`: what is in flight, matched by parameter.

    ``model``: the ``DistributedDataParallel`` model (``Join`` is followed from the first step), or
    the plain module it wraps (Lightning builds the DDP later; then nothing of DDP's is checked).
    With DDP's ``find_unused_parameters=True`` the set of parameters that get gradients must stay
    the same from step to step: DDP writes this step's set with the previous step's averages, so a
    step whose set differs is refused (:meth:`ready`, or the next step's backward), naming the
    parameters. ``width`` = K: the average handed to DDP at step t is step t-K+1's (K-1 steps'
    reductions in flight behind this step's; 2, the default, hands the previous step's). The
    reductions run on K process groups of their own (one per step in flight, over
    ``process_group``'s ranks, default DDP's or the world; created here, collectively: construct
    the state at the same point on every rank), so they never queue on DDP's group, nor on the one
    ``broadcast_buffers`` or SyncBatchNorm use, and a stateful inner hook never shares a group
    between two steps in flight.

    ``inner_state``: what the inner hook gets, one per in-flight step: None or a process group
    (torch's ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``: the slot's group),
    a ``PowerSGDState`` (copied per slot onto the slot's group, with its settings and generator;
    the object passed is not used further), or ``group -> state``, a function called once per slot
    (a user's own stateful hook).

    ``scaler``: the ``GradScaler`` of the loop; each average is rescaled from the scale its step
    launched with to the current one, so ``scaler.step`` unscales it right. ``optimizer`` and
    ``staleness="lookahead"``: :meth:`forward_context` takes each gradient at the weights the
    optimizer reaches once the in-flight step lands (``staleness="lookahead"`` of the engine).
    """

    def __init__(self, model: nn.Module, inner_state: Any = None, *, process_group=None,
                 scaler: torch.amp.GradScaler | None = None, optimizer: torch.optim.Optimizer | None = None,
                 staleness: str = "none", width: int = 2):
        from torch.nn.parallel import DistributedDataParallel as DDP

        if isinstance(width, bool) or not isinstance(width, int) or width < 2:
            raise ValueError(f"width={width!r} is invalid for the pipelined DDP hook: an integer >= 2 (steps in "
                             "flight + 1); width 1 is DDP itself, without the hook")
        self.width = width

        # Weakly: DDP's reducer holds this state, so a strong reference back would be a cycle through
        # C++ that Python's collector cannot see, keeping the model, its buckets and every process
        # group it uses (ours too) alive until interpreter exit (tests/distributed/test_gloo_teardown.py).
        is_ddp = isinstance(model, DDP)
        self._ddp = weakref.ref(model) if is_ddp else None
        module = model.module if is_ddp else model
        # DDP's reducer order (its used map's indices), where the set of used parameters may change
        self._reducer_params = _reducer_params(model) if is_ddp and _finds_unused(model) else None
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        offsets = torch.tensor([0] + [p.numel() for p in self.params]).cumsum(0).tolist()
        self._flat_at = {id(p): (offsets[i], p.numel()) for i, p in enumerate(self.params)}
        self.numel = offsets[-1]
        self._group, self._inner_state = process_group, inner_state
        self._pending_inner: list | None = None  # inner states loaded before the groups exist
        _slot_state(inner_state, None, self.params, check_only=True)
        self.groups: list = []
        self.inner_states: list = []
        if dist.is_initialized():
            self._setup()
        self.scaler = scaler
        self.rule = _lookahead(staleness, optimizer, self.params)
        self.steps = 0  # rounds launched (steps whose backward ran the hook)
        self._pool: dict[tuple[int, int], Tensor] = {}  # (slot, bucket index) -> private copy
        # WHEN: the earlier steps' rounds in flight (pipesgd.inflight); the oldest is handed to DDP
        # once width - 1 are, and leaves the schedule when this step's round is launched behind it
        self.schedule: InFlight[_Round] = InFlight(width, owner="a PipelinedState (the pipelined DDP hook)",
                                                    remedy="call state.flush(optimizer) after the last step",
                                                    quiesce=_Round.quiesce)
        self._current: _Round | None = None  # this step's, while its backward runs
        self._handing: _Round | None = None  # the round this step's backward hands DDP
        self._returned = False  # the last round handed DDP an earlier step's average
        self._local: Tensor | None = None  # lookahead: this rank's gradient of the round
        self._joined = False
        self._handed_used: frozenset[int] | None = None  # the used set of the round the last backward handed DDP
        self._zeros_handed = False  # the last backward handed DDP zeros (nothing had arrived): do not step
        self._warned = False
        self._param_ids = frozenset(id(p) for p in self.params)
        _watch(self)
        if self._reducer_params is not None:  # the map is read outside backward: the hook runs under DDP's lock
            model.register_forward_pre_hook(_read_used_before(weakref.ref(self)))

    @property
    def ddp(self) -> nn.Module | None:
        """The ``DistributedDataParallel`` model this state serves (None: a plain module, or the model
        is gone)."""
        return None if self._ddp is None else self._ddp()

    def _setup(self) -> None:
        """The two process groups and the inner hook's state per slot: at construction once the
        default group exists, else (a trainer that builds DDP later) at the first step, where every
        rank's first bucket arrives in the same order."""
        group = self._group if self._group is not None else (
            self.ddp.process_group if self.ddp is not None else dist.group.WORLD)
        ranks = dist.get_process_group_ranks(group)
        self.groups = [dist.new_group(ranks) for _ in range(self.width)]
        self.inner_states = [_slot_state(self._inner_state, g, self.params) for g in self.groups]
        if self._pending_inner is not None:
            self._load_inner(self._pending_inner)

    # -- the hook -------------------------------------------------------------------------------
    def run(self, inner: Callable, bucket) -> torch.futures.Future:
        """One bucket of this step: launch ``inner`` on a private copy, return the previous step's
        average of the same parameters (zeros at the first step; :meth:`ready` says False)."""
        if not self.groups:
            self._setup()
        if self._current is None:
            self._begin_round()
        buf = bucket.buffer()
        slot = self.steps % self.width
        copy = self._copy(slot, bucket.index(), buf)
        params = bucket.parameters()
        sizes = [p.numel() for p in params]
        if sum(sizes) != copy.numel():
            raise RuntimeError(f"DDP bucket {bucket.index()} holds {copy.numel()} values for parameters of "
                               f"{sum(sizes)}: the pipelined hook supports dense fp32/fp16/bf16 buckets only")
        if self._local is not None:
            at = 0
            for p, n in zip(params, sizes):
                start, _ = self._flat_at[id(p)]
                self._local[start:start + n].copy_(copy[at:at + n])
                at += n
        private = _Bucket(bucket, copy)
        fut = (self.inner_states[slot].run(inner, private) if isinstance(self.inner_states[slot], HookState)
               else inner(self.inner_states[slot], private))
        at = 0
        for p, n in zip(params, sizes):
            self._current.where[id(p)] = (fut, at, n)
            at += n
        out = self._previous(params, buf)
        if bucket.is_last():
            self._end_round()
        return out

    def _begin_round(self) -> None:
        if self.ddp is not None and self.ddp._join_config.enable:
            self._joined = True
        self._check_used(read=False)  # the loop may not have asked ready(); the forward read the map
        scale = self.scaler.get_scale() if self.scaler is not None and self.scaler.is_enabled() else 1.0
        self._current = _Round(scale)
        self._handing = self.schedule.oldest() if len(self.schedule) == self.width - 1 else None
        self._returned = self._handing is not None
        self._zeros_handed = not self._returned
        self._handed_used = None if self._handing is None else self._handing.used
        if self.rule is not None:
            self._local = torch.zeros(self.numel, dtype=self.params[0].dtype, device=self.params[0].device)

    def _end_round(self) -> None:
        if self.rule is not None:
            if self._returned:
                self.rule.skip()  # the oldest local gradient lands in this step's optimizer.step()
            self.rule.launched(self._local.div_(self._current.scale))
            self._local = None
        self.schedule.launch(self._current, self.steps + 1)
        if self.schedule.due(self.steps + 1):
            self.schedule.pop()  # the round this backward handed DDP: applied by the loop's optimizer.step()
        self._current = self._handing = None
        self.steps += 1

    def _copy(self, slot: int, index: int, buf: Tensor) -> Tensor:
        """``buf`` copied into this slot's buffer for the bucket: DDP writes the next step's
        gradients into its bucket while this copy may still be reduced. Two buffers per bucket
        (one per slot), reused; a rebuilt bucket of another size gets new ones."""
        key = (slot, index)
        mine = self._pool.get(key)
        if mine is None or mine.shape != buf.shape or mine.dtype != buf.dtype or mine.device != buf.device:
            mine = self._pool[key] = torch.empty_like(buf)
        mine.copy_(buf)
        if mine.is_cuda:  # the inner collective reads it on its own stream
            mine.record_stream(torch.cuda.current_stream(mine.device))
        return mine

    def _previous(self, params: list[Tensor], buf: Tensor) -> torch.futures.Future:
        """A future of the handed step's average of ``params`` (K-1 steps back), laid out as ``buf``."""
        prev = self._handing
        if prev is None:
            done = torch.futures.Future()
            done.set_result(torch.zeros_like(buf))
            return done
        missing = [self.names.get(id(p), "?") for p in params if id(p) not in prev.where]
        if missing:
            raise RuntimeError(f"the in-flight step has no average for {', '.join(missing[:5])}: the model's "
                               "trainable parameters changed between two steps")
        where = [prev.where[id(p)] for p in params]
        futures = list({id(f): f for f, _, _ in where}.values())
        ratio = self._current.scale / prev.scale

        def assemble(_) -> Tensor:
            first, at0, _ = where[0]
            whole = first.value()
            if len(futures) == 1 and at0 == 0 and whole.numel() == buf.numel():
                out = whole  # the same layout: hand the reduced copy over as it is
            else:
                out = torch.cat([f.value()[at:at + n] for f, at, n in where])
            return out.mul_(ratio) if ratio != 1.0 else out

        if len(futures) == 1:
            return futures[0].then(assemble)
        return torch.futures.collect_all(futures).then(assemble)

    def _read_used(self, round_: _Round | None) -> None:
        """``round_``'s used set from DDP's used map (find_unused_parameters=True), once its backward
        is over and before the next step's backward ends, where DDP overwrites the map, and never
        inside a backward (DDP holds its reducer's lock while it runs the hook). The map's
        counts are summed over the ranks: DDP writes a gradient wherever any rank used the parameter.
        On CUDA a device-to-host copy of one int per parameter: a sync point, once per step."""
        if self._reducer_params is None or round_ is None or round_.read:
            return
        round_.read = True
        ddp = self.ddp
        if ddp is None:
            return
        counts = ddp.reducer._get_local_used_map()
        if counts.numel() != len(self._reducer_params):
            raise RuntimeError(f"DDP's used map has {counts.numel()} entries for {len(self._reducer_params)} "
                               "parameters: the pipelined hook cannot follow this DDP's parameters")
        flags = (counts > 0).tolist()
        round_.used = frozenset(id(p) for p, used in zip(self._reducer_params, flags) if used)

    def _check_used(self, read: bool = True) -> None:
        """Refuse a step whose set of parameters with a gradient differs from the step before: DDP
        wrote this step's set with the previous step's averages, which belong to the old set."""
        if self._current is not None:
            return
        newest = self.schedule.newest()  # the step whose backward ran last: DDP wrote its set of gradients
        if read:
            self._read_used(newest)
        now, handed = None if newest is None else newest.used, self._handed_used
        if not self._returned or now is None or handed is None or now == handed:
            return
        gained = sorted(self.names.get(i, "?") for i in now - handed)
        lost = sorted(self.names.get(i, "?") for i in handed - now)
        said = "; ".join(part for part in (
            f"now with a gradient: {', '.join(gained[:5])}" if gained else "",
            f"no longer with one: {', '.join(lost[:5])}" if lost else "") if part)
        raise RuntimeError(
            f"step {self.steps - 1}: the parameters that get gradients changed from the step before ({said}). "
            "With find_unused_parameters=True the pipelined hook needs the same set at every step: DDP writes "
            "this step's set with the previous step's averages, which belong to the old set, so a parameter "
            "would lose or gain an update. Keep the set fixed (requires_grad=False on parameters a step does "
            "not use, or static_graph=True), or use the engine (pipesgd.PipeSGD, find_unused_parameters=True), "
            "which follows a changing set")

    # -- the loop's side ------------------------------------------------------------------------
    def ready(self) -> bool:
        """True when the last backward handed DDP an earlier step's average: step the optimizer.
        False at the first step (nothing has arrived yet), so the loop skips ``optimizer.step()``;
        an optimizer that steps this state's parameters then anyway is warned about, once.
        RuntimeError where, with find_unused_parameters=True, the parameters that got gradients
        differ from the step before (naming them)."""
        self._check_used()
        return self._returned

    def forward_context(self) -> AbstractContextManager:
        """Run each forward and backward inside: with ``staleness="lookahead"``, the weights the
        optimizer reaches once the steps in flight land, restored on exit; else nothing."""
        if self.rule is None or not self.schedule:
            return nullcontext()
        return self.rule.forward_context(len(self.schedule))

    def flush(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> bool:
        """Apply the steps still in flight (after the last step), oldest first: every ``p.grad``
        becomes its average and ``optimizer.step()`` runs (``scaler.step`` and ``scaler.update``
        with a scaler). After ``Join``, every rank then takes the last joiner's weights, as DDP does
        at the end of ``Join``. False when nothing was in flight."""
        self._check_used()
        self._zeros_handed = False
        applied = False
        for _, prev in self.schedule.drain():
            self._apply(prev, optimizer, scaler or self.scaler)
            applied = True
        self._returned = False
        if applied and self._joined:
            self._sync_after_join()
        return applied

    def _apply(self, prev: _Round, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        """One round's averages into ``p.grad``, then the optimizer's step (flush)."""
        self._returned = True  # an optimizer whose step() asks ready() (the HF Trainer recipe) steps
        self._handed_used = prev.used
        now = scaler.get_scale() if scaler is not None and scaler.is_enabled() else 1.0
        values = prev.values()
        with torch.no_grad():
            for p in self.params:
                if prev.used is not None and id(p) not in prev.used:
                    continue  # no rank used it at that step: DDP leaves its grad alone, and so does the flush
                avg = values[id(p)].view_as(p) * (now / prev.scale)
                if p.grad is None:
                    p.grad = avg.clone()
                else:
                    p.grad.copy_(avg)
        if self.rule is not None:
            self.rule.skip()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

    def _sync_after_join(self) -> None:
        """The last joiner's parameters on every rank (the flush applied one update with optimizer
        states that differ on a rank that joined early)."""
        src = self.ddp._authoritative_rank
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p.data, src=src, group=self.ddp.process_group)
        self._joined = False

    def state_dict(self) -> dict[str, Any]:
        """Waits for the reductions in flight (never applies them): ``pending``, per step in flight
        (oldest first), each parameter's average by name; the scale each was taken at
        (``pending_scale``) and the parameters it updates (``pending_used``); the inner hooks'
        states per slot (PowerSGD: residuals, warm-start factors, iteration, generator) and the
        lookahead rule's."""
        newest = self.schedule.newest()
        self._read_used(newest)
        rounds = [r for _, r in self.schedule]
        return {"width": self.width, "steps": self.steps,
                "pending": [{self.names[i]: v.clone() for i, v in r.values().items()} for r in rounds],
                "pending_scale": [r.scale for r in rounds],
                "pending_used": [None if r.used is None else sorted(self.names[i] for i in r.used) for r in rounds],
                "inner": [s.state_dict() if isinstance(s, HookState) else {} for s in self.inner_states],
                "staleness": {} if self.rule is None else self.rule.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue as if uninterrupted, into any bucket layout (the averages follow their parameter).
        A checkpoint of the width-2 hook from before it took width K (one step in flight, ``pending``
        a dict) loads too."""
        if self.schedule or self._current is not None:
            raise RuntimeError("load_state_dict on a PipelinedState with a step in flight; call flush() first")
        pending, scales, used = state["pending"], state.get("pending_scale", 1.0), state.get("pending_used")
        if isinstance(pending, dict):  # the width-2 format: the one step in flight, or {} for none
            pending, scales, used = ([pending], [scales], [used]) if pending else ([], [], [])
        if state.get("width", 2) != self.width or len(pending) > self.width - 1:
            raise ValueError(f"checkpoint has width={state.get('width', 2)} ({len(pending)} step(s) in flight), "
                             f"this PipelinedState has width={self.width}")
        at = int(state["steps"]) - len(pending) + 1
        self.schedule.restore((at + i, self._restored(p, s, u)) for i, (p, s, u) in enumerate(zip(pending, scales, used)))
        self.steps = int(state["steps"])
        if self.inner_states:
            self._load_inner(state["inner"])
        else:
            self._pending_inner = state["inner"]
        if self.rule is not None:
            self.rule.load_state_dict(state.get("staleness", {}))

    def _restored(self, pending: dict[str, Tensor], scale: float, used: list[str] | None) -> _Round:
        """A checkpointed step in flight as a round whose reductions are done."""
        known = {self.names[id(p)] for p in self.params}
        if set(pending) != known:
            odd = sorted(set(pending) ^ known)
            raise ValueError(f"the checkpoint's in-flight averages do not match the model's trainable "
                             f"parameters: {', '.join(odd[:5])}")
        device = self.params[0].device
        done = torch.futures.Future()
        done.set_result(torch.cat([pending[self.names[id(p)]].to(device).reshape(-1) for p in self.params]))
        round_ = _Round(float(scale))
        round_.where = {id(p): (done, *self._flat_at[id(p)]) for p in self.params}
        round_.read = True  # DDP's used map belongs to no step of this process yet
        if used is not None:
            by_name = {n: i for i, n in self.names.items()}
            round_.used = frozenset(by_name[n] for n in used if n in by_name)
        return round_

    def _load_inner(self, saved: list) -> None:
        for mine, theirs in zip(self.inner_states, saved):
            if isinstance(mine, HookState):
                mine.load_state_dict(theirs)
        self._pending_inner = None


def pipelined(inner: Callable | None = None) -> Callable:
    """A DDP comm hook that runs ``inner`` (any hook of torch's contract ``hook(state, bucket) ->
    Future``; None: torch's ``allreduce_hook``) one step late: register it with a
    :class:`PipelinedState`. The update DDP hands the optimizer at step t is ``inner``'s result for
    step t-1."""
    if inner is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        inner = allreduce_hook
    if not callable(inner):
        raise TypeError(f"pipelined(inner): inner must be a DDP comm hook (state, bucket) -> Future, got {inner!r}")

    def hook(state, bucket):  # no annotation: DDP rejects a string one (future annotations)
        if not isinstance(state, PipelinedState):
            raise TypeError(f"the pipelined hook's state must be a PipelinedState, got {type(state).__name__}: "
                            "ddp_model.register_comm_hook(PipelinedState(ddp_model), pipelined(inner))")
        return state.run(inner, bucket)

    return hook


def register(ddp_model: nn.Module, inner: Callable | None = None, inner_state: Any = None, **options) -> PipelinedState:
    """The one line: ``state = register(ddp_model, fp16_compress_hook)``; ``options`` go to
    :class:`PipelinedState`. Returns the state (``ready``, ``flush``, ``state_dict``)."""
    state = PipelinedState(ddp_model, inner_state, **options)
    ddp_model.register_comm_hook(state, pipelined(inner))
    return state


def _finds_unused(ddp: nn.Module) -> bool:
    """DDP decides at every step which parameters get a gradient (``static_graph`` fixes the set)."""
    return bool(ddp.find_unused_parameters) and not ddp.static_graph


def _reducer_params(ddp: nn.Module) -> list[Tensor]:
    """The parameters in the order of DDP's reducer (``DistributedDataParallel._build_params_for_reducer``:
    trainable, not ignored, each once), which indexes its used map."""
    ignored = ddp.parameters_to_ignore
    return [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]


def _read_used_before(state: weakref.ref) -> Callable:
    """A forward pre-hook for DDP: the step in flight's used set, read before this step's backward."""

    def hook(module, args):
        me = state()
        if me is not None and me._current is None:
            me._read_used(me.schedule.newest())

    return hook


_watched: weakref.WeakSet = weakref.WeakSet()  # the live states, for the one optimizer step pre-hook
_step_hook = None


def _watch(state: PipelinedState) -> None:
    """Tell a loop that steps an optimizer on the zeros of the first step (``if state.ready():``
    forgotten): one global optimizer step pre-hook for every state, a flag test per step."""
    global _step_hook
    _watched.add(state)
    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _step_hook = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for state in list(_watched):
        if not state._zeros_handed or state._warned or (state.rule is not None and state.rule.stepping):
            continue
        if any(id(p) in state._param_ids for group in optimizer.param_groups for p in group["params"]):
            state._warned = True
            warnings.warn(
                "optimizer.step() ran after a backward whose pipelined DDP hook had nothing to hand DDP yet (the "
                "first step: every gradient is zeros), so momentum and weight decay moved the weights on no "
                "gradient; step the optimizer only if state.ready() (docs/ddp-hook.md)", stacklevel=3)


def _slot_state(inner_state: Any, group, params: list[Tensor], check_only: bool = False):
    """The inner hook's state for one in-flight slot, on that slot's ``group`` (``check_only``:
    only refuse what cannot be one)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if inner_state is None or isinstance(inner_state, dist.ProcessGroup):
        return group
    if isinstance(inner_state, PowerSGDState):
        return None if check_only else PowerSGDHookState(powersgd_state(group, like=inner_state), params)
    if isinstance(inner_state, HookState):
        raise TypeError("inner_state: a HookState serves one step; pass a function group -> state so each "
                        "in-flight step gets its own")
    if callable(inner_state):
        return None if check_only else inner_state(group)
    raise TypeError(
        f"inner_state={type(inner_state).__name__} cannot be shared by the two steps in flight: a stateful hook "
        "must not share its state or its process group between them; pass a function group -> state (called "
        "once per step in flight), a PowerSGDState (copied per step), a process group or None")


def _lookahead(staleness, optimizer, params: list[Tensor]):
    """The rule :meth:`PipelinedState.forward_context` runs: None for ``none``; ``lookahead`` (a name,
    or the rule already built, as the ddp mode passes it) bound to ``optimizer`` over ``params``."""
    name = staleness if isinstance(staleness, str) else staleness.name
    if name == "none":
        return None
    if name != "lookahead":
        raise ValueError(f"staleness={name!r} is not available with the pipelined DDP hook; allowed: none, "
                         "lookahead (docs/ddp-hook.md says which other rules could follow)")
    if optimizer is None:
        raise ValueError("staleness='lookahead' needs optimizer=: the lookahead steps are the optimizer's own")
    from ..staleness.lookahead import LocalLookahead

    rule = LocalLookahead() if isinstance(staleness, str) else staleness
    rule.bind(params, optimizer)
    return rule
