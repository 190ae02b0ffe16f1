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


README_ROWS = {"sync (K=1, ring)": "sync", "PyTorch DDP": "ddp", "DDP + fp16 hook": "ddp-fp16",
               "**pipe (K=2, ring)**": "pipe", "pipe + fp16": "pipe-fp16", "**pipe + int8**": "pipe-int8",
               "sync, FireCaffe tree": "sync+tree", "parameter server (sync)": "ps_sync"}


@pytest.mark.timeout(30)
def test_readme_result_table_matches_benchmarks_json():
    """The README's headline numbers are docs/benchmarks.json's medians, not hand-copied drift."""
    import json

    cells = {c["name"]: c for c in json.loads((ROOT / "docs" / "benchmarks.json").read_text())}
    rows = [line.split("|")[1:-1] for line in (ROOT / "README.md").read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() in README_ROWS]
    assert len(rows) == len(README_ROWS)
    for label, p2_ms, p2_x, p4_ms, p4_x in rows:
        for p, ms, speedup in ((2, p2_ms, p2_x), (4, p4_ms, p4_x)):
            cell = cells[f"resnet20/p{p}/100mbit/{README_ROWS[label.strip()]}"]
            sync = cells[f"resnet20/p{p}/100mbit/sync"]
            assert int(ms) == round(cell["median_iter_ms"]), label
            assert speedup.strip() == f"{sync['median_iter_ms'] / cell['median_iter_ms']:.2f}×", label


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


def test_readme_time_to_accuracy_table_matches_its_json():
    """The README's time-to-accuracy rows are docs/time-to-accuracy.json's numbers."""
    import json

    import statistics

    result = json.loads((ROOT / "docs" / "time-to-accuracy.json").read_text())
    seeds: dict[str, list[float]] = {}
    for run in result["arms"]:
        if run["complete"]:
            seeds.setdefault(run["name"], []).append(run["final_test_accuracy"])
    final = {arm: statistics.fmean(accs) for arm, accs in seeds.items()}  # the mean over seeds
    rows = {m.group(1): line for line in (ROOT / "README.md").read_text().splitlines()
            if (m := re.match(r"\| \**`([a-z0-9+\-]+)`\** \(K=\d[^)]*\) \|", line))}
    assert set(rows) == set(final) and {"sync", "pipe+lookahead"} <= set(rows)
    for arm, line in rows.items():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert cells[1].startswith(f"{final[arm]:.2f} %"), (arm, cells[1])
        for cell, link in zip(cells[2:], ("100mbit", "50mbit", "25mbit")):
            block = result["links"][link]
            assert cell.startswith(f"{block['time_to_target_s'][arm] / 60:.1f} min"), (arm, link)
            ratio = re.search(r"\(([0-9.]+)×", cell)  # the pipe arms' ratio against DDP + PowerSGD
            if ratio:
                assert ratio.group(1) == f"{block['speedup']['ddp-powersgd'][arm]:.2f}", (arm, link, cell)
                verdict = block["speedup_range"]["ddp-powersgd"][arm]["verdict"]
                assert ("tie" in cell) == (verdict == "tie"), (arm, link, cell, verdict)
            assert ratio or not arm.startswith("pipe"), (arm, link, cell)


def test_readme_claims_no_win_where_the_range_includes_one():
    """Every ratio the README calls a tie is one in the JSON, and every pipe arm's ratio against
    DDP + PowerSGD whose range includes 1.0 is called a tie; the README says what ± means."""
    import json

    result = json.loads((ROOT / "docs" / "time-to-accuracy.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert result["warmup_accounting"]["headline"] == "own_rate" and "own rate (the headline accounting" in readme
    assert "`±` is half\nthe range" in readme or "± is half the range" in readme.replace("`", "").replace("\n", " ")
    ties = [(link, arm) for link, block in result["links"].items()
            for arm, r in block["speedup_range"]["ddp-powersgd"].items() if arm.startswith("pipe") and r["verdict"] == "tie"]
    assert ties, "the JSON has ties against DDP + PowerSGD"
    assert "sooner at every link" not in readme
