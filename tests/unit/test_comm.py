"""The alpha-beta collective model and the layout-change table (planner/_comm.py).

Ring formulas on n ranks for a buffer of B bytes over a link of latency a and bandwidth b:
reduce-scatter = all-gather = all-to-all = (n-1)a + (n-1)/n B/b, all-reduce = both of them,
send/recv = a + B/b, broadcast = (n-1)a + B/b. The CPU preset must agree with what this machine
measured (a 64 MB gloo all-reduce on 2 ranks ran at ~1.0 GB/s).
"""

from __future__ import annotations

import itertools

import pytest

from meshplan.planner import PRESETS, Collective, Link, Partial, ReduceOp, Replicate, Shard
from meshplan.planner import collective_time as ct
from meshplan.planner._comm import transition

LINK = Link(bandwidth=1e9, latency=1e-5)
RING_HALVES = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL)


@pytest.mark.parametrize("kind", list(Collective))
def test_one_rank_or_no_bytes_costs_nothing(kind) -> None:
    assert ct(kind, 1 << 30, 1, LINK) == 0.0
    assert ct(kind, 0, 8, LINK) == 0.0


def test_closed_forms() -> None:
    n, nbytes = 4, 1e9                                    # 1 GB over 4 ranks
    assert ct(Collective.ALL_REDUCE, nbytes, n, LINK) == pytest.approx(6e-5 + 1.5)
    for kind in RING_HALVES:
        assert ct(kind, nbytes, n, LINK) == pytest.approx(3e-5 + 0.75)
    assert ct(Collective.SEND_RECV, nbytes, n, LINK) == pytest.approx(1e-5 + 1.0)
    assert ct(Collective.BROADCAST, nbytes, n, LINK) == pytest.approx(3e-5 + 1.0)


@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_all_reduce_is_a_reduce_scatter_then_an_all_gather(n) -> None:
    no_latency = Link(bandwidth=LINK.bandwidth, latency=0.0)
    for link in (LINK, no_latency):
        ar = ct(Collective.ALL_REDUCE, 64e6, n, link)
        rs = ct(Collective.REDUCE_SCATTER, 64e6, n, link)
        assert ar == pytest.approx(2 * rs)
        assert ar == pytest.approx(rs + ct(Collective.ALL_GATHER, 64e6, n, link))
    # the bandwidth term alone: all-reduce moves 2 (n-1)/n of the buffer per rank
    assert ct(Collective.ALL_REDUCE, 64e6, n, no_latency) == pytest.approx(
        2 * (n - 1) / n * 64e6 / 1e9)


@pytest.mark.parametrize("kind", list(Collective))
def test_monotone_in_bytes_and_ranks(kind) -> None:
    sizes = [1, 1 << 10, 1 << 20, 1 << 26, 1 << 30]
    times = [ct(kind, s, 8, LINK) for s in sizes]
    assert times == sorted(times) and times[0] < times[-1]
    ranks = [2, 3, 4, 8, 16, 64, 512]
    times = [ct(kind, 1 << 20, n, LINK) for n in ranks]
    assert times == sorted(times)


@pytest.mark.parametrize("kind", list(Collective))
def test_faster_links_are_never_slower(kind) -> None:
    slow, fast = Link(1e9, 1e-5), Link(4e10, 2e-6)
    for nbytes, n in itertools.product([1 << 10, 1 << 26], [2, 8]):
        assert ct(kind, nbytes, n, fast) < ct(kind, nbytes, n, slow)


def test_bandwidth_term_tends_to_twice_the_buffer_for_large_rings() -> None:
    link = Link(bandwidth=1e9, latency=0.0)
    assert ct(Collective.ALL_REDUCE, 1e9, 1024, link) == pytest.approx(2.0, rel=1e-3)


def test_cpu_preset_matches_the_measured_gloo_all_reduce() -> None:
    """Measured here: gloo all-reduce of 64 MB ~1.0 GB/s with 2 ranks (algorithm bandwidth, which
    for 2 ranks equals the bus bandwidth). Within a factor of 2 is the order of magnitude."""
    cpu = PRESETS["cpu"]
    t = ct(Collective.ALL_REDUCE, 64e6, 2, cpu.intra_node)
    assert 0.5e9 <= 64e6 / t <= 2e9
    assert cpu.intra_node == cpu.inter_node               # one host: both links are loopback


def test_h100_all_reduce_of_a_gigabyte_takes_under_10_ms_inside_a_node() -> None:
    h = PRESETS["h100"]
    assert ct(Collective.ALL_REDUCE, 1e9, 8, h.intra_node) < 0.01
    assert ct(Collective.ALL_REDUCE, 1e9, 8, h.inter_node) > ct(
        Collective.ALL_REDUCE, 1e9, 8, h.intra_node)


# ---- transition: the collective that changes a layout along one axis ------------------------

R, S0, S1 = Replicate(), Shard(0), Shard(1)
PSUM, PAVG, PN2 = Partial(ReduceOp.SUM), Partial(ReduceOp.AVG), Partial(ReduceOp.NORM2)
AR, AG, RS, A2A = (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER,
                   Collective.ALL_TO_ALL)
FREE, NO = None, False

# A 2-norm's pieces (each rank's norm of its shard) only become whole; a whole value becomes
# pieces for free (coordinate 0 keeps it, the others hold 0), as it becomes a partial sum.
#            to:  R     S(0)  S(1)  P(sum) P(avg) P(norm2)
TABLE = {R:    (FREE, FREE, FREE, FREE, FREE, FREE),    # slicing is local; a partial keeps
         S0:   (AG,   FREE, A2A,  NO,   NO,   NO),      # one copy
         S1:   (AG,   A2A,  FREE, NO,   NO,   NO),
         PSUM: (AR,   RS,   RS,   FREE, NO,   NO),
         PAVG: (AR,   RS,   RS,   NO,   FREE, NO),
         PN2:  (AR,   NO,   NO,   NO,   NO,   FREE)}
COLUMNS = (R, S0, S1, PSUM, PAVG, PN2)


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(COLUMNS, COLUMNS)),
                         ids=lambda p: str(p))
def test_transition_table(src, dst) -> None:
    expected = TABLE[src][COLUMNS.index(dst)]
    got = transition(src, dst)
    assert got is expected or got == expected, f"{src} -> {dst}: {got!r}, expected {expected!r}"
    if isinstance(got, Collective):                       # every real change costs something
        assert ct(got, 1 << 20, 2, LINK) > 0


def test_the_table_covers_every_pair() -> None:
    assert len(TABLE) * len(COLUMNS) == 36
    assert all(len(row) == len(COLUMNS) for row in TABLE.values())


def test_transition_results_are_typed() -> None:
    """None (free) and False (not allowed) must stay distinguishable from a Collective."""
    results = {transition(a, b) for a, b in itertools.product(COLUMNS, COLUMNS)}
    assert results == {None, False, AR, AG, RS, A2A}


def test_reshard_bytes_are_the_buffer_each_collective_works_on() -> None:
    """A 256-byte tensor over 4 ranks: an all-gather ends with all 256 bytes; an all-to-all
    exchanges the pieces of a 64-byte shard (the lowering records the same convention)."""
    from meshplan.ir import TensorMeta
    from meshplan.planner import Mesh
    from meshplan.planner._problem import reshard_steps

    mesh, meta = Mesh({"dp": 4}, "h100"), TensorMeta((8, 8), "float32")
    assert [(k, b) for k, _, b, _ in reshard_steps(meta, (S0,), (R,), mesh)] == [(AG, 256)]
    assert [(k, b) for k, _, b, _ in reshard_steps(meta, (S0,), (S1,), mesh)] == [(A2A, 64)]
    assert [(k, b) for k, _, b, _ in reshard_steps(meta, (PSUM,), (S1,), mesh)] == [(RS, 256)]
