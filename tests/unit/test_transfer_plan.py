"""``meshplan.transfer``'s copy plan (``runtime/_transfer.plan_copies``), exhaustively: every
pair of layouts of a 2-d tensor on every mesh of up to 4 ranks (one axis of 2 or 4, two axes
of 2), source and destination meshes of different shapes too. Each destination piece is made
from the source pieces by the planned copies alone and must equal the piece its layout cuts
from the whole tensor (exact: copies only). Pure Python, no processes."""

from __future__ import annotations

import itertools

import torch

from meshplan.backends import local_part, local_slices, rank_coords
from meshplan.planner import Replicate, Shard
from meshplan.runtime._transfer import plan_copies

SHAPE = (8, 12)
MESHES = [(2,), (4,), (2, 2)]


def _layouts(sizes):
    choices = [Replicate(), Shard(0), Shard(1)]
    return list(itertools.product(choices, repeat=len(sizes)))


def _pieces(layout, sizes):
    out = []
    for rank in range(len(list(itertools.product(*map(range, sizes))))):
        coords = rank_coords(rank, sizes)
        box = tuple((s.start, s.stop) for s in local_slices(SHAPE, layout, sizes, coords))
        out.append((rank, box))
    return out


def test_every_pair_of_layouts_makes_every_destination_piece_exactly():
    whole = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).view(SHAPE)
    pairs = 0
    for ssizes, dsizes in itertools.product(MESHES, MESHES):
        for slayout, dlayout in itertools.product(_layouts(ssizes), _layouts(dsizes)):
            src = _pieces(slayout, ssizes)
            held = {rank: local_part(whole, slayout, ssizes, rank_coords(rank, ssizes))
                    for rank, _ in src}
            dst = _pieces(dlayout, dsizes)
            copies = plan_copies(SHAPE, src, dst)
            assert sorted(copies) == [rank for rank, _ in dst]
            for rank, box in dst:
                made = torch.full([b - a for a, b in box], float("nan"))
                for srank, sreg, dreg in copies[rank]:
                    made[tuple(slice(a, b) for a, b in dreg)] = \
                        held[srank][tuple(slice(a, b) for a, b in sreg)]
                want = local_part(whole, dlayout, dsizes, rank_coords(rank, dsizes))
                assert torch.equal(made, want), (ssizes, slayout, dsizes, dlayout, rank)
            pairs += 1
    assert pairs == sum(len(_layouts(a)) * len(_layouts(b)) for a in MESHES for b in MESHES)


def test_reads_of_a_replicated_source_spread_over_its_replicas():
    src = _pieces((Replicate(),), (4,))
    dst = _pieces((Shard(0),), (4,))
    copies = plan_copies(SHAPE, src, dst)
    assert [copies[r][0][0] for r in range(4)] == [0, 1, 2, 3]      # one reader per replica


def test_a_zero_dim_tensor():
    copies = plan_copies((), [(0, ()), (1, ())], [(0, ()), (1, ()), (2, ())])
    assert copies == {0: [(0, (), ())], 1: [(1, (), ())], 2: [(0, (), ())]}
