"""tree_allreduce (p = 2..5, also over a PeerGroup, as trainer.mode=live runs it) and the hierarchical
allreduce (2x2 node groups, and the degenerate splits) against torch.distributed.all_reduce on Gloo ranks.

Error bounds, per value, derived as in tests/distributed/test_ring.py (S = sum over ranks of |x_r|, u the unit
roundoff of the dtype):
- no compressor: any order of p additions is within (p-1)·u·S of the exact sum, so two of them
  differ by at most 2(p-1)·u·S.
- tree with a compressor: each of the p-1 non-root ranks encodes its subtree's partial sum once on
  the way up (magnitude <= S) and the root encodes the final sum once: p encodes, each adding at
  most per_encode(S) (fp16 2**-11·S, bf16 truncation 2**-7·S, int8 max(S)/254), plus (p-1) fp32
  additions: |tree - exact| <= p·per_encode + (p-1)·2**-24·S, the ring's bound.
- hierarchical with a compressor: only the ring among the n leaders encodes (n encodes of partial
  sums <= S), the node trees add in fp32: |hier - exact| <= n·per_encode + (p-1)·2**-24·S.
"""


import pytest
import torch
import torch.distributed as dist

from distributed_utils import run_workers
from pipesgd import dist as pdist
from pipesgd.comm import tree_allreduce
from pipesgd.comm.base import CommStats
from pipesgd.comm.group import PeerGroup
from pipesgd.comm.hierarchical import HierarchicalAllreduce
from pipesgd.comm.tree import children, parent
from pipesgd.compress import get_compressor

UNIT = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
LENGTHS = [0, 1, 3, 1001, 20_000]


def data(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(17 * rank + n))


def per_encode(S, n):
    return {"fp16": 2.0 ** -11 * S, "bf16": 2.0 ** -7 * S,
            "int8": torch.full_like(S, S.max().item() / 254 if n else 0.0)}


def check(fn, rank, p, encodes, failures, sums, tag, compresses=True):
    """Compare ``fn(tensor, compressor)`` with all_reduce and the exact sum at every length/dtype."""
    for n in LENGTHS:
        xs = [data(r, n) for r in range(p)]
        exact = torch.stack([x.double() for x in xs]).sum(0)
        S = torch.stack([x.double().abs() for x in xs]).sum(0)
        for dtype, u in UNIT.items():
            x = xs[rank].to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            out = x.clone()
            fn(out, None)
            exact_d = torch.stack([y.to(dtype).double() for y in xs]).sum(0)
            if out.dtype != dtype or out.shape != x.shape:
                failures.append(f"{tag} n={n} {dtype}: dtype/shape changed")
            if not torch.all((out.double() - ref.double()).abs() <= 2 * (p - 1) * u * S + 1e-30):
                failures.append(f"{tag} n={n} {dtype}: max diff {(out.double() - ref.double()).abs().max()}")
            if not torch.all((out.double() - exact_d).abs() <= (p - 1) * u * S + 1e-30):
                failures.append(f"{tag} n={n} {dtype}: off the exact sum")
        for name, enc in per_encode(S, n).items():
            out = xs[rank].clone()
            stats = fn(out, name)
            tol = encodes * enc * (1 + 1e-3) + (p - 1) * 2.0 ** -24 * S + 1e-12
            if not torch.all((out.double() - exact).abs() <= tol):
                failures.append(f"{tag} n={n} {name}: error {(out.double() - exact).abs().max()} above bound")
            sums[(tag, n, name)] = out
            if n >= 1000 and (stats.wire_bytes > stats.raw_bytes or compresses and stats.wire_bytes == stats.raw_bytes):
                failures.append(f"{tag} n={n} {name}: wire {stats.wire_bytes} >= raw {stats.raw_bytes}")


def no_failures_and_replicas_agree(results):
    """Every rank's ``(failures, sums)``: no failure, and every rank holds the same sums, bit for bit."""
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}: {failures}"
    for _, sums in results[1:]:
        for key, value in results[0][1].items():
            assert torch.equal(value, sums[key]), f"replicas differ for {key}"


def _tree_worker(rank, p):
    failures, sums = [], {}
    check(lambda t, c: tree_allreduce(t, c), rank, p, p, failures, sums, "tree")
    # Bytes: once up (non-root) and once per child down, the whole tensor each time.
    out = data(rank, 1001)
    stats = tree_allreduce(out)
    edges = len(children(rank, p)) + (parent(rank) is not None)
    if stats.wire_bytes != 4 * 1001 * edges:
        failures.append(f"sent {stats.wire_bytes} bytes over {edges} edges")
    m = data(rank, 12).reshape(3, 4).t()
    ref = m.contiguous().clone()
    dist.all_reduce(ref)
    tree_allreduce(m, group=dist.new_group(list(range(p))))
    if not torch.allclose(m, ref, atol=1e-6):
        failures.append("non-contiguous tensor on a subgroup")
    return failures, sums


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_tree_matches_all_reduce(p):
    results = run_workers(_tree_worker, p, timeout=200)
    no_failures_and_replicas_agree(results)


class Peers(PeerGroup):
    """A group torch.distributed does not know, over the default group's processes, reached only
    through its own methods, as torchft's group is (pipesgd.live.group.TorchftGroup). ``reversed``:
    numbered backwards (its rank 0, the tree's root, is the last process). Counts what it posts."""

    def __init__(self, reversed: bool):
        self.reversed, self.posted = reversed, 0

    def rank(self) -> int:
        return self._process(dist.get_rank())

    def size(self) -> int:
        return dist.get_world_size()

    def _process(self, rank: int) -> int:
        return self.size() - 1 - rank if self.reversed else rank

    def isend(self, tensor, dst):
        self.posted += 1
        return dist.isend(tensor, self._process(dst))

    def irecv(self, tensor, src):
        self.posted += 1
        return dist.irecv(tensor, self._process(src))

    def all_reduce(self, tensor):
        dist.all_reduce(tensor)

    def all_gather(self, out, tensor):
        gathered = [torch.empty_like(tensor) for _ in out]
        dist.all_gather(gathered, tensor)
        for rank, t in enumerate(out):
            t.copy_(gathered[self._process(rank)])


def _peer_tree_worker(rank, p):
    """The tree over :class:`Peers` against all_reduce (the bounds of :func:`check`), numbered as
    the default group and backwards; the first bit for bit as the tree over the default group."""
    failures, sums, groups = [], {}, {"peer": Peers(False), "reversed": Peers(True)}
    for tag, group in groups.items():
        check(lambda t, c, g=group: tree_allreduce(t, c, g), rank, p, p, failures, sums, tag)
        if not group.posted:
            failures.append(f"{tag}: no message went through the PeerGroup")
    check(lambda t, c: tree_allreduce(t, c), rank, p, p, failures, sums, "c10d")
    for (tag, n, name), value in sums.items():
        if tag == "peer" and not torch.equal(value, sums[("c10d", n, name)]):
            failures.append(f"n={n} {name}: the tree over the PeerGroup differs from the tree over the default group")
    return failures, sums


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p", [2, 5])
def test_tree_over_a_peer_group_matches_all_reduce(p):
    results = run_workers(_peer_tree_worker, p, timeout=200)
    no_failures_and_replicas_agree(results)


def _broadcast_schedule_worker(rank, p):
    """The message schedule of one broadcast: every post and every wait on a send, in order."""
    from pipesgd.comm import tree

    events, real_post = [], tree.post

    class Waited:
        def __init__(self, req, dst):
            self.req, self.dst = req, dst

        def wait(self):
            self.req.wait()
            events.append(("waited", self.dst))

    def recording_post(recvs, sends, group, batch):
        rreqs, sreqs = real_post(recvs, sends, group, batch)
        events.append(("posted", [dst for _, dst in sends]))
        return rreqs, [Waited(q, dst) for q, (_, dst) in zip(sreqs, sends)]

    tree.post = recording_post
    try:
        work = torch.full((1000,), float(rank == 0))
        tree.tree_broadcast(work, get_compressor(None), None, CommStats(), 4)
    finally:
        tree.post = real_post
    return events, bool(torch.all(work == 1.0))


@pytest.mark.timeout(120)
def test_tree_broadcast_serves_one_child_at_a_time_farthest_first():
    """A rank that sends to all its children at once splits its link among them, and the farthest
    child, root of the deepest subtree, starts forwarding a round per sibling late: L(L+1)/2
    rounds instead of L. Each send must be posted alone and finished before the next."""
    p = 5
    for rank, (events, got) in enumerate(run_workers(_broadcast_schedule_worker, p, timeout=100)):
        assert got, f"rank {rank} did not receive the root's tensor"
        sends = [e for e in events if e[0] == "waited" or e[1]]
        expected = []
        for c in reversed(children(rank, p)):
            expected += [("posted", [c]), ("waited", c)]
        assert sends == expected, f"rank {rank}: {sends}"


def test_binomial_tree_shape():
    for p in range(1, 17):
        edges = {(c, r) for r in range(p) for c in children(r, p)}
        assert edges == {(r, parent(r)) for r in range(1, p)}, p
        assert len(children(0, p)) == (p - 1).bit_length(), "the root waits ceil(log2 p) rounds"


def _hier_worker(rank, p, splits):
    failures, sums = [], {}
    for size in splits:
        groups = pdist.node_groups(size)
        hier = HierarchicalAllreduce(groups.intra, groups.leaders, group_size=size)
        assert (groups.leaders is not None) == (rank % size == 0)
        # Only leaders of more than one node send compressed bytes.
        check(lambda t, c: hier(t, c), rank, p, p // size, failures, sums, f"g{size}",
              compresses=groups.leaders is not None and p // size > 1)
    return failures, sums


@pytest.mark.timeout(240)
def test_hierarchical_2x2_matches_all_reduce():
    """Two nodes of two ranks, plus one node of four and four nodes of one, on the same 4 ranks."""
    results = run_workers(_hier_worker, 4, [2, 4, 1], timeout=200)
    no_failures_and_replicas_agree(results)


def _bad_group_size(rank, p):
    try:
        pdist.node_groups(2)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_group_size_must_divide_world():
    msg = run_workers(_bad_group_size, 3)[0]
    assert msg is not None and "comm.group_size=2" in msg and "world size 3" in msg
