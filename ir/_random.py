"""Random ops: which nodes draw random numbers (dropout's ``bernoulli``, ``rand_like``...).

A random node is an aten op torch tags ``nondeterministic_seeded`` (it reads a generator),
except attention ops whose ``dropout_p`` is 0 (tagged because they could draw, but do not).
On a mesh such a node cannot equal one process bit for bit: each rank draws its own values
from a generator the runtime seeds per step (``RANDOM_SEMANTICS``; ``backends/_rng.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .._errors import IRError
from ._graph import Graph, Node
from ._ops import resolve_op
from ._types import NodeKind

# One sentence after "N random ops", shared by the first call's warning and
# ``meshplan plan show`` / ``Plan.summary()``.
RANDOM_SEMANTICS = (
    "they do not match one process bit for bit: on the mesh each rank draws them from a "
    "generator seeded from the run's seed, the step number, the op and the rank's "
    "coordinates on the mesh axes that shard the op's output, so ranks holding replicas draw "
    "the same values, ranks holding different shards different ones, and a run is "
    "reproducible from its seed (torch.manual_seed before the first call, or "
    "distribute(seed=...)) on the same mesh and plan")


@functools.lru_cache(maxsize=None)
def _seeded(target: str) -> tuple[bool, int | None]:
    """Whether ``target`` is tagged ``nondeterministic_seeded``, and the schema position of its
    ``dropout_p`` argument (None without one)."""
    try:
        op = resolve_op(target)
    except IRError:
        return False, None
    names = [a.name for a in op._schema.arguments]
    return (torch.Tag.nondeterministic_seeded in op.tags,
            names.index("dropout_p") if "dropout_p" in names else None)


def is_random(node: Node) -> bool:
    """True when ``node`` draws random numbers when it runs."""
    return node.kind is NodeKind.OP and draws(node.target, node.args, dict(node.kwargs))


def draws(target: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """True when a call of op ``target`` with these arguments draws random numbers (also for
    fx nodes while tracing: ``frontend/_guards.py``)."""
    seeded, p_at = _seeded(target)
    if not seeded:
        return False
    if p_at is None:
        return True
    p = args[p_at] if p_at < len(args) else kwargs.get("dropout_p", 0.0)
    return p != 0


def random_nodes(graph: Graph) -> tuple[Node, ...]:
    """The random nodes of ``graph``, in graph order."""
    return tuple(n for n in graph.nodes if is_random(n))


@functools.lru_cache(maxsize=None)
def takes_generator(target: str) -> bool:
    """True when the op's schema has a ``generator`` argument (``bernoulli``, ``normal``...);
    ``rand_like`` and the attention ops do not, and draw from the device's default one."""
    return any(a.name == "generator" for a in resolve_op(target)._schema.arguments)
