"""Predicting the optimizer state a first step creates, without tracing the step.

A step traced before its optimizer holds state needs two graphs: the first step (which creates
the state) and the steady step (which reads it). The steady graph is the one that gets planned,
so it is traced first, from state synthesised here: each optimizer class is run once on a tiny
real parameter of each dtype with the group's hyperparameters, and every state tensor it creates
is either shaped like the parameter or a scalar. The tracer then checks the prediction against
the traced step (state structure unchanged by the step, and state exactly for the parameters
that had a gradient when the optimizer stepped); on any doubt it traces the first step as well.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ._capture import OptEntry, StateSpec
from ._discover import Inventory

logger = logging.getLogger(__name__)

_PROBE_SHAPE = (2, 3)          # distinct dims: a state tensor shaped like it is "like the param"


class _Unpredictable(Exception):
    pass


def guess_steady_spec(inv: Inventory, spec: StateSpec) -> StateSpec | None:
    """``spec`` plus the optimizer state a step would create for parameters that have none, or
    None when nothing is missing or the optimizer's state cannot be predicted."""
    have = {(e.opt, e.param) for e in spec.opt}
    entries = list(spec.opt)
    cache: dict[tuple, list[tuple[str, bool, torch.dtype]]] = {}
    try:
        for oi, (_, opt) in enumerate(inv.optimizers):
            for group in opt.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                for p in group["params"]:
                    pi = inv.param_index.get(id(p))
                    if pi is None or (oi, pi) in have:
                        continue
                    key = (type(opt), repr(sorted(hyper.items())), p.dtype)
                    if key not in cache:
                        cache[key] = _probe(type(opt), hyper, p.dtype)
                    for name, like_param, dtype in cache[key]:
                        shape = tuple(p.shape) if like_param else ()
                        entries.append(OptEntry(oi, pi, name, shape, dtype))
    except Exception as e:  # noqa: BLE001 - any failure means "trace the first step instead"
        logger.debug("meshplan: optimizer state not predictable (%s: %s)", type(e).__name__, e)
        return None
    if len(entries) == len(spec.opt):
        return None
    return StateSpec(spec.grads, tuple(sorted(entries, key=lambda e: (e.opt, e.param, e.key))))


def _probe(cls: type[torch.optim.Optimizer], hyper: dict[str, Any],
           dtype: torch.dtype) -> list[tuple[str, bool, torch.dtype]]:
    """(key, shaped like the parameter?, dtype) of each state tensor one step of ``cls`` makes."""
    with torch.device("cpu"), torch.random.fork_rng(devices=[]):
        p = torch.zeros(_PROBE_SHAPE, dtype=dtype, requires_grad=True)
        p.grad = torch.ones_like(p)
        opt = cls([{"params": [p], **hyper}])
        opt.step()
        out = []
        for key in sorted(opt.state[p]):
            v = opt.state[p][key]
            if not isinstance(v, torch.Tensor):
                continue
            if tuple(v.shape) not in (_PROBE_SHAPE, ()):
                raise _Unpredictable(f"state {key!r} has shape {tuple(v.shape)}")
            out.append((key, tuple(v.shape) == _PROBE_SHAPE, v.dtype))
    return out
