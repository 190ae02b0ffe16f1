"""pipesgd.data: finding / verifying / extracting datasets, the restricted unpickler, and the
per-rank loaders. Real-data tests read the offline copies in ../shared/data through a read-only
view of their own (``shared``), so neither that directory's permission bits nor what a run
extracted next to its archive changes what they see; they skip without the copies. Everything
else runs on tiny synthetic data."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import multiprocessing
import os
import pickle
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

import pipesgd.data.cifar as cifar_mod
from pipesgd.data import (
    CIFAR10,
    MNIST,
    DatasetError,
    EvalLoader,
    FashionMNIST,
    ShardedLoader,
    Split,
)
from pipesgd.data.download import download
from pipesgd.data.loader import random_crop_flip

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
CIFAR_ARCHIVE = SHARED / "cifar-10-python.tar.gz"
SHARED_CIFAR_MD5 = "befa26460785474cedbfe392927bcba9"
MNIST_DIR = SHARED / "mnist"
FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
MNIST_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

needs_cifar = pytest.mark.skipif(
    not CIFAR_ARCHIVE.is_file(), reason=f"offline CIFAR-10 copy not found at {CIFAR_ARCHIVE}"
)
needs_mnist = pytest.mark.skipif(
    not MNIST_DIR.is_dir(), reason=f"offline MNIST copy not found at {MNIST_DIR}"
)
# CI installs it (`make setup`), so there the test runs and a missing package fails it.
needs_fashion = pytest.mark.skipif(
    not FASHION_DIR.is_dir() and not os.environ.get("CI"),
    reason=f"{FASHION_DIR} absent (make setup installs it as root; apt-get install -y dataset-fashion-mnist)",
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory):
    """A read-only root holding only the shared archive and MNIST files (symlinks): what a fresh
    ../shared/data holds, whatever was extracted into the real one and whoever may write there."""
    view = tmp_path_factory.mktemp("shared-view")
    for name in ("cifar-10-python.tar.gz", "mnist"):
        if (SHARED / name).exists():
            (view / name).symlink_to(SHARED / name)
    view.chmod(0o555)
    yield view
    view.chmod(0o755)


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# --------------------------------------------------------------------------- CIFAR-10, real data


@pytest.fixture(scope="module")
def cifar_cache(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Path:
    """The shared archive (read-only root) prepared once into a temporary cache directory."""
    if not CIFAR_ARCHIVE.is_file():
        pytest.skip(f"offline CIFAR-10 copy not found at {CIFAR_ARCHIVE}")
    cache = tmp_path_factory.mktemp("cifar-cache")
    CIFAR10(str(shared), cache_dir=str(cache), download=False).prepare()
    return cache


@pytest.fixture(scope="module")
def cifar_splits(cifar_cache: Path, shared: Path) -> tuple[Split, Split]:
    return CIFAR10(str(shared), cache_dir=str(cifar_cache), download=False).load()


def _pickled_member(name: str) -> dict:
    """A batch read straight from the archive with the stdlib unpickler (trusted test data)."""
    with tarfile.open(CIFAR_ARCHIVE, "r:gz") as tar:
        for member in tar:
            if member.name.endswith("/" + name):
                return pickle.load(tar.extractfile(member), encoding="bytes")
    raise AssertionError(f"{name} not in {CIFAR_ARCHIVE}")


@needs_cifar
def test_cifar_from_shared_archive(cifar_cache: Path, cifar_splits: tuple[Split, Split], shared: Path) -> None:
    train, test = cifar_splits
    assert train.images.shape == (50_000, 3, 32, 32) and train.images.dtype == torch.uint8
    assert test.images.shape == (10_000, 3, 32, 32) and test.labels.dtype == torch.int64
    assert train.labels.bincount().tolist() == [5000] * 10
    assert test.labels.bincount().tolist() == [1000] * 10
    batch = _pickled_member("data_batch_1")
    first = torch.from_numpy(batch[b"data"][0].reshape(3, 32, 32))
    assert torch.equal(train.images[0], first)
    assert train.labels[:100].tolist() == batch[b"labels"][:100]
    # per-channel means match the published statistics of this copy (README: 0-255 scale)
    mean = train.images.numpy().mean(axis=(0, 2, 3))  # numpy: no float copy, 10x faster here
    assert np.allclose(mean, [125.27, 122.93, 113.86], atol=0.01)
    # the read-only root was not written to; the cache holds exactly the extracted tree
    assert _listing(shared) == sorted(p.name for p in shared.iterdir() if p.is_symlink())
    assert _listing(cifar_cache) == ["cifar-10-batches-py"]


@needs_cifar
def test_cifar_prepare_is_idempotent(cifar_cache: Path, shared: Path) -> None:
    tree = cifar_cache / "cifar-10-batches-py"
    before = {p.name: p.stat().st_mtime_ns for p in tree.iterdir()}
    start = time.perf_counter()
    CIFAR10(str(shared), cache_dir=str(cifar_cache), download=False).prepare()
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in tree.iterdir()} == before


@needs_cifar
def test_cifar_file_url_into_tmp_cache_with_md5(
    tmp_path: Path, cifar_splits: tuple[Split, Split]
) -> None:
    cache = tmp_path / "cache"
    ds = CIFAR10(
        str(tmp_path / "empty-root"),
        url=CIFAR_ARCHIVE.as_uri(),
        md5=SHARED_CIFAR_MD5,
        cache_dir=str(cache),
    )
    ds.prepare()
    assert _listing(cache) == ["cifar-10-batches-py"]
    train, test = ds.load()
    assert torch.equal(train.images[-1], cifar_splits[0].images[-1])
    assert torch.equal(test.labels, cifar_splits[1].labels)


@needs_cifar
def test_cifar_strict_md5_mismatch(tmp_path: Path, shared: Path) -> None:
    cache = tmp_path / "cache"
    wrong = "0" * 32
    with pytest.raises(DatasetError) as err:
        CIFAR10(str(shared), md5=wrong, cache_dir=str(cache)).prepare()
    msg = str(err.value)
    assert str(shared / CIFAR_ARCHIVE.name) in msg and wrong in msg and SHARED_CIFAR_MD5 in msg
    assert "\n" not in msg
    assert _listing(cache) == []


@needs_cifar
def test_cifar_extraction_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared: Path) -> None:
    """A failure (here Ctrl-C) after two members were written leaves the cache empty."""
    real_copy, calls = cifar_mod._copy, []

    def failing_copy(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise KeyboardInterrupt
        real_copy(src, dst)

    monkeypatch.setattr(cifar_mod, "_copy", failing_copy)
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        CIFAR10(str(shared), cache_dir=str(cache)).prepare()
    assert len(calls) == 3
    assert _listing(cache) == []


@needs_cifar
def test_cifar_truncated_archive(tmp_path: Path) -> None:
    root, cache = tmp_path / "root", tmp_path / "cache"
    root.mkdir()
    with open(CIFAR_ARCHIVE, "rb") as f:
        (root / "cifar-10-python.tar.gz").write_bytes(f.read(3_000_000))
    with pytest.raises(DatasetError, match=r"truncated archive .*cifar-10-python\.tar\.gz: ") as err:
        CIFAR10(str(root), cache_dir=str(cache), download=False).prepare()
    assert "stops after 3000000 bytes" in str(err.value) and "fetch it again" in str(err.value)
    assert "\n" not in str(err.value)
    assert _listing(cache) == []


def test_cifar_not_a_gzip(tmp_path: Path) -> None:
    (tmp_path / "cifar-10-python.tar.gz").write_bytes(b"<html>404 not found</html>")
    cache = tmp_path / "cache"
    with pytest.raises(DatasetError, match=r"corrupt archive .*cifar-10-python\.tar\.gz"):
        CIFAR10(str(tmp_path), cache_dir=str(cache)).prepare()
    assert _listing(cache) == []


def test_cifar_missing_dataset_message(tmp_path: Path) -> None:
    root = tmp_path / "nowhere"
    with pytest.raises(DatasetError) as err:
        CIFAR10(str(root), download=False).prepare()
    msg = str(err.value)
    assert str(root / "cifar-10-batches-py") in msg and str(root / "cifar-10-python.tar.gz") in msg
    assert "data.root=" in msg and "data.download=true" in msg and "\n" not in msg
    assert not root.exists()  # a failed lookup creates nothing


def test_cifar_unreachable_url_message(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    url = "http://127.0.0.1:9/cifar-10-python.tar.gz"  # discard port: connection refused
    with pytest.raises(DatasetError) as err:
        CIFAR10(str(tmp_path / "root"), url=url, cache_dir=str(cache)).prepare()
    msg = str(err.value)
    assert "could not download " + url in msg and "looked for" in msg and "data.root" in msg
    assert _listing(cache) == []


def test_cifar_load_before_prepare(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="call prepare"):
        CIFAR10(str(tmp_path), cache_dir=str(tmp_path / "cache")).load()


def test_constructors_validate_and_touch_nothing(tmp_path: Path) -> None:
    root = tmp_path / "not-created"
    for cls in (CIFAR10, MNIST, FashionMNIST):
        ds = cls(str(root), cache_dir=str(tmp_path / "cache"))
        assert (ds.num_classes, ds.in_channels) == (10, 3 if cls is CIFAR10 else 1)
        with pytest.raises(ValueError, match=r"batch_size must be an integer >= 1, got 0"):
            cls(str(root), batch_size=0)
        with pytest.raises(ValueError, match=r"eval_batch_size .* got -1"):
            cls(str(root), eval_batch_size=-1)
        with pytest.raises(ValueError, match="root"):
            cls("")
    with pytest.raises(ValueError, match=r"md5 must be a 32-character hex md5 string, got 'abc'"):
        CIFAR10(str(root), md5="abc")
    with pytest.raises(ValueError, match="unknown file names"):
        MNIST(str(root), md5={"train-images": "0" * 32})
    assert _listing(tmp_path) == []


# --------------------------------------------------------------- CIFAR-10, synthetic fakes


class _RunsCode:
    """Unpickling this calls os.system: what a malicious batch file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _batch_bytes(rows: int, label: int = 0) -> bytes:
    data = np.full((rows, 3 * 32 * 32), label, dtype=np.uint8)
    batch = {b"batch_label": b"fake", b"labels": [label] * rows, b"data": data}
    return pickle.dumps(batch, protocol=2)


def _fake_tree(folder: Path, rows: int, first: bytes | None = None) -> None:
    folder.mkdir(parents=True)
    for i, name in enumerate([*(f"data_batch_{k}" for k in range(1, 6)), "test_batch"]):
        blob = first if (i == 0 and first is not None) else _batch_bytes(rows, label=i)
        (folder / name).write_bytes(blob)


def _fake_archive(path: Path, rows: int, first: bytes | None = None) -> None:
    tree = path.parent / "fake-src" / "cifar-10-batches-py"
    _fake_tree(tree, rows, first)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(tree, arcname="cifar-10-batches-py")


def test_restricted_unpickler_refuses_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps({b"data": _RunsCode(marker), b"labels": []}, protocol=2)
    _fake_tree(tmp_path / "root" / "cifar-10-batches-py", rows=10, first=evil)
    ds = CIFAR10(str(tmp_path / "root"), cache_dir=str(tmp_path / "cache"))
    ds.prepare()  # a complete extracted tree is taken as is; its contents are checked on load
    with pytest.raises(DatasetError, match=r"refusing to unpickle .*data_batch_1: .*system"):
        ds.load()
    assert not marker.exists()


def test_archive_with_malicious_batch_is_rejected_whole(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_RunsCode(marker), protocol=2)
    _fake_archive(tmp_path / "root" / "cifar-10-python.tar.gz", rows=10, first=evil)
    cache = tmp_path / "cache"
    with pytest.raises(DatasetError, match="refusing to unpickle"):
        CIFAR10(str(tmp_path / "root"), cache_dir=str(cache)).prepare()
    assert not marker.exists()
    assert _listing(cache) == []


def test_fake_batches_with_wrong_shape_are_rejected(tmp_path: Path) -> None:
    """Real batches must be 10000x3072; a small fake one is named in the error."""
    _fake_tree(tmp_path / "cifar-10-batches-py", rows=10)
    with pytest.raises(DatasetError, match=r"data_batch_1: expected 'data' a 10000x3072 uint8"):
        CIFAR10(str(tmp_path)).load()


def test_cifar_default_cache_dir_follows_root_writability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root is never written to (even by root): extraction goes to $PIPESGD_CACHE;
    a writable root is its own cache."""
    monkeypatch.setattr(cifar_mod, "ROWS_PER_BATCH", 10)
    env_cache = tmp_path / "env-cache"
    monkeypatch.setenv("PIPESGD_CACHE", str(env_cache))
    ro_root, rw_root = tmp_path / "ro", tmp_path / "rw"
    for root in (ro_root, rw_root):
        _fake_archive(root / "cifar-10-python.tar.gz", rows=10)
    ro_root.chmod(0o555)
    try:
        CIFAR10(str(ro_root)).prepare()
        assert _listing(ro_root) == ["cifar-10-python.tar.gz", "fake-src"]
        assert _listing(env_cache) == ["cifar-10-batches-py"]
        assert len(CIFAR10(str(ro_root)).load()[0]) == 50
    finally:
        ro_root.chmod(0o755)
    CIFAR10(str(rw_root)).prepare()
    assert "cifar-10-batches-py" in _listing(rw_root)


def test_download_checks_md5_and_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    source = tmp_path / "blob.bin"
    source.write_bytes(b"payload" * 1000)
    good = hashlib.md5(source.read_bytes()).hexdigest()
    dest_dir = tmp_path / "dest"
    dest_dir.mkdir()
    with pytest.raises(DatasetError, match=f"md5 mismatch for .*blob.bin.*expected {'f' * 32}"):
        download(source.as_uri(), dest_dir / "blob.bin", md5="f" * 32)
    assert _listing(dest_dir) == []
    assert download(source.as_uri(), dest_dir / "blob.bin", md5=good) == good
    assert _listing(dest_dir) == ["blob.bin"]


def _prepare_and_load(root: Path, cache: Path) -> None:
    CIFAR10(str(root), cache_dir=str(cache)).prepare()
    train, test = CIFAR10(str(root), cache_dir=str(cache)).load()
    assert len(train) == 50 and len(test) == 10


def test_concurrent_prepare_extracts_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes preparing the same cache at once: one extracts, the other waits and reuses."""
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method to share the patched module with children")
    root, cache, record = tmp_path / "root", tmp_path / "cache", tmp_path / "extractions"
    _fake_archive(root / "cifar-10-python.tar.gz", rows=10)
    monkeypatch.setattr(cifar_mod, "ROWS_PER_BATCH", 10)
    real_extract = cifar_mod.extract

    def recording_extract(archive: Path, dest: Path) -> None:
        with open(record, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # widen the window in which the other process would collide
        real_extract(archive, dest)

    monkeypatch.setattr(cifar_mod, "extract", recording_extract)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_prepare_and_load, args=(root, cache)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(record.read_text().split()) == 1
    assert _listing(cache) == ["cifar-10-batches-py"]


# ----------------------------------------------------------------- MNIST / Fashion-MNIST


@pytest.fixture(scope="module")
def mnist_splits(shared: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Split, Split]:
    if not MNIST_DIR.is_dir():
        pytest.skip(f"offline MNIST copy not found at {MNIST_DIR}")
    ds = MNIST(str(shared), download=False, cache_dir=str(tmp_path_factory.mktemp("mnist-cache")))
    ds.prepare()
    return ds.load()


@needs_mnist
def test_mnist_from_shared_gz(mnist_splits: tuple[Split, Split]) -> None:
    train, test = mnist_splits
    assert train.images.shape == (60_000, 1, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (10_000, 1, 28, 28) and test.labels.dtype == torch.int64
    assert train.labels[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert test.labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
    assert abs(_pixel_mean(train) - MNIST.mean[0]) < 1e-3


def _pixel_mean(split: Split) -> float:
    """Mean pixel on the 0-1 scale (numpy: no float copy of the whole split)."""
    return float(split.images.numpy().mean()) / 255


def _raw_copy(dest: Path) -> dict[str, bytes]:
    dest.mkdir(parents=True)
    raw = {}
    for name in MNIST_NAMES:
        raw[name] = gzip.decompress((MNIST_DIR / f"{name}.gz").read_bytes())
        (dest / name).write_bytes(raw[name])
    return raw


@needs_mnist
def test_mnist_from_raw_files(tmp_path: Path, mnist_splits: tuple[Split, Split]) -> None:
    _raw_copy(tmp_path / "MNIST" / "raw")
    ds = MNIST(str(tmp_path), download=False)
    ds.prepare()
    train, test = ds.load()
    assert torch.equal(train.images, mnist_splits[0].images)
    assert torch.equal(test.labels, mnist_splits[1].labels)


@needs_mnist
def test_mnist_corrupt_idx_magic_and_contents(tmp_path: Path) -> None:
    folder = tmp_path / "mnist"
    raw = _raw_copy(folder)
    bad = bytearray(raw["t10k-labels-idx1-ubyte"])
    bad[3] = 0x02
    (folder / "t10k-labels-idx1-ubyte").write_bytes(bytes(bad))
    pattern = r"bad IDX file .*t10k-labels-idx1-ubyte: magic number 0x00000802, expected 0x00000801"
    with pytest.raises(DatasetError, match=pattern):
        MNIST(str(tmp_path), download=False).prepare()
    with pytest.raises(DatasetError, match=pattern):
        MNIST(str(tmp_path), download=False).load()
    # a valid header with altered contents is caught by the md5 of the decompressed bytes
    bad = bytearray(raw["t10k-labels-idx1-ubyte"])
    bad[-1] = (bad[-1] + 1) % 10
    (folder / "t10k-labels-idx1-ubyte").write_bytes(bytes(bad))
    with pytest.raises(DatasetError, match=r"md5 mismatch for the contents of .*t10k-labels"):
        MNIST(str(tmp_path), download=False).prepare()


@needs_mnist
def test_mnist_download_is_verified_and_atomic(
    tmp_path: Path, mnist_splits: tuple[Split, Split]
) -> None:
    cache = tmp_path / "cache"
    ds = MNIST(str(tmp_path / "root"), url=MNIST_DIR.as_uri(), cache_dir=str(cache))
    ds.prepare()
    assert _listing(cache / "mnist") == sorted(f"{n}.gz" for n in MNIST_NAMES)
    assert torch.equal(ds.load()[1].images, mnist_splits[1].images)

    # a mirror serving altered contents: rejected by content md5, nothing left behind
    mirror = tmp_path / "mirror"
    raw = _raw_copy(mirror)
    altered = bytearray(raw["train-labels-idx1-ubyte"])
    altered[-1] = (altered[-1] + 1) % 10
    for name in MNIST_NAMES:
        data = bytes(altered) if name == "train-labels-idx1-ubyte" else raw[name]
        (mirror / f"{name}.gz").write_bytes(gzip.compress(data, compresslevel=1))
    cache2 = tmp_path / "cache2"
    with pytest.raises(DatasetError, match=r"md5 mismatch .*train-labels-idx1-ubyte"):
        MNIST(str(tmp_path / "root"), url=str(mirror), cache_dir=str(cache2)).prepare()
    assert _listing(cache2 / "mnist") == ["train-images-idx3-ubyte.gz"]


def test_mnist_missing_dataset_message(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as err:
        MNIST(str(tmp_path / "nowhere"), download=False).prepare()
    msg = str(err.value)
    assert str(tmp_path / "nowhere" / "mnist") in msg and "train-images-idx3-ubyte" in msg
    assert "data.download=true" in msg and "\n" not in msg


@needs_fashion
def test_fashion_mnist_from_debian_package(tmp_path: Path) -> None:
    ds = FashionMNIST(str(tmp_path / "empty"), download=False)
    ds.prepare()  # verifies the hardcoded content md5s against the bit-exact Debian copy
    train, test = ds.load()
    assert train.images.shape == (60_000, 1, 28, 28) and test.images.shape == (10_000, 1, 28, 28)
    assert train.labels.bincount().tolist() == [6000] * 10
    assert abs(_pixel_mean(train) - FashionMNIST.mean[0]) < 1e-3


# ------------------------------------------------------------------------------- loaders


def _synthetic(n: int, channels: int = 3, size: int = 32, seed: int = 0) -> Split:
    """Random pixels; labels are the sample ids, so batches reveal which samples they hold."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, channels, size, size), dtype=torch.uint8, generator=g)
    return Split(images=images, labels=torch.arange(n))


def _epoch(loader: ShardedLoader, epoch: int, start_batch: int = 0) -> list[tuple]:
    return list(loader.iter_epoch(epoch, start_batch))


def test_sharded_equal_batch_counts_and_disjoint_shards() -> None:
    split, world, batch = _synthetic(1003), 3, 32
    loaders = [ShardedLoader(split, batch, r, world, seed=7) for r in range(world)]
    assert {len(loader) for loader in loaders} == {(1003 // world) // batch}
    seen = []
    for loader in loaders:
        batches = _epoch(loader, 0)
        assert len(batches) == len(loader)
        assert all(x.shape == (batch, 3, 32, 32) and x.dtype == torch.float32 for x, _ in batches)
        assert all(y.dtype == torch.int64 for _, y in batches)
        seen.append(torch.cat([y for _, y in batches]))
    ids = torch.cat(seen)
    assert len(ids.unique()) == len(ids) == world * len(loaders[0]) * batch


def test_sharded_covers_the_epoch_when_it_divides() -> None:
    split, world, batch = _synthetic(96), 4, 8
    ids = torch.cat(
        [y for r in range(world) for _, y in ShardedLoader(split, batch, r, world, seed=1)]
    )
    assert sorted(ids.tolist()) == list(range(96))


def test_sharded_reshuffles_per_epoch_and_is_seeded() -> None:
    split = _synthetic(512)
    a, b = ShardedLoader(split, 64, 1, 2, seed=3), ShardedLoader(split, 64, 1, 2, seed=3)
    order = lambda loader: torch.cat([y for _, y in loader])  # noqa: E731
    a.set_epoch(0)
    first = order(a)
    a.set_epoch(1)
    assert not torch.equal(first, order(a))
    b.set_epoch(0)
    assert torch.equal(first, order(b))
    other = ShardedLoader(split, 64, 1, 2, seed=4)
    assert not torch.equal(first, order(other))
    fixed = ShardedLoader(split, 64, 0, 2, seed=3, shuffle=False)
    assert torch.cat([y for _, y in fixed]).tolist() == list(range(0, 512, 2))


def test_sharded_resume_mid_epoch_is_bit_exact() -> None:
    split = _synthetic(700)
    mean, std = CIFAR10.mean, CIFAR10.std
    full = _epoch(ShardedLoader(split, 50, 1, 2, seed=11, augment=True, mean=mean, std=std), 2)
    resumed_loader = ShardedLoader(split, 50, 1, 2, seed=11, augment=True, mean=mean, std=std)
    tail = _epoch(resumed_loader, 2, start_batch=4)
    assert len(tail) == len(full) - 4 == 3
    for (x, y), (x2, y2) in zip(full[4:], tail, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    assert _epoch(resumed_loader, 2, start_batch=len(resumed_loader)) == []
    with pytest.raises(ValueError, match="start_batch"):
        resumed_loader.iter_epoch(2, start_batch=len(resumed_loader) + 1)


def test_augmentation_shape_reproducible_and_varies() -> None:
    split = _synthetic(256)
    make = lambda seed, rank=0: ShardedLoader(split, 64, rank, 2, seed=seed, augment=True)  # noqa: E731
    x, y = next(iter(make(5)))
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    x2, _ = next(iter(make(5)))
    assert torch.equal(x, x2)
    plain, _ = next(iter(ShardedLoader(split, 64, 0, 2, seed=5, augment=False)))
    assert not torch.equal(x, plain)  # same samples (same seed), different pixels
    assert torch.equal(y, next(iter(ShardedLoader(split, 64, 0, 2, seed=5)))[1])


def _reference_crop_flip(img: torch.Tensor, dy: int, dx: int, flip: bool, pad: int) -> torch.Tensor:
    """torchvision's RandomCrop(padding=pad) then RandomHorizontalFlip, for one image."""
    c, h, w = img.shape
    padded = torch.zeros(c, h + 2 * pad, w + 2 * pad, dtype=img.dtype)
    padded[:, pad : pad + h, pad : pad + w] = img
    out = padded[:, dy : dy + h, dx : dx + w]
    return out.flip(-1) if flip else out


def test_random_crop_flip_matches_per_image_reference() -> None:
    x = _synthetic(40).images
    g = torch.Generator().manual_seed(0)
    dy, dx = torch.randint(9, (40,), generator=g), torch.randint(9, (40,), generator=g)
    flip = torch.rand(40, generator=g) < 0.5
    got = random_crop_flip(x, dy, dx, flip, 4)
    want = torch.stack(
        [_reference_crop_flip(x[i], int(dy[i]), int(dx[i]), bool(flip[i]), 4) for i in range(40)]
    )
    assert torch.equal(got, want)


def test_normalization_matches_formula() -> None:
    split = _synthetic(64)
    mean, std = CIFAR10.mean, CIFAR10.std
    x, y = next(iter(ShardedLoader(split, 64, 0, 1, seed=0, mean=mean, std=std, shuffle=False)))
    ref = (split.images.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(
        3, 1, 1
    )
    assert torch.allclose(x, ref, atol=1e-5) and torch.equal(y, split.labels)


def test_eval_loader_covers_every_sample_once() -> None:
    split = _synthetic(1003, channels=1, size=28)
    for world in (1, 2, 3, 4):
        ids = []
        for rank in range(world):
            loader = EvalLoader(split, 100, rank, world, mean=MNIST.mean, std=MNIST.std)
            batches = list(loader)
            assert len(batches) == len(loader)
            assert all(x.dtype == torch.float32 and x.shape[1:] == (1, 28, 28) for x, _ in batches)
            ids += [i for _, y in batches for i in y.tolist()]
        assert sorted(ids) == list(range(1003))


def test_eval_loader_shares_are_the_ranks_slices_and_cover_its_samples_once() -> None:
    """How live replica groups divide the test set among a quorum (pipesgd.live.peers): the share
    of a whole-set loader is the rank's loader; shares of a rank's slice cover that slice."""
    split = _synthetic(1003, channels=1, size=28)
    labels = lambda loader: [i for _, y in loader for i in y.tolist()]  # noqa: E731
    whole = EvalLoader(split, 100, 0, 1, mean=MNIST.mean, std=MNIST.std)
    for count in (1, 2, 3):
        assert [labels(whole.share(i, count)) for i in range(count)] == \
            [labels(EvalLoader(split, 100, i, count, mean=MNIST.mean, std=MNIST.std)) for i in range(count)]
    rank = EvalLoader(split, 100, 1, 2)
    assert sum((labels(rank.share(i, 3)) for i in range(3)), []) == labels(rank)
    with pytest.raises(ValueError, match=r"index must be an integer in \[0, 1\], got 2"):
        whole.share(2, 2)


def test_loader_arguments_are_validated() -> None:
    split = _synthetic(100)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, 1\], got 2"):
        ShardedLoader(split, 10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="fewer than batch_size=64"):
        ShardedLoader(split, 64, 0, 2, seed=0)
    with pytest.raises(ValueError, match="mean must have 1 or 3"):
        ShardedLoader(split, 10, 0, 1, seed=0, mean=(0.5, 0.5))
    with pytest.raises(ValueError, match=r"Split\.images must be a uint8"):
        Split(images=torch.zeros(4, 3, 2, 2), labels=torch.zeros(4, dtype=torch.int64))


@needs_cifar
def test_dataset_loader_conveniences(cifar_splits: tuple[Split, Split], shared: Path) -> None:
    ds = CIFAR10(str(shared), batch_size=100, eval_batch_size=500)
    train_loader = ds.train_loader(cifar_splits[0], rank=1, world_size=2, seed=0)
    assert len(train_loader) == 250 and train_loader.augment
    x, _ = next(iter(train_loader))
    assert x.shape == (100, 3, 32, 32)
    eval_loader = ds.eval_loader(cifar_splits[1], rank=1, world_size=2)
    assert len(eval_loader) == 10 and eval_loader.num_samples == 5000
    x, _ = next(iter(eval_loader))
    assert abs(x.mean().item()) < 0.2  # normalised with the dataset's mean/std


# -------------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    ("name", "cls", "batch_size", "augment"),
    [
        ("cifar10", CIFAR10, 128, True),
        ("mnist", MNIST, 64, False),
        ("fashion_mnist", FashionMNIST, 64, False),
    ],
)
def test_data_configs_instantiate(
    name: str,
    cls: type,
    batch_size: int,
    augment: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PIPESGD_DATA", str(tmp_path / "data"))
    ds = instantiate(OmegaConf.load(REPO / "conf" / "data" / f"{name}.yaml"))
    assert type(ds) is cls
    assert ds.root == str(tmp_path / "data") and ds.download and ds.url is None
    assert (ds.batch_size, ds.augment) == (batch_size, augment)
    assert pickle.loads(pickle.dumps(ds)).batch_size == batch_size  # can be sent to workers
    assert _listing(tmp_path) == []


# ------------------------------------------------------------ truncated transfers (reliability)


class _ShortBodyHandler(http.server.BaseHTTPRequestHandler):
    """Promises 1000 bytes and sends 400, then closes: a connection dropped mid-download."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"x" * 400)
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


@pytest.mark.timeout(60)
def test_dropped_download_is_explained_and_leaves_nothing(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ShortBodyHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/blob.bin"
        with pytest.raises(DatasetError, match=r"truncated download of .*blob\.bin: got 400 of 1000 bytes"):
            download(url, tmp_path / "blob.bin", timeout=10)
    finally:
        server.shutdown()
        server.server_close()
    assert _listing(tmp_path) == [], "the partial file must be deleted"


@needs_mnist
def test_truncated_mnist_gz_is_explained(tmp_path: Path) -> None:
    folder = tmp_path / "mnist"
    folder.mkdir()
    for name in MNIST_NAMES:
        (folder / f"{name}.gz").write_bytes((MNIST_DIR / f"{name}.gz").read_bytes())
    cut = (MNIST_DIR / "t10k-labels-idx1-ubyte.gz").read_bytes()[:3000]
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(cut)
    with pytest.raises(DatasetError, match=r"truncated file .*t10k-labels-idx1-ubyte\.gz: its gzip stream "
                                           r"stops after 3000 bytes.*fetch it again") as err:
        MNIST(str(tmp_path), download=False).prepare()
    assert "\n" not in str(err.value)
