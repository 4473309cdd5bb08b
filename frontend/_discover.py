"""Finding what a training step closes over: its modules, optimizers and raw parameters, and
naming every stateful tensor (parameters, buffers, optimizer state, gradients)."""

from __future__ import annotations

import dis
import functools
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .._errors import TraceError
from ..ir import Role, SourceLocation
from ._source import location

# Optimizers whose step() we trace and test; a subclass that keeps their step() works too.
SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)
_MAX_DEPTH = 3


@dataclass
class Slot:
    """One stateful tensor location: where to read it, where to put a stand-in while tracing."""

    name: str
    role: Role
    tensor: torch.Tensor
    # (module, attribute) pairs holding a parameter or buffer (several when tied)
    homes: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class Inventory:
    """Everything stateful the step can touch, in a fixed order."""

    params: list[Slot]
    buffers: list[Slot]
    optimizers: list[tuple[str, torch.optim.Optimizer]]
    module_paths: dict[int, str]                    # id(module) -> "model.blocks.0.attn"
    param_index: dict[int, int]                     # id(param tensor) -> index in params
    roots: list[tuple[str, nn.Module]] = field(default_factory=list)  # modules the step names

    def param_name(self, p: torch.Tensor) -> str:
        return self.params[self.param_index[id(p)]].name


def step_location(fn: Callable[..., Any]) -> SourceLocation | None:
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    return location(code.co_filename, code.co_firstlineno, code.co_name)


def _referenced(fn: Any, depth: int, seen: set[int]) -> list[tuple[str, Any]]:
    """(name, object) pairs a function can reach: closure cells, default values, globals it
    names, its bound ``self``, partial arguments, and — recursively — the Python functions
    among them."""
    if id(fn) in seen or depth > _MAX_DEPTH:
        return []
    seen.add(id(fn))
    out: list[tuple[str, Any]] = []
    if isinstance(fn, functools.partial):
        out += [(f"arg{i}", a) for i, a in enumerate(fn.args)]
        out += list(fn.keywords.items())
        return out + _referenced(fn.func, depth, seen)
    if isinstance(fn, types.MethodType):
        out.append(("self", fn.__self__))
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return out
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:  # empty cell
            pass
    # default values (``def step(x, y, model=model, opt=opt)``, a loop-variable idiom)
    positional = code.co_varnames[:code.co_argcount]
    defaults = getattr(fn, "__defaults__", None) or ()
    out += list(zip(positional[len(positional) - len(defaults):], defaults))
    out += list((getattr(fn, "__kwdefaults__", None) or {}).items())
    g = getattr(fn, "__globals__", {})
    for name in _all_names(code):
        if name in g:
            out.append((name, g[name]))
    for name, obj in list(out):
        if isinstance(obj, (types.FunctionType, types.MethodType, functools.partial)):
            out += _referenced(obj, depth + 1, seen)
    return out


def _all_names(code: types.CodeType) -> list[str]:
    """The globals ``code`` (and the functions nested in it) loads: not ``co_names``, which
    also holds attribute names (``opt.step`` would name a global ``step``)."""
    names = [i.argval for i in dis.get_instructions(code)
             if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names += _all_names(c)
    return names


def _expand(name: str, obj: Any) -> list[tuple[str, Any]]:
    """An object that is not itself a module or optimizer (a trainer, a dict) may hold some."""
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, torch.Tensor)):
        return [(name, obj)]
    items: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        items = [(f"{name}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType,
                                                          types.FunctionType)):
        items = list(vars(obj).items())
        items = [(f"{name}.{k}", v) for k, v in items]
    return [(k, v) for k, v in items
            if isinstance(v, (nn.Module, torch.optim.Optimizer))
            or (isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad)]


def discover(fn: Callable[..., Any]) -> Inventory:
    """Find the modules, optimizers and raw trainable tensors that ``fn`` can reach."""
    modules: dict[int, tuple[str, nn.Module]] = {}
    optimizers: dict[int, tuple[str, torch.optim.Optimizer]] = {}
    raw: dict[int, tuple[str, torch.Tensor]] = {}
    for name, obj in _referenced(fn, 0, set()):
        for n, o in _expand(name, obj):
            if isinstance(o, nn.Module):
                modules.setdefault(id(o), (n, o))
            elif isinstance(o, torch.optim.Optimizer):
                optimizers.setdefault(id(o), (n, o))
            elif isinstance(o, torch.Tensor) and o.requires_grad:
                # a trainable tensor outside a module; one that needs no gradient (a lookup
                # table, a threshold) is a constant of the graph
                raw.setdefault(id(o), (n, o))
    where = step_location(fn)
    if not optimizers and not modules and not raw:
        raise TraceError(
            f"meshplan.trace: no module, optimizer or trainable tensor is reachable from "
            f"{_fn_name(fn)}{_at(where)}; a step must close over its model (and, to train, its "
            "optimizer): use a global or closure variable for them"
        )
    # no optimizer: an inference step (a generator's sampling loop, an evaluation), which
    # must not compute gradients (trace_stage_one refuses one that does: NoOptimizer)
    for name, opt in optimizers.values():
        _check_optimizer(name, opt, where)
    return _inventory(list(modules.values()), list(optimizers.values()),
                      list(raw.values()), where)


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _at(where: SourceLocation | None) -> str:
    return f" (defined at {where})" if where else ""


def _check_optimizer(name: str, opt: torch.optim.Optimizer, where: SourceLocation | None) -> None:
    cls = type(opt)
    if not any(cls.step is ok.step for ok in SUPPORTED_OPTIMIZERS):
        names = ", ".join(f"torch.optim.{c.__name__}" for c in SUPPORTED_OPTIMIZERS)
        raise TraceError(
            f"optimizer {name!r} is a {cls.__module__}.{cls.__qualname__}, which meshplan cannot "
            f"trace yet{_at(where)}; use one of {names}"
        )
    for group in opt.param_groups:
        for flag in ("fused", "differentiable", "capturable"):
            if group.get(flag):
                raise TraceError(
                    f"optimizer {name!r} has {flag}=True{_at(where)}; meshplan plans the update "
                    f"itself: construct it with {flag}=False (the default)"
                )


def _inventory(
    modules: list[tuple[str, nn.Module]],
    optimizers: list[tuple[str, torch.optim.Optimizer]],
    raw: list[tuple[str, torch.Tensor]],
    where: SourceLocation | None,
) -> Inventory:
    # Larger modules first, so a parameter is named by its path from the outermost module.
    modules = sorted(modules, key=lambda nm: -sum(1 for _ in nm[1].parameters()))
    params: list[Slot] = []
    buffers: list[Slot] = []
    param_index: dict[int, int] = {}
    buffer_index: dict[int, int] = {}
    module_paths: dict[int, str] = {}
    for var, mod in modules:
        for sub_name, sub in mod.named_modules(remove_duplicate=False):
            module_paths.setdefault(id(sub), f"{var}.{sub_name}" if sub_name else var)
            for attr, p in sub._parameters.items():
                if p is None:
                    continue
                full = f"{var}.{sub_name}.{attr}" if sub_name else f"{var}.{attr}"
                if not p.requires_grad:
                    raise TraceError(
                        f"parameter {full} has requires_grad=False{_at(where)}; meshplan traces "
                        "every parameter as trainable: register a frozen tensor as a buffer "
                        "(module.register_buffer) or remove it from the model"
                    )
                if id(p) not in param_index:
                    param_index[id(p)] = len(params)
                    params.append(Slot(full, Role.PARAM, p))
                params[param_index[id(p)]].homes.append((sub, attr))
            for attr, b in sub._buffers.items():
                if b is None:
                    continue
                full = f"{var}.{sub_name}.{attr}" if sub_name else f"{var}.{attr}"
                if id(b) not in buffer_index:
                    buffer_index[id(b)] = len(buffers)
                    buffers.append(Slot(full, Role.BUFFER, b))
                buffers[buffer_index[id(b)]].homes.append((sub, attr))
    for var, t in raw:
        if id(t) not in param_index:
            param_index[id(t)] = len(params)
            params.append(Slot(var, Role.PARAM, t))
    for oname, opt in optimizers:
        for gi, group in enumerate(opt.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) in param_index:
                    continue
                if not p.requires_grad:
                    raise TraceError(
                        f"optimizer {oname!r} holds a tensor with requires_grad=False "
                        f"(param_groups[{gi}]['params'][{pi}]){_at(where)}; remove it from the "
                        "optimizer"
                    )
                param_index[id(p)] = len(params)
                params.append(Slot(f"{oname}.param_groups.{gi}.params.{pi}", Role.PARAM, p))
    return Inventory(params, buffers, optimizers, module_paths, param_index, modules)
