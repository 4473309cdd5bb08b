"""The step's state in torch's own formats, and back.

Inside meshplan every stateful tensor has one name: the graph input it is (``model.fc.weight``,
``opt.state.model.fc.weight.exp_avg``). Users hold ``model.state_dict()`` and
``opt.state_dict()`` instead, so ``DistributedStep.state_dict()`` answers in those formats:

- ``"model"``: what ``model.state_dict()`` returns for the one module the step names; for
  several, their entries under ``<variable>.<key>`` (as one ``nn.ModuleDict`` of them would
  give), and trainable tensors outside any module under their variable's name.
- ``"optim"``: what ``opt.state_dict()`` returns (``state`` keyed by the parameter's position
  in the param groups, ``param_groups`` with the hyperparameters) for the one optimizer; for
  several, ``{variable: opt.state_dict()}``.

Tied weights appear under each of their keys, as in torch. Gradients are not part of either
(as in torch); checkpoints keep them (``runtime/_checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._errors import MeshplanError
from ._discover import Inventory


def _roots(inv: Inventory) -> list[tuple[str, nn.Module]]:
    """The named modules no other named module contains."""
    inner = {id(m) for _, root in inv.roots for m in list(root.modules())[1:]}
    return [(name, m) for name, m in inv.roots if id(m) not in inner]


def _model_keys(inv: Inventory) -> dict[str, str]:
    """torch key -> internal name, for every parameter and buffer a module's state_dict has."""
    names = {id(s.tensor): s.name for s in (*inv.params, *inv.buffers)}
    roots = _roots(inv)
    out: dict[str, str] = {}
    for var, mod in roots:
        for key, t in mod.state_dict(keep_vars=True).items():
            if id(t) in names:
                out[key if len(roots) == 1 else f"{var}.{key}"] = names[id(t)]
    held = set(out.values())
    for s in inv.params:             # trainable tensors outside every module
        if s.name not in held:
            out[s.name] = s.name
    return out


def _optim_slots(inv: Inventory) -> list[tuple[str, torch.optim.Optimizer, list[str]]]:
    """Per optimizer: its variable, itself, and its parameters' internal names in the order
    ``opt.state_dict()`` numbers them (param groups in order, parameters in order)."""
    return [(oname, opt, [inv.param_name(p) for g in opt.param_groups for p in g["params"]])
            for oname, opt in inv.optimizers]


def to_torch(inv: Inventory, values: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``values`` (internal name -> tensor) as ``{"model": ..., "optim": ...}`` in torch's
    formats (module docstring)."""
    model = {key: values[name] for key, name in _model_keys(inv).items() if name in values}
    optims = {}
    for oname, opt, pnames in _optim_slots(inv):
        state: dict[int, dict[str, Any]] = {}
        for i, pname in enumerate(pnames):
            prefix = f"{oname}.state.{pname}."
            entry = {k[len(prefix):]: v for k, v in values.items() if k.startswith(prefix)}
            if entry:
                state[i] = dict(sorted(entry.items()))
        groups, at = [], 0
        for g in opt.param_groups:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(at, at + len(g["params"])))})
            at += len(g["params"])
        optims[oname] = {"state": state, "param_groups": groups}
    optim = next(iter(optims.values())) if len(optims) == 1 else optims
    return {"model": model, "optim": optim}


def from_torch(inv: Inventory, sd: Mapping[str, Any],
               known: set[str]) -> tuple[dict[str, torch.Tensor], list[tuple[dict, dict]]]:
    """Internal name -> tensor for a state dict in torch's formats (or in meshplan's internal
    names, as earlier versions returned: keys that are all in ``known``), and the param group
    hyperparameters to set: ``[(live group, saved group)]``. A key or shape that does not fit
    is one error naming it."""
    model, optim = sd.get("model", {}), sd.get("optim", {})
    if set(model) <= known and all(isinstance(v, torch.Tensor) for v in optim.values()) and (
            set(optim) <= known):
        return {**model, **optim}, []
    keys = _model_keys(inv)
    out: dict[str, torch.Tensor] = {}
    for key, value in model.items():
        if key not in keys:
            near = ", ".join(sorted(keys)[:4])
            raise MeshplanError(f"load_state_dict: 'model' has key {key!r}, which the step's "
                                f"modules do not have (they have e.g. {near}); pass what "
                                "model.state_dict() returns")
        out[keys[key]] = value
    slots = _optim_slots(inv)
    per_opt = {slots[0][0]: optim} if len(slots) == 1 and optim else dict(optim)
    groups: list[tuple[dict, dict]] = []
    for oname, opt, pnames in slots:
        saved = per_opt.get(oname)
        if saved is None:
            continue
        live_groups, saved_groups = opt.param_groups, saved.get("param_groups", [])
        if [len(g["params"]) for g in live_groups] != [len(g["params"]) for g in saved_groups]:
            raise MeshplanError(
                f"load_state_dict: optimizer {oname!r} has param groups of "
                f"{[len(g['params']) for g in live_groups]} parameters, the state dict "
                f"{[len(g['params']) for g in saved_groups]}; pass what {oname}.state_dict() "
                "returns for the same parameters")
        groups += list(zip(live_groups, saved_groups))
        for i, entry in saved.get("state", {}).items():
            for k, v in entry.items():
                if isinstance(v, torch.Tensor):
                    out[f"{oname}.state.{pnames[int(i)]}.{k}"] = v
    return out, groups


__all__ = ["from_torch", "to_torch"]
