"""Capturing one training step into an fx graph: forward, backward and optimizer together.

Stage 1 runs the user's step under ``make_fx`` on fake tensors, with every parameter, buffer,
gradient and optimizer-state tensor swapped for a graph input. Step counters read with
``.item()`` become host scalars (a ShapeEnv that allows scalar outputs), so the update math runs
in Python doubles exactly as in eager mode. Stage 2 re-traces the stage-1 graph under
``functionalize`` so no mutation is left. Module path, source line and phase travel in node
metadata (``custom``) from the step to the final graph.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx.traceback as fxt
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.overrides import TorchFunctionMode

from ..ir import Phase, Role
from ._attention import batch_major_attention
from ._discover import Inventory
from ._decomp import DECOMPOSITIONS
from ._guards import READS, Guard, Guarding, Unguardable, make_static
from ._hyper import HyperSlot, bind_symbols, check_unchanged, hyper_entries
from ._precision import compute_copies, inputs_cast
from ._precision import policy as precision_policy
from ._source import is_user_file, user_frame


@dataclass(frozen=True)
class OptEntry:
    """One tensor of optimizer state: optimizer index, parameter index, key, shape, dtype."""

    opt: int
    param: int
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class StateSpec:
    """The structure of the step's state at entry: which grads exist, which optimizer state."""

    grads: tuple[int, ...]
    opt: tuple[OptEntry, ...]


@dataclass
class StageOne:
    gm: torch.fx.GraphModule
    input_names: list[tuple[str, Role]]
    output_names: list[tuple[str, Role]]     # STATE outputs after the results, in order
    n_results: int
    result_kind: str
    result_keys: tuple[str, ...]
    n_marks: int
    mark_names: list[str]
    exit_spec: StateSpec
    fake_inputs: list[list[torch.Tensor]]   # params, grads, buffers, opt state, data, hyper
    # (optimizer, parameter) pairs whose parameter held a gradient when that optimizer stepped
    stepped: frozenset[tuple[int, int]] = frozenset()
    # reads of tensor values specialised on this call's arguments (``_guards``)
    guards: tuple[Guard, ...] = ()


def current_spec(inv: Inventory) -> StateSpec:
    grads = tuple(i for i, s in enumerate(inv.params) if s.tensor.grad is not None)
    entries = []
    for oi, (_, opt) in enumerate(inv.optimizers):
        for p, st in opt.state.items():
            pi = inv.param_index.get(id(p))
            if pi is None:
                continue
            for k in sorted(st):
                v = st[k]
                if isinstance(v, torch.Tensor):
                    entries.append(OptEntry(oi, pi, k, tuple(v.shape), v.dtype))
    return StateSpec(grads, tuple(sorted(entries, key=lambda e: (e.opt, e.param, e.key))))


def opt_state_name(inv: Inventory, e: OptEntry) -> str:
    return f"{inv.optimizers[e.opt][0]}.state.{inv.params[e.param].name}.{e.key}"


# ---- annotations: module path, source line, phase ----------------------------------------

# Reading a tensor's value into Python (``_guards.READS``): specialised with a guard when only
# the step's arguments decide it; else torch's own reads (the optimizers' step counters)
# become host scalars and the user's are an error.
_HOST_READS = READS


class UserValueRead(Exception):
    """The user's step read a tensor value into Python (``.item()``, ``if t:``...) that no
    guard can hold (``_guards``); ``why`` says what the value depends on."""

    def __init__(self, loc: Any, why: str = "", shape: bool = False) -> None:
        super().__init__(str(loc))
        self.loc = loc
        self.why = why
        self.shape = shape        # a tensor whose shape depends on values, not a Python read


class _Annotator(TorchFunctionMode):
    """Stamps every node created during a torch call with the user's line, the module path and
    the phase; registers a pre-hook on each new autograd node so that its backward ops carry the
    forward call's line and module."""

    def __init__(self, inv: Inventory, guarding: Guarding | None = None) -> None:
        super().__init__()
        self.inv = inv
        self.guarding = guarding
        self.modules: list[str] = []
        self.backward_seen = False
        self.hooked: set[int] = set()

    def _stamp(self, src: Any, module: str, phase: Phase) -> None:
        fxt.current_meta["custom"] = {"src": src, "module": module, "phase": phase.value}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        caller = sys._getframe(1)
        loc = user_frame(caller)
        if func in _HOST_READS and any(isinstance(a, FakeTensor) for a in args):
            try:
                if self.guarding is None:
                    raise Unguardable("")
                return self.guarding.read(func, args, kwargs, loc)
            except Unguardable as e:
                # torch's own reads (an optimizer's step counter) become host scalars
                if is_user_file(caller.f_code.co_filename):
                    raise UserValueRead(loc, e.why) from None
        src = None if loc is None else (loc.file, loc.line, loc.function, loc.code)
        module = self.modules[-1] if self.modules else ""
        phase = Phase.UPDATE if self.backward_seen and not self.modules else Phase.FORWARD
        self._stamp(src, module, phase)
        out = func(*args, **(kwargs or {}))
        if self.guarding is not None:
            try:
                self.guarding.sizes(out, loc)
            except Unguardable as e:
                raise UserValueRead(loc, e.why, shape=True) from None
        for t in pytree.tree_leaves(out):
            fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
            if fn is not None and id(fn) not in self.hooked:
                self.hooked.add(id(fn))
                fn.register_prehook(self._backward_hook(src, module))
        return out

    def _backward_hook(self, src: Any, module: str) -> Callable[..., None]:
        def hook(grad_outputs: Any) -> None:
            self.backward_seen = True
            self._stamp(src, module, Phase.BACKWARD)

        return hook

    @contextlib.contextmanager
    def module_hooks(self) -> Iterator[None]:
        paths = self.inv.module_paths

        def pre(mod: nn.Module, args: Any) -> None:
            self.modules.append(paths.get(id(mod), self.modules[-1] if self.modules else ""))

        def post(mod: nn.Module, args: Any, out: Any) -> None:
            if self.modules:
                self.modules.pop()

        h1 = nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = nn.modules.module.register_module_forward_hook(post, always_call=True)
        try:
            yield
        finally:
            h1.remove()
            h2.remove()


# ---- swapping the state for graph inputs --------------------------------------------------

@contextlib.contextmanager
def _swapped(inv: Inventory, params: list[torch.Tensor], buffers: list[torch.Tensor],
             opt_state: dict[tuple[int, int], dict[str, Any]],
             module_params: list[torch.Tensor] | None = None) -> Iterator[list[dict]]:
    """Point the modules and optimizers at stand-in tensors; restore everything afterwards.
    ``module_params``: what the modules use instead of ``params`` (a precision policy's
    compute copies); the optimizers always get ``params``."""
    saved_attrs: list[tuple[dict, str, Any]] = []
    saved_groups: list[tuple[dict, list, dict]] = []
    saved_state: list[tuple[torch.optim.Optimizer, Any]] = []
    temp_states: list[dict] = []
    try:
        for slot, new in zip(inv.params, module_params if module_params is not None else params):
            for mod, attr in slot.homes:
                saved_attrs.append((mod._parameters, attr, mod._parameters[attr]))
                mod._parameters[attr] = new
        for slot, new in zip(inv.buffers, buffers):
            for mod, attr in slot.homes:
                saved_attrs.append((mod._buffers, attr, mod._buffers[attr]))
                mod._buffers[attr] = new
        for oi, (_, opt) in enumerate(inv.optimizers):
            state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
            for group in opt.param_groups:
                hyper = {k: v for k, v in group.items() if k != "params"}
                saved_groups.append((group, group["params"], hyper))
                # a partial inventory (a few of a model's repeated blocks) leaves the rest out
                idx = [inv.param_index[id(p)] for p in group["params"] if id(p) in inv.param_index]
                group["params"] = [params[i] for i in idx]
                for i in idx:
                    if (oi, i) in opt_state:
                        state[params[i]] = dict(opt_state[(oi, i)])
            saved_state.append((opt, opt.state))
            opt.state = state
            temp_states.append(state)
        yield temp_states
    finally:
        for table, attr, old in reversed(saved_attrs):
            table[attr] = old
        for group, old_params, hyper in saved_groups:
            group.clear()
            group.update(hyper)
            group["params"] = old_params
        for opt, old in saved_state:
            opt.state = old


# ---- stage 1 --------------------------------------------------------------------------------

def _fake(mode: FakeTensorMode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A fake stand-in with the shape and dtype of ``t``; meta tensors become fake CPU tensors."""
    with mode:
        f = torch.empty(t.shape, dtype=t.dtype, device="cpu" if t.is_meta else t.device)
    return f.requires_grad_(requires_grad) if requires_grad else f


def _fake_like(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    with mode:
        return torch.empty(shape, dtype=dtype)


class _BadResult(Exception):
    pass


class NoOptimizerStep(Exception):
    """The step never called ``step()`` on any optimizer it closes over."""


class NoOptimizer(Exception):
    """The step computes gradients but closes over no optimizer (one passed as an argument,
    or made inside the step, is not seen): its update would be lost."""


def trace_stage_one(
    step: Callable[..., Any],
    inv: Inventory,
    spec: StateSpec,
    data: list[torch.Tensor],
    rebuild_args: Callable[[list[torch.Tensor]], tuple[tuple, dict]],
    data_names: list[str],
    hyper: tuple[HyperSlot, ...] = (),
) -> StageOne:
    mode = FakeTensorMode(shape_env=ShapeEnv(allow_scalar_outputs=True),
                          allow_non_fake_inputs=True)
    f_params = [_fake(mode, s.tensor, requires_grad=True) for s in inv.params]
    f_grads = [_fake(mode, inv.params[i].tensor) for i in spec.grads]
    f_buffers = [_fake(mode, s.tensor) for s in inv.buffers]
    f_opt = [_fake_like(mode, e.shape, e.dtype) for e in spec.opt]
    f_data = [_fake(mode, t) for t in data]
    f_hyper = [_fake_like(mode, (), torch.float64) for _ in hyper]

    input_names: list[tuple[str, Role]] = (
        [(s.name, Role.PARAM) for s in inv.params]
        + [(f"{inv.params[i].name}.grad", Role.GRAD) for i in spec.grads]
        + [(s.name, Role.BUFFER) for s in inv.buffers]
        + [(opt_state_name(inv, e), Role.OPT_STATE) for e in spec.opt]
        + [(n, Role.DATA) for n in data_names]
        + [(h.name(inv), Role.HYPER) for h in hyper]
    )
    record: dict[str, Any] = {}
    guarding = Guarding(len(f_params) + len(f_grads) + len(f_buffers) + len(f_opt), data)
    annot = _Annotator(inv, guarding)

    def joint(params, grads, buffers, opt_flat, data_flat, hyper_flat):  # noqa: ANN001, ANN202
        opt_state: dict[tuple[int, int], dict[str, Any]] = {}
        for e, t in zip(spec.opt, opt_flat):
            opt_state.setdefault((e.opt, e.param), {})[e.key] = t
        for i, g in zip(spec.grads, grads):
            params[i].grad = g
        marks: dict[int, torch.Tensor] = {}
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(
                lambda p, i=i: marks.__setitem__(i, p.grad.clone()))
        args, kwargs = rebuild_args(list(data_flat))
        stepped: list[int] = []
        with_grad: set[tuple[int, int]] = set()
        position = {id(p): i for i, p in enumerate(params)}

        def pre_step(i: int, opt: torch.optim.Optimizer) -> None:
            with_grad.update((i, position[id(p)]) for g in opt.param_groups for p in g["params"]
                             if p.grad is not None and id(p) in position)

        hooks = [opt.register_step_post_hook(lambda *_, i=i: stepped.append(i))
                 for i, (_, opt) in enumerate(inv.optimizers)]
        hooks += [opt.register_step_pre_hook(lambda o, *_, i=i: pre_step(i, o))
                  for i, (_, opt) in enumerate(inv.optimizers)]
        try:
            dtype = precision_policy()
            copies = compute_copies(params, dtype) if dtype is not None else None
            with _swapped(inv, params, buffers, opt_state, copies) as temp_states:
                bind_symbols(inv, hyper, hyper_flat)
                bound = hyper_entries(inv)
                with annot, annot.module_hooks(), inputs_cast(inv.roots, dtype):
                    result = step(*args, **kwargs)
                check_unchanged(inv, bound)
                new_buffers = [slot.homes[0][0]._buffers[slot.homes[0][1]]
                               for slot in inv.buffers]
        finally:
            for h in hooks:
                h.remove()
        if not stepped and inv.optimizers:
            raise NoOptimizerStep()
        if not inv.optimizers and any(p.grad is not None for p in params):
            raise NoOptimizer()
        kind, keys, leaves = _result_leaves(result)
        new_grads = [(i, p.grad) for i, p in enumerate(params) if p.grad is not None]
        new_opt = []
        for oi, state in enumerate(temp_states):
            for p, st in state.items():
                for k in sorted(st):
                    if isinstance(st[k], torch.Tensor):
                        e = OptEntry(oi, position[id(p)], k, tuple(st[k].shape), st[k].dtype)
                        new_opt.append((e, st[k]))
        record.update(kind=kind, keys=keys, n_results=len(leaves),
                      grads=[i for i, _ in new_grads], opt=[e for e, _ in new_opt],
                      marks=sorted(marks), with_grad=frozenset(with_grad))
        return (leaves, list(params), [g for _, g in new_grads], new_buffers,
                [t for _, t in new_opt], [marks[i] for i in sorted(marks)])

    # oneDNN's fused RNN layer keeps an opaque workspace between forward and backward that
    # fake tensors cannot carry: trace LSTMs through their plain aten ops instead.
    # nn.MultiheadAttention is traced batch-major (``_attention``), so that the batch splits
    with fxt.preserve_node_meta(), _without_mkldnn(), batch_major_attention():
        gm = make_fx(joint, tracing_mode="fake", decomposition_table=DECOMPOSITIONS)(
            f_params, f_grads, f_buffers, f_opt, f_data, f_hyper)
    guarding.finish(gm)
    if guarding.static:
        gm = make_static(gm, guarding.static)

    exit_spec = StateSpec(tuple(record["grads"]), tuple(sorted(
        record["opt"], key=lambda e: (e.opt, e.param, e.key))))
    output_names = (
        [(s.name, Role.PARAM) for s in inv.params]
        + [(f"{inv.params[i].name}.grad", Role.GRAD) for i in record["grads"]]
        + [(s.name, Role.BUFFER) for s in inv.buffers]
        + [(opt_state_name(inv, e), Role.OPT_STATE) for e in record["opt"]]
    )
    plain = [[t.detach() for t in group]
             for group in (f_params, f_grads, f_buffers, f_opt, f_data, f_hyper)]
    return StageOne(gm, input_names, output_names, record["n_results"], record["kind"],
                    record["keys"], len(record["marks"]),
                    [inv.params[i].name for i in record["marks"]], exit_spec, plain,
                    record["with_grad"], tuple(guarding.guards))


@contextlib.contextmanager
def _without_mkldnn() -> Iterator[None]:
    """oneDNN off (as ``torch.backends.mkldnn.flags(enabled=False)``, without its TF32 note)."""
    was = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was)


def _result_leaves(result: Any) -> tuple[str, tuple[str, ...], list[torch.Tensor]]:
    if result is None:
        return "none", (), []
    if isinstance(result, torch.Tensor):
        return "tensor", (), [result]
    if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
        return type(result).__name__, (), list(result)
    if isinstance(result, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in result.items()
    ):
        return "dict", tuple(result), list(result.values())
    raise _BadResult(type(result).__name__)


# ---- stage 2 --------------------------------------------------------------------------------

def functionalize_stage_one(one: StageOne) -> torch.fx.GraphModule:
    """Re-trace the stage-1 graph under functionalization; node metadata is carried over."""
    gm = one.gm

    def run(*groups: list[torch.Tensor]) -> Any:
        return torch.fx.Interpreter(gm).run(*groups)

    flat_fn = torch.func.functionalize(run, remove="mutations")
    with fxt.preserve_node_meta():
        return make_fx(flat_fn, tracing_mode="fake")(*one.fake_inputs)


def is_fake(t: Any) -> bool:
    return isinstance(t, FakeTensor)
