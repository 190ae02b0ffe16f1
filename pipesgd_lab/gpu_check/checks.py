"""The checks ``python -m pipesgd_lab.gpu_check`` runs, one subprocess each, most decisive first
(docs/gpu.md, "The GPU check"). Run one by hand::

    python -m pipesgd_lab.gpu_check.checks NAME RESULT_JSON OUT_DIR

Each check returns (status, one-line summary, details); a sub-check that disagrees with what the
CPU fakes assume makes it ``fail`` and says which. The two-rank checks run two Gloo ranks sharing
GPU 0 (NCCL refuses two ranks on one device): the tensors and kernels are CUDA's, the transport is
Gloo's, and the engine's device code (streams, events, record_stream, the waiter) is the real one.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback
from pathlib import Path

from .base import Check, _device, _verdict
from .ddp_hook import ddp_hook_cuda
from .period_h import period_h_cuda
from .environment import ROOT, environment


# --- 1. CUDA semantics the fakes assume -------------------------------------------------------

def cuda_semantics(out: Path) -> tuple[str, str, dict]:
    import torch

    from pipesgd.comm import streams
    from pipesgd.comm.base import CompletedHandle
    from pipesgd.comm.streams import CudaStreams, OrderedHandle

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    cycles_per_s = torch.cuda.get_device_properties(dev).clock_rate * 1e3 if hasattr(
        torch.cuda.get_device_properties(dev), "clock_rate") else 1.5e9
    d: dict = {}
    s = CudaStreams(dev)
    # (a) ready / run / wait order: the comm stream reads x only after the training stream wrote it
    x = torch.zeros(1 << 22, device=dev)
    torch.cuda._sleep(int(0.2 * cycles_per_s))
    x.fill_(1.0)
    ready = s.ready(x)
    total, done = s.run(ready, lambda: x.sum())
    s.wait(done)
    d["order_sum"] = float(total.item())
    order_ok = d["order_sum"] == x.numel()

    # (b) the allocator: freed without record_stream and reused, the comm stream reads the junk
    def clobbered(record: bool) -> bool:
        n = 1 << 18  # 1 MiB: the small pool's largest size class
        held = [torch.ones(n, device=dev)]  # the only reference, dropped below (no closure keeps it)
        seen = torch.empty(n, device=dev)
        ready = s.ready(*held) if record else s.ready()  # record_stream only when asked

        def read():
            torch.cuda._sleep(int(0.2 * cycles_per_s))  # the comm stream reads late
            seen.copy_(held[0])
        _, done = s.run(ready, read)
        held.clear()  # freed on the training stream while the comm stream's read is still queued
        junk = torch.full((n,), 7.0, device=dev)  # the training stream's next allocation of that size
        s.wait(done)
        torch.cuda.synchronize()
        del junk
        return bool((seen != 1).any())
    d["corrupted_without_record_stream"] = clobbered(record=False)
    d["corrupted_with_record_stream"] = clobbered(record=True)

    # (c) a deadline raises in time and never sleeps
    def no_sleep(seconds):
        raise AssertionError(f"the deadline wait slept {seconds} s")
    real_sleep, streams.time.sleep = streams.time.sleep, no_sleep
    try:
        _, done = s.run(s.ready(), lambda: torch.cuda._sleep(int(3 * cycles_per_s)))
        t0 = time.monotonic()
        try:
            OrderedHandle(CompletedHandle((None, done)), s).wait(timeout=0.5)
            d["deadline"] = "no TimeoutError"
        except TimeoutError:
            d["deadline"] = "TimeoutError"
        d["deadline_after_s"] = round(time.monotonic() - t0, 3)
        torch.cuda.synchronize()
        t0 = time.monotonic()
        _, done = s.run(s.ready(), lambda: None)
        torch.cuda.synchronize()
        OrderedHandle(CompletedHandle((None, done)), s).wait(timeout=5)
        d["done_wait_s"] = round(time.monotonic() - t0, 3)
    finally:
        streams.time.sleep = real_sleep
    deadline_ok = d["deadline"] == "TimeoutError" and d["deadline_after_s"] < 1.5

    # (d) NCCL at world size 1
    d["nccl"] = _nccl_world_of_one(dev)
    nccl_ok = d["nccl"]["ok"]
    return _verdict({"stream order": order_ok,
                     "no corruption without record_stream (the fake's pool model not confirmed)":
                         d["corrupted_without_record_stream"],
                     "corruption with record_stream": not d["corrupted_with_record_stream"],
                     "deadline": deadline_ok, "nccl world of one": nccl_ok}, d,
                    f"stream order kept; junk reused an unrecorded buffer and not a recorded one; deadline "
                    f"raised after {d['deadline_after_s']} s; NCCL: {d['nccl']['summary']}")


def _nccl_world_of_one(dev) -> dict:
    import os

    import torch
    import torch.distributed as dist

    from distributed_utils import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    r: dict = {}
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    try:
        group = dist.new_group()
        r["new_group"] = True
        sent = {}
        # what the ring sends: fp32 (none), fp16, bf16 (fp16 / bf16 payloads), int8 + fp32 scales,
        # int64 (top-k indices, control vectors)
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64):
            x = (torch.arange(1000, device=dev) % 100).to(dtype)
            y = torch.zeros_like(x)
            try:
                works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, group=group, group_peer=0),
                                                dist.P2POp(dist.irecv, y, group=group, group_peer=0)])
                for w in works:
                    w.wait()
                torch.cuda.synchronize()
                sent[str(dtype)] = bool(torch.equal(x, y))
            except Exception as e:  # noqa: BLE001  (recorded, the check decides)
                sent[str(dtype)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        r["p2p_round_trip"] = sent
        try:
            dist.all_reduce(torch.ones(4, dtype=torch.int16, device=dev), group=group)
            r["int16_refused"] = False
        except (TypeError, RuntimeError, ValueError) as e:
            r["int16_refused"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    finally:
        dist.destroy_process_group()
    r["ok"] = all(v is True for v in sent.values()) and bool(r.get("int16_refused"))
    r["summary"] = (f"device_id init, new_group, p2p round trip of {len(sent)} dtypes "
                    f"{'ok' if all(v is True for v in sent.values()) else 'FAILED'}, int16 "
                    f"{'refused' if r.get('int16_refused') else 'ACCEPTED'}")
    return r


# --- 2. the engine on CUDA tensors, two Gloo ranks on one GPU ---------------------------------

COMPRESSORS = ("none", "fp16", "bf16", "powersgd", "topk")


def _cuda_engine_worker(rank, p):
    import copy

    import torch

    import pipesgd.engine.exchange as exchange
    import pipesgd.engine.pipe as pipe
    from engine_reference import LR, MOMENTUM, STEPS, batch, flat_params, make_model
    from pipesgd import PipeSGD
    from pipesgd.flat import state_to_device

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = _device()

    def train(compressor, device, split_at=None, inject=None, in_place=False):
        """The reference loop (tests/engine_reference.py) at width 2; ``split_at``: a checkpoint to
        the CPU and a resume into fresh objects there; ``inject``: an inf on rank 1 at that step."""
        def build():
            model = make_model().to(device)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            return model, opt, PipeSGD(opt, model.parameters(), width=2, compressor=compressor, nonfinite="skip",
                                       allreduce="native",  # Gloo moves CUDA tensors in all_reduce, not in sends
                                       timeout_s=60)

        model, opt, engine = build()
        for t in range(STEPS):
            if t == split_at:
                saved = copy.deepcopy(state_to_device((model.state_dict(), opt.state_dict(), engine.state_dict()), "cpu"))
                engine.schedule.clear()  # carried by the checkpoint, applied by the resumed engine
                engine.close()
                model, opt, engine = build()
                model.load_state_dict(saved[0])
                opt.load_state_dict(saved[1])
                engine.load_state_dict(saved[2])
            opt.zero_grad(set_to_none=not in_place)
            x, y = (v.to(device) for v in batch(rank, t))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if inject == t and rank == 1:
                loss = loss + float("inf") * next(model.parameters()).view(-1)[3]
            loss.backward()
            engine.step()
        engine.flush()
        engine.close()
        return flat_params(model).cpu()

    out = {}
    for c in COMPRESSORS:
        out[c] = {"cuda": train(c, dev), "cpu": train(c, torch.device("cpu"))}
    out["resume"] = {c: (out[c]["cuda"], train(c, dev, split_at=7)) for c in ("none", "powersgd")}
    out["defect1_after"] = train("none", dev, inject=5, in_place=True)
    saved = (exchange.GradientExchange._let_go, pipe.set_grads)
    exchange.GradientExchange._let_go, pipe.set_grads = (lambda self, buf: None), (lambda *a: None)
    try:
        out["defect1_before"] = train("none", dev, inject=5, in_place=True)
    finally:
        exchange.GradientExchange._let_go, pipe.set_grads = saved
    out["defect2"] = _exposed_before_and_after(dev)
    return out


def _exposed_before_and_after(dev) -> dict:
    """Width 1 on a 16M-value gradient (communication slower than anything to overlap): the stall
    measured the fixed way and the old way (the host waited before the stall's first event)."""
    import torch

    from pipesgd import PipeSGD
    from pipesgd.comm.streams import CudaStreams, EventSpan, _timing_event

    def old_wait(self, done, timeout=None, begun=None):  # before the fix: the stall timed from after the host waits
        if timeout is not None:
            self.finish(done, timeout)
        stream = torch.cuda.current_stream(self.device)
        before, after = _timing_event(), _timing_event()
        before.record(stream)
        stream.wait_event(done.end)
        after.record(stream)
        return EventSpan(before, after)

    def measure() -> tuple[float, float]:
        w = torch.nn.Parameter(torch.zeros(1 << 24, device=dev))
        opt = torch.optim.SGD([w], lr=0.1)
        exposed, comm = [], []
        with PipeSGD(opt, [w], width=1, allreduce="native", timeout_s=60) as engine:
            for _ in range(4):
                w.grad = torch.ones_like(w)
                stats = engine.step()
                exposed.append(stats.exposed_s() * 1e3)
                comm.append(stats.comm.time_s() * 1e3)
        return statistics.median(exposed[1:]), statistics.median(comm[1:])

    after = measure()
    real = CudaStreams.wait
    CudaStreams.wait = old_wait
    try:
        before = measure()
    finally:
        CudaStreams.wait = real
    return {"after_exposed_ms": after[0], "after_comm_ms": after[1], "before_exposed_ms": before[0],
            "before_comm_ms": before[1]}


def engine_cuda(out: Path) -> tuple[str, str, dict]:
    import torch

    from distributed_utils import run_workers
    from engine_reference import reference

    r0, r1 = run_workers(_cuda_engine_worker, 2, timeout=110)
    d: dict = {}
    parts = {}
    ref = reference(2, 2)
    d["none_vs_reference_max_abs"] = float((r0["none"]["cuda"] - ref).abs().max())
    parts["none against the reference update rule"] = d["none_vs_reference_max_abs"] <= 1e-4
    for c in COMPRESSORS:
        diff = float((r0[c]["cuda"] - r0[c]["cpu"]).abs().max())
        d[f"{c}_cuda_vs_cpu_max_abs"] = diff
        parts[f"{c}: CUDA as the CPU path (proven against the references)"] = diff <= 1e-4
        parts[f"{c}: replicas identical"] = bool(torch.equal(r0[c]["cuda"], r1[c]["cuda"]))
    for c, (straight, resumed) in r0["resume"].items():
        parts[f"{c}: resume bit-exact"] = bool(torch.equal(straight, resumed))
    skip_ref = reference(2, 2, skip_step=5)
    after, before = r0["defect1_after"], r0["defect1_before"]
    d["defect1_after_max_abs"] = float((after - skip_ref).abs().max())
    d["defect1_before_max_abs"] = float((before - skip_ref).abs().max())
    d["defect1_before_replicas_equal"] = bool(torch.equal(before, r1["defect1_before"]))
    parts["defect 1 fixed (skip, in-place zero_grad)"] = (d["defect1_after_max_abs"] <= 1e-4
                                                          and torch.equal(after, r1["defect1_after"]))
    parts["defect 1 reproduced on the old code"] = (d["defect1_before_max_abs"] > 1e-4
                                                    or not d["defect1_before_replicas_equal"])
    d2 = d["defect2"] = r0["defect2"]
    parts["defect 2 fixed (exposed ~ comm at width 1)"] = d2["after_exposed_ms"] >= 0.5 * d2["after_comm_ms"]
    parts["defect 2 reproduced on the old code"] = d2["before_exposed_ms"] < 0.25 * d2["before_comm_ms"]
    return _verdict(parts, d, f"{', '.join(COMPRESSORS)} match the CPU path, replicas identical, resume "
                    f"bit-exact; defect 1 and 2 reproduced on the old code, not after (exposed "
                    f"{d2['before_exposed_ms']:.1f} -> {d2['after_exposed_ms']:.1f} ms of {d2['after_comm_ms']:.1f})")


# --- 3. overlap on a real device: ResNet-50, width 2, communication slower than compute ---------

def _overlap_worker(rank, p, out_dir):
    import torch
    import torch.nn.functional as F

    from .models import resnet50
    from pipesgd import PipeSGD

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model = resnet50().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(16, 3, 224, 224, device=dev), torch.randint(0, 1000, (16,), device=dev)
    rows = []
    with PipeSGD(opt, model.parameters(), width=2, allreduce="native", timeout_s=120) as engine:
        def step():
            t0, t1, t2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            t0.record()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            t1.record()
            stats = engine.step()
            t2.record()
            return t0, t1, t2, stats
        for _ in range(3):
            step()
        marks = [step() for _ in range(8)]
        torch.cuda.synchronize()
        for t0, t1, t2, stats in marks:
            rows.append({"iter_ms": t0.elapsed_time(t2), "compute_ms": t0.elapsed_time(t1),
                         "exposed_ms": stats.exposed_s() * 1e3, "comm_ms": stats.comm.time_s() * 1e3})
        if rank == 0:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(Path(out_dir) / "trace.json"))
        else:
            for _ in range(3):
                step()
        engine.flush()
    return rows


def overlap(out: Path) -> tuple[str, str, dict]:
    from distributed_utils import run_workers

    rows, _ = run_workers(_overlap_worker, 2, str(out), timeout=55)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    residual = med["iter_ms"] - med["compute_ms"]
    d = {"median": med, "rows_rank0": rows, "iter_minus_compute_ms": residual}
    parts = {"communication slower than compute (the case asked for)": med["comm_ms"] > med["compute_ms"],
             "exposed (trainer's metric) agrees with iteration - compute": 0.5 * residual <= med["exposed_ms"]
             <= residual + 1.0,
             "profiler trace written": (out / "trace.json").exists()}
    return _verdict(parts, d, f"ResNet-50 width 2: compute {med['compute_ms']:.1f} ms, comm {med['comm_ms']:.1f} ms, "
                    f"exposed {med['exposed_ms']:.1f} ms vs iteration - compute {residual:.1f} ms; trace.json")


# --- 4. step times for the scale map ------------------------------------------------------------

def step_times(out: Path, budget_s: float = 110.0) -> tuple[str, str, dict]:
    import torch
    import torch.nn.functional as F

    from .models import PRESETS

    dev = torch.device("cuda", 0)
    start = time.monotonic()
    rows, skipped = [], {}
    for name, (build, make_batch, batch, amp, optim, preset) in PRESETS.items():
        if time.monotonic() - start > budget_s - 20:
            skipped[name] = "out of the check's budget"
            continue
        try:
            torch.manual_seed(0)
            with dev:  # initialised on the GPU: GPT-2-XL's 1.5 B values take seconds on a CPU
                model = build()
            opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optim == "sgd"
                   else torch.optim.AdamW(model.parameters(), lr=1e-4))
            scaler = torch.amp.GradScaler("cuda", enabled=amp)
            x, y = make_batch(batch, dev)
            times = []
            for i in range(3 + 10):
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                opt.zero_grad(set_to_none=True)
                ev[0].record()
                with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
                ev[1].record()
                scaler.scale(loss).backward()
                ev[2].record()
                scaler.step(opt)
                scaler.update()
                ev[3].record()
                if i >= 3:
                    times.append(ev)
            torch.cuda.synchronize()
            fwd = statistics.median(a.elapsed_time(b) for a, b, _, _ in times)
            bwd = statistics.median(b.elapsed_time(c) for _, b, c, _ in times)
            upd = statistics.median(c.elapsed_time(e) for _, _, c, e in times)
            rows.append({"model": name, "preset": preset, "batch": batch,
                         "precision": "mixed (AMP fp16)" if amp else "fp32", "forward_ms": fwd,
                         "backward_ms": bwd, "optimizer_ms": upd, "step_ms": fwd + bwd + upd,
                         "backward_share": bwd / (fwd + bwd), "params": sum(p.numel() for p in model.parameters())})
        except torch.cuda.OutOfMemoryError as e:
            skipped[name] = f"out of memory at batch {batch}: {str(e).splitlines()[0][:120]}"
        finally:
            model = opt = x = y = None  # noqa: F841
            torch.cuda.empty_cache()
    env = environment()
    measured = {"gpu": env.get("gpu"), "driver": env.get("driver"), "torch": env.get("torch"),
                "cuda": env.get("cuda"), "date": env.get("date"), "source": "make gpu-check (pipesgd_lab/gpu_check/checks.py "
                "step_times): CUDA events, median of 10 steps after 3, synthetic batches", "rows": rows,
                "skipped": skipped}
    (out / "step_times.json").write_text(json.dumps(measured, indent=1) + "\n")
    status = "pass" if rows else "fail"  # a preset out of memory on a small GPU is reported, not failed
    timed = ", ".join("%s %.0f ms" % (r["model"], r["step_ms"]) for r in rows)
    return status, (f"{len(rows)} presets timed ({timed})"
                    + (f"; not timed: {', '.join(skipped)}" if skipped else "")), measured


# --- 6. the NCCL suite, with two or more GPUs ----------------------------------------------------

NCCL_SUITE_S = 600  # tests/gpu takes minutes (its silent-peer case alone waits 48 s); not in the one-GPU 8 minutes

NCCL_SUITE = ("tests/gpu", "tests/lab/test_overlap_nccl.py")  # the library's NCCL tier, and the overlap bench on NCCL


def nccl_suite(out: Path) -> tuple[str, str, dict]:
    import subprocess

    import torch

    if torch.cuda.device_count() < 2:
        return "skip", f"{torch.cuda.device_count()} GPU: tests/gpu needs two (NCCL refuses two ranks on one device)", {}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", *NCCL_SUITE], cwd=ROOT, capture_output=True,
                       text=True, timeout=NCCL_SUITE_S - 10)
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-200:]
    print(r.stdout[-20000:], r.stderr[-5000:])
    return ("pass" if r.returncode == 0 else "fail"), f"pytest {' '.join(NCCL_SUITE)}: {tail}", {"returncode": r.returncode}


CHECKS: tuple[Check, ...] = (
    Check("cuda-semantics", 60, "stream order, record_stream against allocator reuse, deadline waits, NCCL "
          "world of one (device_id, new_group, p2p of every ring dtype, int16 refused)", cuda_semantics),
    Check("engine-cuda", 120, "two Gloo ranks on one GPU: none/fp16/bf16/powersgd/topk against the CPU path and "
          "the reference, identical replicas, bit-exact resume, defects 1 and 2 before and after", engine_cuda),
    Check("overlap", 60, "ResNet-50 width 2, communication slower than compute: exposed communication against "
          "iteration - compute, torch.profiler trace of three steps", overlap),
    Check("step-times", 90, "forward/backward/optimizer with CUDA events for the scale map's presets and "
          "ResNet-20/18 (AMP where the recipes use it): step_times.json", step_times),
    Check("ddp-hook-cuda", 120, "two Gloo ranks on one GPU: DDP with the pipelined hook against PipeSGD(width=2), "
          "lookahead against the engine's, PowerSGD and AMP+GradScaler replicas identical, a CPU checkpoint "
          "resumed on the GPU as if uninterrupted", ddp_hook_cuda),
    Check("period-h-cuda", 30, "two Gloo ranks on one GPU: the period-H engine (eager at width 2, blocking "
          "DiLoCo, fp16 on the wire) against the reference rules and the CPU path, resume mid-flight", period_h_cuda),
    Check("nccl-suite", NCCL_SUITE_S, "with two or more GPUs: pytest tests/gpu on NCCL (skipped on one GPU)",
          nccl_suite, gpus=2),
)


def write_result(result_file: Path, status: str, summary: str, details: dict) -> None:
    result_file.write_text(json.dumps({"status": status, "summary": summary, "details": details},
                                      indent=1, default=str) + "\n")


def main(argv: list[str]) -> int:
    name, result_file, out = argv[0], Path(argv[1]), Path(argv[2])
    check = next(c for c in CHECKS if c.name == name)
    try:
        status, summary, details = check.run(out)
    except Exception as e:  # noqa: BLE001  (the runner records it as the check's result)
        traceback.print_exc()
        write_result(result_file, "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                     {"traceback": traceback.format_exc()[-4000:]})
        return 1
    write_result(result_file, status, summary, details)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
