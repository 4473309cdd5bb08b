"""The example GPT step, decorated to run on a mesh: ``meshplan compile`` and ``meshplan run``
find everything they need here.

    meshplan compile examples/gpt_distributed.py:train_step -o gpt.plan
    meshplan run examples/gpt_distributed.py:train_step --plan gpt.plan --steps 3

Conventions the CLI reads from a step's file:

- ``train_step``: a ``meshplan.distribute``-decorated step whose ``example_inputs`` (here a
  zero-argument callable) gives the shapes the plan is compiled for;
- ``batches()``: returns an iterator of argument tuples, one per step (``meshplan run`` takes
  as many as ``--steps``; ``--data MOD:FN`` names another such function).
"""

from __future__ import annotations

from collections.abc import Iterator

import meshplan
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from .gpt import build
except ImportError:  # loaded as a plain file: its folder is on sys.path
    from gpt import build

__all__ = ["batches", "model", "opt", "train_step"]

SEED = 0
_example = build(optimizer="adamw", seed=SEED)
model, opt = _example.model, _example.opt


@meshplan.distribute(mesh={"dp": 2}, example_inputs=lambda: _example.batch(0))
def train_step(x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def batches() -> Iterator[tuple[Tensor, Tensor]]:
    """Step ``i`` trains on the example's ``batch(i)`` (deterministic: same seed, same tokens)."""
    i = 0
    while True:
        yield _example.batch(i)
        i += 1
