"""The GPU check's fifth check, ``ddp-hook-cuda`` (checks.py lists them all): the pipelined DDP
hook on CUDA tensors, two Gloo ranks on one GPU."""

from __future__ import annotations

import io
from pathlib import Path

from .base import _device, _verdict


HOOK_STEPS = 12  # a resume after 6: both PowerSGD slots (start_iter 2) have compressed by then


def _ddp_hook_worker(rank, p):
    """DDP with ``pipesgd.hooks.pipelined`` on GPU 0 (two Gloo ranks; DDP's buckets, its copy into
    them and the hook's private copies with ``record_stream`` are real CUDA): the default allreduce
    against ``PipeSGD(width=2)`` on the same GPU, PowerSGD's replicas, and GradScaler under AMP."""
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipesgd import PipeSGD
    from pipesgd.hooks import one_bucket_on_gloo, powersgd_state, register

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = _device()

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10)).to(dev)

    def batch(t):
        g = torch.Generator().manual_seed(10_000 * rank + t)
        return torch.randn(64, 32, generator=g).to(dev), torch.randint(0, 10, (64,), generator=g).to(dev)

    def flat(m):
        return torch.cat([q.detach().reshape(-1) for q in m.parameters()]).cpu()

    def hooked(inner=None, make_state=None, amp=False, lookahead=False, steps=range(HOOK_STEPS), resume=None,
               keep=None):
        """DDP with the pipelined hook; the weights after every step (and after the flush). ``resume``:
        a CPU checkpoint to continue from; ``keep``: receives one (on the CPU) after the last step
        instead of flushing; ``lookahead``: the lookahead rule through the state's forward context."""
        m = model()
        if resume is not None:
            m.load_state_dict(resume["model"])
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        # 0.1 MiB: several buckets, re-bucketed after the first step; PowerSGD on Gloo needs one
        ddp = DDP(m, **(one_bucket_on_gloo(m) if inner is powerSGD_hook else {"bucket_cap_mb": 0.1}))
        scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12) if amp and dev.type == "cuda" else None
        options = {"optimizer": opt, "staleness": "lookahead"} if lookahead else {}
        state = register(ddp, inner, make_state() if make_state else None, scaler=scaler, **options)
        if resume is not None:
            opt.load_state_dict(resume["opt"])
            state.load_state_dict(resume["hook"])
        out = []
        for t in steps:
            opt.zero_grad()
            x, y = batch(t)
            with state.forward_context():
                with torch.autocast(dev.type, dtype=torch.float16, enabled=scaler is not None):
                    loss = nn.functional.cross_entropy(ddp(x), y)
                (scaler.scale(loss) if scaler else loss).backward()
            if state.ready():
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
            out.append(flat(m))
        if keep is not None:  # a checkpoint as a trainer writes it: through torch.save, loaded on the CPU
            buf = io.BytesIO()
            torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, buf)
            buf.seek(0)
            keep.update(torch.load(buf, map_location="cpu", weights_only=True))
            return out
        state.flush(opt, scaler)
        out.append(flat(m))
        return out

    def resumed(straight, inner=None, make_state=None):
        """``straight`` (the same run straight through) against the run saved on the CPU after half
        the steps (both PowerSGD slots past their start) then resumed into a fresh DDP on the GPU;
        and the same resume with the in-flight averages dropped (the control: it must differ)."""
        saved: dict = {}
        half = HOOK_STEPS // 2
        hooked(inner, make_state, steps=range(half), keep=saved)
        again = hooked(inner, make_state, steps=range(half, HOOK_STEPS), resume=saved)
        lost = hooked(inner, make_state, steps=range(half, HOOK_STEPS),
                      resume=saved | {"hook": saved["hook"] | {"pending": {}}})
        return {"straight": straight[half:], "resumed": again, "lost": lost}

    def engine(staleness="none"):
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        out = []
        with PipeSGD(opt, m.parameters(), width=2, allreduce="native", staleness=staleness, timeout_s=60) as eng:
            for t in range(HOOK_STEPS):
                opt.zero_grad()
                x, y = batch(t)
                with eng.forward_context():
                    nn.functional.cross_entropy(m(x), y).backward()
                eng.step()
                out.append(flat(m))
            eng.flush()
            out.append(flat(m))
        return out

    def psgd():
        return powersgd_state(None, rank=2, start_iter=2, seed=3)

    plain, powersgd = hooked(), hooked(powerSGD_hook, psgd)
    return {"allreduce": plain, "engine": engine(), "powersgd": powersgd, "amp": hooked(amp=True),
            "lookahead": hooked(lookahead=True), "engine_lookahead": engine("lookahead"),
            "resume": resumed(plain), "resume_powersgd": resumed(powersgd, powerSGD_hook, psgd)}


def ddp_hook_cuda(out: Path) -> tuple[str, str, dict]:
    import torch

    from distributed_utils import run_workers

    r0, r1 = run_workers(_ddp_hook_worker, 2, timeout=110)
    d: dict = {}
    parts = {}
    d["allreduce_vs_engine_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(r0["allreduce"], r0["engine"]))
    parts["pipelined(allreduce) follows PipeSGD(width=2) at every step"] = d["allreduce_vs_engine_max_abs"] <= 1e-5
    for arm in ("allreduce", "powersgd", "amp"):
        parts[f"{arm}: replicas identical at every step"] = all(torch.equal(a, b) for a, b in zip(r0[arm], r1[arm]))
        parts[f"{arm}: weights finite"] = bool(torch.isfinite(r0[arm][-1]).all())
    d["powersgd_vs_allreduce_max_abs"] = float((r0["powersgd"][-1] - r0["allreduce"][-1]).abs().max())
    parts["powersgd compressed (differs from the plain average)"] = d["powersgd_vs_allreduce_max_abs"] > 1e-6
    d["amp_moved"] = float((r0["amp"][-1] - r0["amp"][0]).abs().max())
    parts["amp: the scaled steps were applied"] = d["amp_moved"] > 0
    # the hook's lookahead and resume on CUDA tensors
    d["lookahead_vs_engine_max_abs"] = max(float((a - b).abs().max())
                                           for a, b in zip(r0["lookahead"], r0["engine_lookahead"]))
    parts["lookahead: the hook follows PipeSGD(width=2, staleness='lookahead') at every step"] = (
        d["lookahead_vs_engine_max_abs"] <= 1e-5)
    parts["lookahead: replicas identical at every step"] = all(
        torch.equal(a, b) for a, b in zip(r0["lookahead"], r1["lookahead"]))
    d["lookahead_vs_plain_max_abs"] = float((r0["lookahead"][-1] - r0["allreduce"][-1]).abs().max())
    parts["lookahead changed the trajectory"] = d["lookahead_vs_plain_max_abs"] > 1e-6
    for arm, tol in (("resume", 0.0), ("resume_powersgd", 1e-6)):
        r = r0[arm]
        d[f"{arm}_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(r["straight"], r["resumed"]))
        parts[f"{arm}: a CPU checkpoint resumed on the GPU continues as if uninterrupted (<= {tol:g})"] = (
            d[f"{arm}_max_abs"] <= tol)
        d[f"{arm}_without_pending_max_abs"] = float((r["straight"][-1] - r["lost"][-1]).abs().max())
        parts[f"{arm}: without the in-flight averages the run differs"] = d[f"{arm}_without_pending_max_abs"] > 1e-6
        parts[f"{arm}: replicas identical after the resume"] = all(
            torch.equal(a, b) for a, b in zip(r["resumed"], r1[arm]["resumed"]))
    return _verdict(parts, d, f"pipelined(allreduce) = PipeSGD(width=2) within {d['allreduce_vs_engine_max_abs']:.1e} "
                    f"over {HOOK_STEPS} steps, lookahead within {d['lookahead_vs_engine_max_abs']:.1e}; resume "
                    f"{d['resume_max_abs']:.1e} (PowerSGD {d['resume_powersgd_max_abs']:.1e}); allreduce, PowerSGD, "
                    f"AMP+GradScaler and lookahead replicas identical")
