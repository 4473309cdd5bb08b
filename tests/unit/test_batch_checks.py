"""Index checks on the controller (runtime/_checks.py; issue 19, point 8): which arguments a
traced step's embeddings and classification losses bound, and the one clear error a bad batch
gets before dispatch. The mesh-level test (nothing runs, the mesh stays usable) is in
tests/dist/test_user_programs.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.runtime._checks import check_indices, index_checks


def _traced():
    emb, head = nn.Embedding(10, 6), nn.Linear(6, 4)
    opt = torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1)

    def step(ids, labels, keep):
        logits = head(emb(ids.view(-1, 3)).mean(1))
        loss = F.cross_entropy(logits, labels, ignore_index=-1)
        loss = loss + F.cross_entropy(logits[keep], labels[keep])   # a subset: not checked
        loss.backward()
        opt.step()
        return loss

    keep = torch.tensor([True, False, True, True])
    return meshplan.trace(step, torch.randint(0, 10, (4, 3)), torch.tensor([0, 1, 2, 3]), keep)


def test_embeddings_and_losses_bound_their_index_arguments() -> None:
    checks = index_checks(_traced().graph)
    by_name = {(c.name, c.bound, c.ignore) for c in checks}
    assert by_name == {("ids", 10, None), ("labels", 4, -1)}, checks
    ok = {"ids": torch.tensor([[0, 9, 3]] * 4), "labels": torch.tensor([3, -1, 0, 2])}
    check_indices(checks, ok, "step")
    with pytest.raises(meshplan.RuntimeFailure,
                       match=r"'ids' holds 10 at \[2, 1\].*embedding with 10 rows \(0..9\)"):
        check_indices(checks, {**ok, "ids": torch.tensor([[0, 1, 2]] * 2 + [[3, 10, 4]] * 2)},
                      "step")
    with pytest.raises(meshplan.RuntimeFailure,
                       match=r"'labels' holds -2 at \[1\].*4 classes \(0..3 or -1\)"):
        check_indices(checks, {**ok, "labels": torch.tensor([3, -2, 0, 2])}, "step")
