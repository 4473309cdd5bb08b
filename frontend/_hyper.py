"""Optimizer hyperparameters as runtime inputs of the graph.

A learning-rate schedule, or ``opt.param_groups[0]["lr"] = ...`` set by hand between calls,
must take effect at the next call without a re-trace. So every numeric hyperparameter the
optimizer's update reads (``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum``,
``dampening``) is traced as a host scalar read from a 0-d float64 graph input (role HYPER),
exactly as the optimizers' own step counters are: the update math then runs in Python doubles
with the value of the call, as in eager mode.

The optimizers branch on two of them (``if weight_decay != 0``, ``if momentum != 0``): a zero
there stays a constant of the graph and is part of the graph's key (a change to or from zero
traces again), a non-zero value is traced as a symbol known to be non-zero. Any value of the
others (a learning rate annealed to 0 too) is a runtime input. Should an optimizer branch on
another one, tracing fails on that guard and the step is traced with constants instead. A
value that is not a plain number (a tensor ``lr``) stays a constant too, keyed by its value.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ._discover import Inventory

# The numeric hyperparameters of torch.optim's SGD, Adam and AdamW that their step() reads,
# and those whose step() branches on ``!= 0``.
HYPER_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "dampening")
BRANCHED = frozenset({"weight_decay", "momentum"})


@dataclass(frozen=True, slots=True)
class HyperSlot:
    """One hyperparameter fed at every call: optimizer, param group, key, index in a tuple."""

    opt: int
    group: int
    key: str
    index: int | None = None          # betas[0], betas[1]

    def name(self, inv: Inventory) -> str:
        tail = "" if self.index is None else f".{self.index}"
        return f"{inv.optimizers[self.opt][0]}.param_groups.{self.group}.{self.key}{tail}"

    def read(self, inv: Inventory) -> float:
        v = inv.optimizers[self.opt][1].param_groups[self.group][self.key]
        return float(v if self.index is None else v[self.index])

    def write(self, group: dict[str, Any], value: Any) -> None:
        if self.index is None:
            group[self.key] = value
        else:
            seq = list(group[self.key])
            seq[self.index] = value
            group[self.key] = tuple(seq)


def _runtime(v: Any, key: str) -> bool:
    """Whether a hyperparameter value is fed at run time: a plain number, non-zero where the
    optimizers branch on it being zero."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and (v != 0 or key not in BRANCHED))


def hyper_slots(inv: Inventory) -> tuple[HyperSlot, ...]:
    """The hyperparameters that the current values make runtime inputs, in a fixed order."""
    out = []
    for oi, (_, opt) in enumerate(inv.optimizers):
        for gi, group in enumerate(opt.param_groups):
            for k in HYPER_KEYS:
                v = group.get(k)
                if isinstance(v, (tuple, list)):
                    out += [HyperSlot(oi, gi, k, i) for i, x in enumerate(v) if _runtime(x, k)]
                elif _runtime(v, k):
                    out.append(HyperSlot(oi, gi, k))
    return tuple(out)


def hyper_key(inv: Inventory, runtime: bool = True) -> tuple:
    """What a graph is specialised on among the param groups' entries: every entry's value,
    except that a runtime hyperparameter counts only as being one (when ``runtime``)."""
    def one(k: str, v: Any) -> Any:
        if runtime and k in HYPER_KEYS:
            if isinstance(v, (tuple, list)):
                return tuple(one(k, x) for x in v)
            if _runtime(v, k):
                return "<runtime>"
        return v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)

    return tuple(
        tuple(sorted((k, one(k, v)) for k, v in g.items() if k != "params"))
        for _, opt in inv.optimizers for g in opt.param_groups)


def hyper_values(inv: Inventory) -> dict[str, torch.Tensor]:
    """The runtime hyperparameters' current values, by graph input name (0-d float64)."""
    return {s.name(inv): torch.tensor(s.read(inv), dtype=torch.float64)
            for s in hyper_slots(inv)}


def bind_symbols(inv: Inventory, slots: tuple[HyperSlot, ...],
                 inputs: list[torch.Tensor]) -> None:
    """While tracing: set each slot's param-group entry to a host scalar read from its graph
    input; those in ``BRANCHED`` are known to be non-zero (the optimizers' ``!= 0`` branches
    then resolve statically).
    The param groups are restored by the caller (``_swapped``)."""
    for s, t in zip(slots, inputs):
        x = t.item()
        if s.key in BRANCHED:
            torch._check(x != 0)
        s.write(inv.optimizers[s.opt][1].param_groups[s.group], x)


@contextlib.contextmanager
def keep_schedulers(fn: Any) -> Iterator[None]:
    """Tracing never advances the user's objects: the LR schedulers ``fn`` can reach get their
    state back afterwards (a scheduler stepped inside the step is refused: ``HyperChanged``)."""
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    from ._discover import _referenced

    found: dict[int, Any] = {}
    for _, obj in _referenced(fn, 0, set()):
        items = [obj]
        if isinstance(obj, dict):
            items += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            items += list(obj)
        elif hasattr(obj, "__dict__") and not callable(obj):     # a trainer holding one
            items += list(vars(obj).values())
        for o in items:
            if isinstance(o, (LRScheduler, ReduceLROnPlateau)):
                found[id(o)] = o
    saved = [(o, copy.deepcopy({k: v for k, v in vars(o).items() if k != "optimizer"}))
             for o in found.values()]
    try:
        yield
    finally:
        for o, state in saved:
            o.__dict__.update(state)


class HyperChanged(Exception):
    """The step itself changed a param group's hyperparameter (an LR scheduler stepped inside
    the step): the graph could not carry that change to the next call."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def hyper_entries(inv: Inventory) -> list[tuple[str, Any]]:
    """Every param group's hyperparameter entries as they are now, for ``check_unchanged``."""
    return [(f"{name}.param_groups[{gi}][{k!r}]", g.get(k))
            for name, opt in inv.optimizers for gi, g in enumerate(opt.param_groups)
            for k in HYPER_KEYS]


def check_unchanged(inv: Inventory, before: list[tuple[str, Any]]) -> None:
    """Raise ``HyperChanged`` when the step replaced a hyperparameter entry. Compared by
    identity: the traced values are symbols, and comparing them by value would guard on them."""
    for (where, old), (_, new) in zip(before, hyper_entries(inv)):
        same = old is new or (isinstance(old, tuple) and isinstance(new, tuple)
                              and len(old) == len(new)
                              and all(a is b for a, b in zip(old, new)))
        if not same:
            raise HyperChanged(where)


__all__ = ["BRANCHED", "HYPER_KEYS", "HyperChanged", "HyperSlot", "check_unchanged", "hyper_entries",
           "keep_schedulers", "bind_symbols", "hyper_key", "hyper_slots", "hyper_values"]
