"""The programs one mesh holds for calls of different signatures (``DistributedStep``): a
call whose arguments' shapes, dtypes or Python values, hyperparameters' zero pattern or
modules' train/eval modes differ gets its own trace and plan, kept for the next such call."""

from __future__ import annotations

from dataclasses import dataclass

from ..frontend._guards import branch_change
from ..ir import Role, random_nodes
from ..planner import Plan
from ._checks import IndexCheck, index_checks

MAX_VARIANTS = 8        # programs one mesh holds for calls of different signatures


@dataclass(frozen=True)
class Variant:
    """One program the mesh runs: its id on the workers, its plan, and what each call sends
    (the data inputs, then the hyperparameters, by input name)."""

    id: int
    plan: Plan
    inputs: tuple[str, ...]
    random: tuple[str, ...] = ()         # its random nodes (seeded per step: backends/_rng.py)
    checks: tuple[IndexCheck, ...] = ()  # index values checked before dispatch (_checks.py)

    @classmethod
    def of(cls, id: int, plan: Plan, inputs: tuple[str, ...]) -> Variant:
        return cls(id, plan, inputs, random_of(plan), index_checks(plan.graph))


def random_of(plan: Plan) -> tuple[str, ...]:
    return tuple(n.name for n in random_nodes(plan.graph))


def call_inputs(plan: Plan) -> list[str]:
    """The inputs a call sends to every rank: the arguments' tensors and the hyperparameters."""
    return [n.target for n in plan.graph.inputs if n.meta.role in (Role.DATA, Role.HYPER)]


def what_changed(old: tuple | None, new: tuple) -> str:
    """Which part of a call's key (``TracedStep.call_key``) differs, in words."""
    parts = ("optimizer hyperparameters (one became zero or non-zero, or a non-numeric "
             "entry changed)", "argument shapes, dtypes or Python values",
             "train/eval modes of the modules", branch_change(old and old[3], new[3]))
    if old is None:
        return parts[1]
    return " and ".join(p for p, a, b in zip(parts, old, new) if a != b) or parts[1]


__all__ = ["MAX_VARIANTS", "Variant", "call_inputs", "random_of", "what_changed"]
