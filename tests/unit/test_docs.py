"""The compressor in docs/adding-a-plugin.md is real code: run it against its documented
bound, wire size and registration, so the guide cannot drift from the contract."""

import re

import pytest
import torch
from runs import ROOT

from pipesgd.compress import base, get_compressor


@pytest.fixture
def doc_compressor():
    text = (ROOT / "docs" / "adding-a-plugin.md").read_text()
    code = re.search(r"```python\n(# pipesgd/compress/fp16_scaled.py\n.*?)```", text, re.S).group(1)
    namespace = {"__name__": "doc_fp16_scaled"}
    exec(compile(code.replace("from .base import", "from pipesgd.compress.base import"), "doc", "exec"), namespace)
    yield namespace["ScaledFP16"]
    base.REGISTRY.unregister("fp16_scaled")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (4097,)])
@pytest.mark.parametrize("magnitude", [1e-6, 1.0, 1e6])  # 1e6 overflows plain fp16
def test_documented_compressor_meets_its_bound(doc_compressor, shape, magnitude):
    comp = get_compressor("fp16_scaled")
    assert isinstance(comp, doc_compressor)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * magnitude
    before = x.clone()
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert torch.equal(x, before) and y.shape == x.shape and y.dtype == x.dtype
    a = x.abs()
    scale = max(a.max().item() / 2.0 ** comp.headroom if a.numel() else 0.0, torch.finfo(torch.float32).tiny)
    assert torch.all((y - x).abs() <= a * 2.0 ** -11 + scale * 2.0 ** -25)
    assert payload.dim() == 1 and payload.nbytes == comp.wire_bytes(ctx) == 4 + 2 * x.numel()


def test_every_worked_example_is_the_code_it_names():
    """docs/adding-a-plugin.md shows one plugin of each kind; an excerpt headed ``# pipesgd/...`` or
    ``# conf/...`` that names a real file is that file's text, line for line (``...`` elides), so
    the guide cannot drift from what tests/distributed/test_plugins.py checks."""
    text = (ROOT / "docs" / "adding-a-plugin.md").read_text()
    blocks = re.findall(r"```(?:python|yaml)\n# ((?:pipesgd|conf)/\S+)\n(.*?)```", text, re.S)
    kinds = {"compress", "reduction", "comm", "staleness", "engine"}  # a mode: its engine module
    assert {path.split("/")[1].split(".")[0] if path.startswith("pipesgd/") else "" for path, _ in blocks} >= \
        {k.split(".")[0] for k in kinds}, "one worked example per plugin kind"
    for path, body in blocks:
        if not (ROOT / path).exists():
            continue  # the guide's own new compressor (run above)
        source = [line.strip() for line in (ROOT / path).read_text().splitlines()]
        for line in body.splitlines():
            if line.strip() and not line.strip().startswith("#") and "..." not in line:
                assert line.strip() in source, f"{path}: the guide shows {line.strip()!r}, the file does not have it"


@pytest.mark.timeout(60)
def test_documented_compressor_validates_its_knob(doc_compressor):
    with pytest.raises(ValueError, match="compressor.headroom must be an integer in 0..15, got 16"):
        doc_compressor(headroom=16)


def test_the_porting_guide_quotes_the_real_diff():
    """docs/porting-from-ddp.md shows the changed lines of the two example scripts, all of them but
    the module docstring's (the diff's first hunk), and nothing else."""
    import difflib

    before, after = ((ROOT / "examples" / name).read_text().splitlines()
                     for name in ("ddp_tutorial.py", "ddp_tutorial_pipesgd.py"))
    real = {line for line in difflib.unified_diff(before, after, lineterm="") if line[:1] in "+-"}
    doc = (ROOT / "docs" / "porting-from-ddp.md").read_text()
    shown = [line for block in re.findall(r"```diff\n(.*?)```", doc, re.S) for line in block.splitlines()
             if line[:1] in "+-"]
    assert len(shown) >= 20
    assert [line for line in shown if line not in real] == []
    hunks = "\n".join(difflib.unified_diff(before, after, lineterm="")).split("\n@@")[2:]
    code = [line for hunk in hunks for line in hunk.splitlines() if line[:1] in "+-"]
    assert [line for line in code if line not in shown] == []


README_RESULTS = {  # the README's results table: row -> (its record under results/, the arm, the DDP arm it is timed against)
    "ResNet-20 / CIFAR-10 to 86.85 %: DDP + PowerSGD hook":
        ("time-to-accuracy/time-to-accuracy.json", "ddp-powersgd", None),
    "ResNet-20 / CIFAR-10 to 86.85 %: **`pipe+lookahead-int8`**":
        ("time-to-accuracy/time-to-accuracy.json", "pipe+lookahead-int8", "ddp-powersgd"),
    "GPT / Shakespeare to sync's loss + 1 %: DDP + fp16 hook":
        ("gpt-shakespeare/time-to-target-gpt_shakespeare.json", "ddp-fp16", None),
    "GPT / Shakespeare to sync's loss + 1 %: **`pipe+lookahead-int8`**":
        ("gpt-shakespeare/time-to-target-gpt_shakespeare.json", "pipe+lookahead-int8", "ddp-fp16"),
}


def _readme_rows() -> dict[str, list[str]]:
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| ")]
    return {cells[0]: cells[1:] for cells in rows}


def test_readme_results_table_is_its_records():
    """The README's one results table is the headline records' numbers: every time, every ratio
    against the fastest DDP arm, and "tie" exactly where the ratio's range over seeds and timing
    rounds includes 1.0; the targets are the records' own."""
    import json

    rows = _readme_rows()
    assert set(README_RESULTS) <= set(rows)
    for label, (record, arm, against) in README_RESULTS.items():
        result = json.loads((ROOT / "results" / record).read_text())
        if "86.85 %" in label:
            assert result["target_accuracy"] == 86.85
        else:
            assert result["target_accuracy"] == result["targets"]["slack 1 %"] and result["metric"]["lower_is_better"]
        assert len(rows[label]) == 3
        for cell, link in zip(rows[label], ("100mbit", "50mbit", "25mbit")):
            block = result["links"][link]
            assert cell.startswith(f"{block['time_to_target_s'][arm] / 60:.1f} min"), (label, link, cell)
            if against is None:  # the baseline row: the fastest DDP arm at this link
                assert block["speedup"]["best ddp"][arm] == 1.0 and "×" not in cell, (label, link)
                continue
            ratio = re.fullmatch(r"[0-9.]+ min \(([0-9.]+)×(, tie)?\)", cell)
            assert ratio and ratio.group(1) == f"{block['speedup'][against][arm]:.2f}", (label, link, cell)
            verdict = block["speedup_range"][against][arm]["verdict"]
            assert bool(ratio.group(2)) == (verdict == "tie"), (label, link, cell, verdict)


def test_readme_final_accuracies_are_the_records_means():
    """The sentence under the table: the int8 arm's and sync's final accuracy (mean over seeds) and
    the GPT's loss over sync's, as the records have them."""
    import json
    import statistics

    readme = " ".join((ROOT / "README.md").read_text().split())

    def means(record, key):
        finals: dict[str, list[float]] = {}
        for run in json.loads((ROOT / "results" / record).read_text())["arms"]:
            if run["complete"]:
                finals.setdefault(run["name"], []).append(run[key])
        return {arm: statistics.fmean(v) for arm, v in finals.items()}, {arm: len(v) for arm, v in finals.items()}

    acc, n = means("time-to-accuracy/time-to-accuracy.json", "final_test_accuracy")
    assert n["sync"] == n["pipe+lookahead-int8"] == 3
    assert f"{acc['pipe+lookahead-int8']:.2f} % test accuracy against synchronous SGD's {acc['sync']:.2f} %" in readme
    loss, _ = means("gpt-shakespeare/time-to-target-gpt_shakespeare.json", "final_test_loss")
    assert f"{(loss['pipe+lookahead-int8'] / loss['sync'] - 1) * 100:.2f} % above sync's" in readme
