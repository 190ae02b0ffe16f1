"""The GPU check's sixth check, ``period-h-cuda`` (checks.py lists them all): the period-H engine
(PipeDiLoCo, trainer.sync_every > 1) on CUDA tensors, two Gloo ranks on one GPU."""

from __future__ import annotations

from pathlib import Path

from .base import _device, _verdict

H, STEPS = 3, 20  # six whole rounds and a partial one, as tests/distributed/test_diloco.py


def _period_h_worker(rank, p):
    """Eager at width 2 (fp32, and fp16 on the wire) and blocking DiLoCo, on GPU 0 and on the CPU;
    a checkpoint taken mid-round and mid-flight, moved to the CPU and resumed on the GPU. Gloo moves
    CUDA tensors in all_reduce, not in the ring's sends, so the backend's allreduce carries them
    (int8 rides the ring: NCCL's, in tests/gpu)."""
    import copy

    import torch

    from diloco_reference import INNER, OUTER
    from engine_reference import batch, flat_params, make_model
    from pipesgd import PipeDiLoCo
    from pipesgd.flat import state_to_device

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dev = _device()

    def train(device, width, rule, compressor="none", split_at=None):
        def build():
            model = make_model().to(device)
            opt = INNER(model.parameters())
            return model, opt, PipeDiLoCo(opt, model.parameters(), H, width=width, staleness=rule,
                                          compressor=compressor, allreduce="native", timeout_s=60,
                                          outer_optimizer=OUTER)  # the reference's outer step

        model, opt, engine = build()
        for t in range(STEPS):
            if t == split_at:
                saved = copy.deepcopy(state_to_device((model.state_dict(), engine.state_dict()), "cpu"))
                for f in engine.fragments:
                    f.pipe.schedule.clear()  # carried by the checkpoint, applied by the resumed engine
                engine.close()
                model, opt, engine = build()
                model.load_state_dict(saved[0])
                engine.load_state_dict(saved[1])
            opt.zero_grad()
            x, y = batch(rank, t)
            torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
            engine.step()
        engine.flush()
        engine.close()
        return flat_params(model).cpu()

    cpu = torch.device("cpu")
    return {"eager": {"cuda": train(dev, 2, "eager"), "cpu": train(cpu, 2, "eager")},
            "blocking": {"cuda": train(dev, 1, "none"), "cpu": train(cpu, 1, "none")},
            "fp16": {"cuda": train(dev, 2, "eager", "fp16"), "cpu": train(cpu, 2, "eager", "fp16")},
            "resume": (train(dev, 2, "eager", split_at=7), train(dev, 2, "none", split_at=10))}


def period_h_cuda(out: Path) -> tuple[str, str, dict]:
    import torch

    from diloco_reference import diloco_reference
    from distributed_utils import run_workers

    r0, r1 = run_workers(_period_h_worker, 2, timeout=100)
    d: dict = {}
    parts = {}
    for arm, (width, rule) in {"eager": (2, "eager"), "blocking": (1, "none")}.items():
        ref = diloco_reference(2, H, width, STEPS, rule)
        for rank, r in enumerate((r0, r1)):
            d[f"{arm}_rank{rank}_vs_reference_max_abs"] = float((r[arm]["cuda"] - ref[rank]).abs().max())
            parts[f"{arm} rank {rank} against the reference rule"] = d[f"{arm}_rank{rank}_vs_reference_max_abs"] <= 1e-4
    for arm in ("eager", "blocking", "fp16"):
        d[f"{arm}_cuda_vs_cpu_max_abs"] = float((r0[arm]["cuda"] - r0[arm]["cpu"]).abs().max())
        parts[f"{arm}: CUDA as the CPU path"] = d[f"{arm}_cuda_vs_cpu_max_abs"] <= 1e-4
    parts["blocking: replicas identical"] = bool(torch.equal(r0["blocking"]["cuda"], r1["blocking"]["cuda"]))
    parts["eager resumed mid-flight bit-exact"] = bool(torch.equal(r0["resume"][0], r0["eager"]["cuda"]))
    none_straight = diloco_reference(2, H, 2, STEPS, "none")[0]
    d["none_resumed_vs_reference_max_abs"] = float((r0["resume"][1] - none_straight).abs().max())
    parts["none resumed mid-round against the reference"] = d["none_resumed_vs_reference_max_abs"] <= 1e-4
    return _verdict(parts, d, "eager and blocking DiLoCo on CUDA match their references and the CPU path (fp16 "
                    "on the wire too), replicas identical, resume mid-flight bit-exact")
