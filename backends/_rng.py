"""Random ops on a mesh: which generator each rank's random op draws from, per step.

Semantics (Megatron's, derived per op instead of kept in a tracker): every random node of a
program (``ir.is_random``: dropout's ``bernoulli``, ``rand_like``...) draws, at every step,
from a fresh generator seeded with ``op_seed(run seed, step, stream)``, where the node's
``stream`` (fixed at lowering) hashes its name and this rank's coordinates on ONLY the mesh axes
that shard the node's output:

- ranks that hold replicas of the output (a ``Replicate`` axis: tensor-parallel ranks after an
  all-reduce, or every rank of an op that runs replicated) get the same stream and draw the same
  values, so the replicas stay equal;
- ranks that hold different shards (a ``Shard`` axis: data parallel's batch halves, a head
  split) get different streams and draw independent values, as one process draws different
  values for different rows;
- a ``Partial`` output (each rank holding a summand) means nothing for a random draw: the
  sharding rules never choose one (``planner/rules/random_ops.py``) and ``stream`` refuses it.

So a run is reproducible from its seed on the same mesh and plan (not from a different plan:
what a rank draws depends on its piece's shape and layout), and does not equal one process bit
for bit. The generator is passed as the op's ``generator`` argument where its schema has one;
otherwise the device's default generator is seeded around the call under a lock and restored,
so the process's own random state (a thread mesh's other ranks, the caller's) is untouched.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import LoweringError
from ..ir import Node
from ..planner import Layout, Partial, Shard

_MASK64 = (1 << 64) - 1
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class StepRNG:
    """What a rank needs to seed its random ops for one step: the run's seed (one per run,
    the same on every rank) and the step's number (``DistributedStep`` counts its mesh steps
    from 0)."""

    seed: int
    step: int


def sharded_axes(outputs: Sequence[Layout | None], sizes: Sequence[int]) -> tuple[int, ...]:
    """The mesh axes (of size > 1) on which some output of a node is ``Shard``."""
    return tuple(a for a in range(len(sizes)) if sizes[a] > 1 and any(
        layout is not None and isinstance(layout[a], Shard) for layout in outputs))


def stream(node: Node, outputs: Sequence[Layout | None], coords: Sequence[int],
           sizes: Sequence[int]) -> int:
    """The 64-bit stream id of random ``node`` on the rank at ``coords``: a hash of the node's
    name and the rank's coordinates on the axes that shard its ``outputs`` (module doc)."""
    for layout in outputs:
        if layout is not None and any(isinstance(p, Partial) for p in layout):
            where = f" at {node.source}" if node.source else ""
            raise LoweringError(
                f"random op {node.target} ({node.name}){where} has a partial output layout "
                f"{tuple(str(p) for p in layout)}: each rank would draw a summand of random "
                "values, which sum to nothing meaningful; the sharding rules never choose this, "
                "so the plan was edited or made by another meshplan: plan the step again")
    key = node.name + "|" + ",".join(f"{a}:{coords[a]}" for a in sharded_axes(outputs, sizes))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def op_seed(rng: StepRNG, stream_id: int) -> int:
    """The seed of one random op's generator at one step (63 bits: a valid torch seed)."""
    data = struct.pack("<QQQ", rng.seed & _MASK64, rng.step & _MASK64, stream_id & _MASK64)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def call_seeded(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                seed: int, device: str, takes_generator: bool) -> Any:
    """``fn(*args, **kwargs)`` drawing from a generator seeded with ``seed`` on ``device``."""
    if takes_generator:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return fn(*args, **{**kwargs, "generator": gen})
    with _LOCK:
        gen = _default_generator(device)
        saved = gen.get_state()
        gen.manual_seed(seed)
        try:
            return fn(*args, **kwargs)
        finally:
            gen.set_state(saved)


def _default_generator(device: str) -> torch.Generator:
    dev = torch.device(device)
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        torch.cuda.init()
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise LoweringError(f"random ops on device {device!r}: no default generator known there; "
                        "run on cpu or cuda")


__all__ = ["StepRNG", "call_seeded", "op_seed", "sharded_axes", "stream"]
