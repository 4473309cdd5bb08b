"""``meshplan.trace``: a training step as an IR graph, and a drop-in replacement for the step."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .._errors import MeshplanError, TraceError
from ..ir import (
    Graph,
    GraphInfo,
    NodeKind,
    Output,
    OutputKind,
    Ref,
    ResultSpec,
    Role,
    TensorMeta,
    eliminate_dead_code,
    interpret,
    merge_host_scalars,
    remove_identity_ops,
    run_passes,
    verify,
)
from ._capture import (
    NoOptimizer,
    NoOptimizerStep,
    StateSpec,
    UserValueRead,
    _BadResult,
    current_spec,
    functionalize_stage_one,
    opt_state_name,
    trace_stage_one,
)
from ._autocast import honoured as honoured_autocast
from ._autocast import target as autocast_target
from ._convert import convert
from ._precision import applied as applied_precision
from ._precision import policy as precision_policy
from ._discover import Inventory, discover, step_location
from ._guards import Guard, branch
from ._hyper import HyperChanged, hyper_key, hyper_slots, hyper_values, keep_schedulers
from ._probe import guess_steady_spec
from ._source import describe, exception_user_location
from ._stamp import stamp
from ._template import (
    TRACED_BLOCKS,
    NotTemplatable,
    Partial,
    Repeat,
    find_repeat,
    partial,
    truncated,
)

logger = logging.getLogger(__name__)

_DATA_DEPENDENT = (GuardOnDataDependentSymNode, DataDependentOutputException,
                   DynamicOutputShapeException)


def trace(step_fn: Callable[..., Any], *example_args: Any) -> TracedStep:
    """Capture ``step_fn`` (forward, ``loss.backward()``, optimizer step) into one IR graph.

    ``step_fn`` is an ordinary training step that closes over its model and optimizer. Tracing
    runs on fake tensors and changes no state; it works before the first step, after eager
    steps, and for models on the meta device. The returned :class:`TracedStep` is callable like
    the step itself and runs through the IR's reference interpreter.
    """
    traced = TracedStep(step_fn)
    traced._prepare(example_args)
    return traced


def _with_trace_options(method: Callable[..., Any]) -> Callable[..., Any]:
    """Trace with the step's autocast regions run as its target device would, and with its
    mixed-precision policy."""
    @functools.wraps(method)
    def wrapper(self: TracedStep, *args: Any, **kwargs: Any) -> Any:
        with honoured_autocast(self._autocast), applied_precision(self._precision):
            return method(self, *args, **kwargs)
    return wrapper


@dataclasses.dataclass(frozen=True)
class _Args:
    """The step's arguments, positional and keyword, split into tensor leaves (graph data) and
    the rest (Python values the graph is specialised on)."""

    leaves: list[Any]
    spec: Any
    tensor_at: tuple[int, ...]

    @staticmethod
    def of(args: tuple, kwargs: dict[str, Any] | None = None) -> _Args:
        leaves, spec = pytree.tree_flatten((list(args), dict(kwargs or {})))
        at = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        return _Args(leaves, spec, at)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_at]

    def signature(self) -> tuple:
        sig = []
        for x in self.leaves:
            if isinstance(x, torch.Tensor):
                sig.append(("T", tuple(x.shape), x.dtype))
            else:
                try:
                    hash(x)
                    sig.append(("V", type(x), x))
                except TypeError:
                    sig.append(("R", repr(x)))
        return (str(self.spec), tuple(sig))

    def rebuild(self, data: list[torch.Tensor]) -> tuple[tuple, dict]:
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, data):
            leaves[i] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return tuple(args), kwargs

    def names(self, fn: Callable[..., Any]) -> list[str]:
        """The tensor leaves' names: the parameter's name (``x``, ``batch['ids']``), the
        keyword's for keyword arguments."""
        try:
            params = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            params = []
        paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(self.leaves, self.spec))
        out = []
        for path, _leaf in (paths[i] for i in self.tensor_at):
            where, head, rest = path[0], path[1], path[2:]
            if getattr(where, "idx", 0) == 1:              # a keyword argument
                base = str(head.key)
            else:
                idx = getattr(head, "idx", 0)
                base = params[idx] if idx < len(params) else f"arg{idx}"
            out.append(base + pytree.keystr(rest))
        return out


class TracedStep:
    """A training step captured as IR graphs, callable like the original step.

    ``graph`` is the steady-state step (all optimizer state as inputs). A step traced before its
    optimizer holds state also has a first-step graph, which creates that state; the steady
    graph is traced first, from the state the optimizer is predicted to create (``_probe``), and
    the first-step graph when it is first needed. A model with many identical blocks is traced
    through three of them and the rest are stamped (``_template``, ``_stamp``) when it lives on
    the meta device (for planning; real models are traced whole). Either shortcut
    falls back to the plain trace whenever it cannot show that its result is the same. Graphs are
    specialised on argument shapes, optimizer hyperparameters and the state's structure; a call
    that differs in any of them is traced again automatically.
    """

    def __init__(self, step_fn: Callable[..., Any]) -> None:
        if not callable(step_fn):
            raise TraceError(f"meshplan.trace expects a function, got {type(step_fn).__name__}")
        self.step_fn = step_fn
        self.inventory: Inventory = discover(step_fn)
        # the device whose torch.autocast regions tracing honours (``_autocast.py``) and the
        # mixed-precision policy it applies (``_precision.py``), whenever it traces
        self._autocast = autocast_target()
        self._precision = precision_policy()
        # graphs by what they are specialised on (``_key``), each with the guards of the values
        # it read from the arguments (``_guards``): the first whose guards hold is the call's
        self._graphs: dict[tuple, list[tuple[tuple[Guard, ...], Graph]]] = {}
        self._steady: Graph | None = None
        self._steady_spec: StateSpec | None = None
        self._first: Graph | None = None
        # traced lazily: (graph key, first-step state, predicted steady state, arguments)
        self._pending_first: tuple[tuple, StateSpec, StateSpec, _Args] | None = None
        self._part: Partial | None = None
        # hyperparameters are graph inputs (``_hyper``) unless an optimizer's update could not
        # be traced that way; then they are constants and every change traces again
        self._runtime_hyper = True
        self._repeat: Repeat | None = None
        try:
            # Only models on the meta device (planned, never run from this graph) are stamped:
            # the stamp cannot see a step that reads one block's output by index (_stamp.py),
            # and a graph that runs must be exact, so real models are always traced whole.
            on_meta = all(s.tensor.is_meta for s in self.inventory.params)
            self._repeat = find_repeat(self.inventory) if on_meta else None
            if self._repeat is not None:
                self._part = partial(self.inventory, self._repeat, TRACED_BLOCKS)
        except Exception as e:  # noqa: BLE001 - without a template the step is traced whole
            logger.debug("meshplan: no block template for %s: %s", self._name, e)
            self._repeat = self._part = None

    # ---- public ---------------------------------------------------------------------------
    @property
    def graph(self) -> Graph:
        assert self._steady is not None
        return self._steady

    @property
    def first_step_graph(self) -> Graph | None:
        """The graph for a step whose optimizer holds no state yet (None if traced later).

        Traced on first use: the steady graph is traced first, from predicted optimizer state.
        """
        if self._pending_first is not None:
            key, spec0, steady, a = self._pending_first
            self._pending_first = None
            r0 = self._trace(spec0, a)
            self._first = self._store(key, r0)
            if r0.exit != steady:    # the prediction was wrong: trace the real steady state
                logger.warning("meshplan: %s: predicted optimizer state was wrong; re-tracing "
                               "the steady step", self._name)
                self._steady = self._trace_steady(r0, a)
                self._steady_spec = r0.exit
        return self._first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        a = _Args.of(args, kwargs)
        spec = current_spec(self.inventory)
        key = self._key(spec, a)
        graph = self._lookup(key, a)
        if graph is None and self._pending_first is not None and key == self._pending_first[0]:
            self.first_step_graph        # noqa: B018 - traces it
            graph = self._lookup(key, a)
        if graph is None:
            logger.info("meshplan: re-tracing %s (new shapes, hyperparameters, state or values "
                        "read from the arguments)", self._name)
            graph = self._store(key, self._trace(spec, a))
        return self._run(graph, a)

    def __repr__(self) -> str:
        return f"TracedStep({self._name}, {len(self.graph.nodes)} nodes)"

    # ---- tracing --------------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return getattr(self.step_fn, "__qualname__", type(self.step_fn).__name__)

    def _key(self, spec: StateSpec, a: _Args) -> tuple:
        return (spec, *self._call_key(a))

    def _lookup(self, key: tuple, a: _Args) -> Graph | None:
        """The graph kept for ``key`` whose guards hold for these arguments."""
        for guards, graph in self._graphs.get(key, ()):
            if all(g.holds(a.tensors) for g in guards):
                return graph
        return None

    def _store(self, key: tuple, r: _Result) -> Graph:
        self._graphs.setdefault(key, []).append((r.guards, r.graph))
        return r.graph

    def _call_key(self, a: _Args) -> tuple:
        hyper = hyper_key(self.inventory, runtime=self._runtime_hyper)
        modes = tuple(m.training for slot in self.inventory.params for m, _ in slot.homes)
        return (hyper, a.signature(), modes)

    def call_key(self, *args: Any, **kwargs: Any) -> tuple:
        """What a steady graph is specialised on besides the state's structure: the arguments'
        shapes, dtypes and Python values, the param groups' entries (a runtime hyperparameter
        only as "non-zero"), the modules' train/eval modes, and the values the step read from
        its arguments in Python (``_guards.branch`` of the steady graph whose guards hold;
        None when no steady graph traced so far holds: ``steady_graph_for`` traces one).
        Equal keys, equal graphs."""
        a = _Args.of(args, kwargs)
        base = self._call_key(a)
        for guards, _ in self._graphs.get((self._steady_spec, *base), ()):
            if all(g.holds(a.tensors) for g in guards):
                return (*base, branch(guards))
        return (*base, None)

    def steady_graph_for(self, *args: Any, **kwargs: Any) -> Graph:
        """The steady graph (same state as ``graph``) for a call with these arguments and the
        optimizers' current param groups: ``graph`` itself when nothing it is specialised on
        changed, else traced now (and kept)."""
        a = _Args.of(args, kwargs)
        key = self._key(self._steady_spec, a)
        graph = self._lookup(key, a)
        if graph is None:
            r = self._trace(self._steady_spec, a)
            if r.exit != self._steady_spec:
                raise TraceError(
                    f"{self._name} with these arguments leaves other state than it was planned "
                    f"for ({len(r.exit.grads)} gradients and {len(r.exit.opt)} optimizer "
                    f"tensors, not {len(self._steady_spec.grads)} and "
                    f"{len(self._steady_spec.opt)})\n{describe(step_location(self.step_fn))}")
            graph = self._store(key, r)
        return graph

    @_with_trace_options
    def _prepare(self, example_args: tuple) -> None:
        a = _Args.of(example_args)
        spec0 = current_spec(self.inventory)
        guess = guess_steady_spec(self.inventory, spec0)
        tried: _Result | None = None
        if guess is not None:     # no optimizer state yet: trace the steady step directly
            tried = self._try(guess, a)
            if tried is not None and _predicted(spec0, guess, tried):
                self._steady = self._store(self._key(guess, a), tried)
                self._steady_spec = guess
                self._pending_first = (self._key(spec0, a), spec0, guess, a)
                return
        r0 = self._trace(spec0, a)
        self._store(self._key(spec0, a), r0)
        if r0.exit == spec0:
            self._steady, self._steady_spec = r0.graph, spec0
            return
        self._first = r0.graph
        self._steady = self._trace_steady(r0, a, tried)
        self._steady_spec = r0.exit

    def _trace_steady(self, r0: _Result, a: _Args, known: _Result | None = None) -> Graph:
        """The steady graph after a first step ``r0``; ``known`` may already be it."""
        r1 = known if known is not None and known.spec == r0.exit else self._trace(r0.exit, a)
        if r1.exit != r0.exit:
            raise TraceError(
                f"the optimizer state of {self._name} changes structure at every step "
                f"({len(r0.exit.opt)} then {len(r1.exit.opt)} tensors); meshplan needs a steady "
                "state: keep the optimizer's state shapes fixed between steps"
            )
        return self._store(self._key(r0.exit, a), r1)

    def _try(self, spec: StateSpec, a: _Args) -> _Result | None:
        try:
            return self._trace(spec, a)
        except Exception as e:  # noqa: BLE001 - the plain path reports real errors
            logger.debug("meshplan: tracing from predicted state failed: %s", e)
            return None

    @_with_trace_options
    def _trace(self, spec: StateSpec, a: _Args) -> _Result:
        """One graph for entry state ``spec``: through the block template when possible."""
        part, rep = self._part, self._repeat
        if part is not None and rep is not None and part.extend(part.restrict(spec)) == spec:
            try:
                return self._trace_blocks(rep, part, spec, a)
            except Exception as e:  # noqa: BLE001 - the whole trace reports real errors
                logger.info("meshplan: %s: tracing all %d blocks of %s (%s: %s)", self._name,
                            rep.n, rep.path, type(e).__name__, str(e).split("\n", 1)[0])
                self._part = self._repeat = None
        return self._trace_whole(self.inventory, spec, a)

    def _trace_blocks(self, rep: Repeat, part: Partial, spec: StateSpec, a: _Args) -> _Result:
        with truncated(rep, part.k):
            r = self._trace_whole(part.inv, part.restrict(spec), a)
        graph = verify(stamp(r.graph, rep.naming(self.inventory), part.k, rep.n))
        out = _Result(graph, spec, part.extend(r.exit), part.extend_pairs(r.stepped), r.guards)
        _check_io(out, self.inventory, a.names(self.step_fn), self._hyper_names())
        return out

    def _hyper_names(self) -> list[str]:
        inv = self.inventory
        return [h.name(inv) for h in hyper_slots(inv)] if self._runtime_hyper else []

    def _trace_whole(self, inv: Inventory, spec: StateSpec, a: _Args) -> _Result:
        fn = self.step_fn
        hyper = hyper_slots(inv) if self._runtime_hyper else ()
        try:
            with keep_schedulers(fn):
                one = trace_stage_one(fn, inv, spec, a.tensors, a.rebuild, a.names(fn), hyper)
            gm = functionalize_stage_one(one)
        except _DATA_DEPENDENT as e:
            if not hyper or exception_user_location(e) is not None:
                raise self._value_read(e) from None
            # the optimizer's update branches on a hyperparameter's value: make them constants
            logger.info("meshplan: %s: optimizer hyperparameters are constants of the graph "
                        "(%s); a change to one traces the step again", self._name,
                        str(e).split("\n", 1)[0])
            self._runtime_hyper = False
            return self._trace_whole(inv, spec, a)
        except HyperChanged as e:
            raise TraceError(
                f"{self._name} changes {e.where} while it runs (an LR scheduler or a manual "
                f"update inside the step?)\n{describe(step_location(fn))}\nmeshplan reads the "
                "optimizer's hyperparameters at every call, before the step runs: call "
                "scheduler.step() (or change the param group) between calls, outside the step"
            ) from None
        except _BadResult as e:
            raise TraceError(
                f"{self._name} returns a {e}; a step must return a tensor (the loss), a tuple "
                f"or list of tensors, a dict of tensors, or None\n{describe(step_location(fn))}"
            ) from None
        except NoOptimizerStep:
            names = ", ".join(n for n, _ in inv.optimizers)
            raise TraceError(
                f"{self._name} never calls step() on its optimizer ({names})\n"
                f"{describe(step_location(fn))}\na training step runs forward, "
                "loss.backward() and opt.step(); add the opt.step() call"
            ) from None
        except NoOptimizer:
            raise TraceError(
                f"{self._name} computes gradients, but no torch.optim optimizer is reachable "
                f"from it\n{describe(step_location(fn))}\na training step must close over its "
                "model and optimizer (a global or closure variable, not an argument) and run "
                "forward, loss.backward() and opt.step(); a step without an optimizer is an "
                "inference step and must not call backward()"
            ) from None
        except UserValueRead as e:
            raise self._value_read(e) from None
        except MeshplanError:
            raise
        except Exception as e:  # the user's code failed while being traced
            loc = exception_user_location(e)
            raise TraceError(
                f"tracing {self._name} failed: {type(e).__name__}: {e}\n{describe(loc)}\n"
                "the step must run as ordinary PyTorch on tensors of the example inputs' shapes"
            ) from e
        info = GraphInfo(
            name=self._name,
            source=step_location(fn),
            result=ResultSpec(one.result_kind, one.result_keys),
            torch_version=torch.__version__,
        )
        try:
            graph, mutated, marks = convert(gm, one.input_names, one.output_names,
                                            one.n_results, info.result, one.n_marks, info)
        except _DATA_DEPENDENT as e:
            raise self._value_read(UserValueRead(
                exception_user_location(e), "torch computes it in C++, out of the tracer's "
                "sight", shape=True)) from None
        for name, role in mutated:
            if role is Role.DATA:
                raise TraceError(
                    f"{self._name} modifies its input {name!r} in place\n"
                    f"{describe(step_location(fn))}\nclone it first (x = x.clone()) or use an "
                    "out-of-place op"
                )
        return _Result(_finish(graph, marks), spec, one.exit_spec, one.stepped, one.guards)

    def _value_read(self, e: Exception) -> TraceError:
        loc = e.loc if isinstance(e, UserValueRead) else exception_user_location(e)
        why = getattr(e, "why", "") or (
            "it is computed inside torch in a way the tracer cannot cut out")
        if getattr(e, "shape", False):
            return TraceError(
                f"{self._name} makes a tensor whose shape depends on tensor values\n"
                f"{describe(loc)}\nmeshplan specialises such a shape when only the step's "
                f"tensor arguments decide it (x[mask] with a mask made from the arguments; "
                f"traced again when it changes), but not this one: {why}. Keep shapes fixed: "
                "multiply by the mask (x * mask, or torch.where) and sum, or pass "
                "ignore_index / reduction='none' to the loss")
        return TraceError(
            f"{self._name} reads a tensor's value in Python\n{describe(loc)}\n"
            f"meshplan specialises a read of a value computed only from the step's tensor "
            f"arguments (and traces again when it changes), but not this one: {why}. "
            "Python control flow and `.item()`/`float()`/`print` on such values cannot run "
            "inside a traced step; use tensor ops (torch.where, masks) instead, or return the "
            "value and read it after the call")

    # ---- running --------------------------------------------------------------------------
    def input_values(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
        """The steady graph's inputs as the step would read them now, by input name: the
        live parameters, buffers, gradients and optimizer state, the arguments' tensors and
        the optimizers' hyperparameters."""
        return self._inputs(self.graph, _Args.of(args, kwargs))

    def data_tensors(self, *args: Any, **kwargs: Any) -> list[torch.Tensor]:
        """The tensors of the arguments in the order of the graph's data inputs."""
        return list(_Args.of(args, kwargs).tensors)

    def hyper_values(self) -> dict[str, torch.Tensor]:
        """The optimizers' runtime hyperparameters now, by graph input name (0-d float64)."""
        return hyper_values(self.inventory) if self._runtime_hyper else {}

    def pack_results(self, results: list[Any], graph: Graph | None = None) -> Any:
        """The result values of ``graph`` (default: the steady graph) shaped as the user's
        step returns them."""
        return _pack((graph or self.graph).info.result, results)

    def write_state(self, values: dict[str, torch.Tensor], *args: Any) -> None:
        """Write state values (by graph input name: parameters, buffers, gradients, optimizer
        state) into the live model and optimizer, as running the step would. ``args``: data
        arguments of the step's shape (their values are not read)."""
        inputs = self.input_values(*args)
        roles = {o.name: o.role for o in self.graph.outputs if o.kind is OutputKind.STATE}
        for name, value in values.items():
            self._write(name, roles.get(name), value, inputs)

    def _inputs(self, graph: Graph, a: _Args) -> dict[str, torch.Tensor]:
        inv = self.inventory
        vals: dict[str, torch.Tensor] = {}
        for s in inv.params:
            vals[s.name] = s.tensor.detach()
            if s.tensor.grad is not None:
                vals[f"{s.name}.grad"] = s.tensor.grad
        for s in inv.buffers:
            vals[s.name] = s.tensor
        for oname, opt in inv.optimizers:
            for p, st in opt.state.items():
                pname = inv.param_name(p)
                for k, v in st.items():
                    vals[f"{oname}.state.{pname}.{k}"] = v
        for node, t in zip(graph.inputs_with_role(Role.DATA), a.tensors):
            vals[node.target] = t
        vals.update(self.hyper_values())
        return vals

    def _run(self, graph: Graph, a: _Args) -> Any:
        inputs = self._inputs(graph, a)
        if any(t.is_meta for t in inputs.values()):
            raise TraceError(
                f"{self._name}: the model or inputs live on the meta device, so the traced "
                "step can be planned but not run; materialise the model (module.to_empty("
                "device='cpu') and initialise it) to run it"
            )
        outs = interpret(graph, inputs, device=_device_of(inputs))
        results = []
        written: set[str] = set()
        for o, value in zip(graph.outputs, outs):
            if o.kind is OutputKind.RESULT:
                results.append(value)
            else:
                self._write(o.name, o.role, value, inputs)
                written.add(o.name)
        for s in self.inventory.params:
            if f"{s.name}.grad" not in written:
                s.tensor.grad = None
        return _pack(graph.info.result, results)

    def _write(self, name: str, role: Role | None, value: torch.Tensor,
               inputs: dict[str, torch.Tensor]) -> None:
        inv = self.inventory
        old = inputs.get(name)
        if old is value:
            return
        if old is not None and role is not Role.GRAD:
            with torch.no_grad():
                old.copy_(value)
            return
        if _aliases_any(value, inputs.values()):
            value = value.clone()
        if role is Role.GRAD:
            inv.params[_index_of(inv, name.removesuffix(".grad"))].tensor.grad = value
            return
        if role is Role.OPT_STATE:
            for oname, opt in inv.optimizers:
                prefix = f"{oname}.state."
                if name.startswith(prefix):
                    pname, _, key = name[len(prefix):].rpartition(".")
                    opt.state[inv.params[_index_of(inv, pname)].tensor][key] = value
                    return
        raise TraceError(f"internal: cannot write back state {name!r}")


@dataclasses.dataclass(frozen=True)
class _Result:
    """One traced graph, the state it was traced from and the state the step leaves."""

    graph: Graph
    spec: StateSpec
    exit: StateSpec
    stepped: frozenset[tuple[int, int]]     # (optimizer, parameter) with a gradient at step()
    guards: tuple[Guard, ...] = ()          # values read from the arguments (``_guards``)


def _predicted(spec0: StateSpec, guess: StateSpec, r: _Result) -> bool:
    """Whether a first step from ``spec0`` provably leaves ``guess``: the traced step keeps the
    predicted structure, and state was predicted exactly for the parameters that have a
    gradient when their optimizer steps (those are the ones a first step creates it for)."""
    made = {(e.opt, e.param) for e in guess.opt} - {(e.opt, e.param) for e in spec0.opt}
    stateful = {(e.opt, e.param) for e in guess.opt}
    return r.exit == guess and made <= r.stepped <= stateful


def _check_io(r: _Result, inv: Inventory, data_names: list[str], hyper: list[str]) -> None:
    """A stamped graph has exactly the inputs and state outputs a whole trace would have (state
    outputs in the optimizer's own order, so compared as sets)."""
    state = ([(s.name, Role.PARAM) for s in inv.params]
             + [(f"{inv.params[i].name}.grad", Role.GRAD) for i in r.spec.grads]
             + [(s.name, Role.BUFFER) for s in inv.buffers])
    inputs = (state + [(opt_state_name(inv, e), Role.OPT_STATE) for e in r.spec.opt]
              + [(n, Role.DATA) for n in data_names] + [(n, Role.HYPER) for n in hyper])
    outputs = ([(s.name, Role.PARAM) for s in inv.params]
               + [(f"{inv.params[i].name}.grad", Role.GRAD) for i in r.exit.grads]
               + [(s.name, Role.BUFFER) for s in inv.buffers]
               + [(opt_state_name(inv, e), Role.OPT_STATE) for e in r.exit.opt])
    written = [(o.name, o.role.value) for o in r.graph.outputs_of(OutputKind.STATE)]
    if [(n.target, n.role) for n in r.graph.inputs] != inputs or sorted(written) != sorted(
        (name, role.value) for name, role in outputs
    ):
        raise NotTemplatable("the stamped graph's inputs or state outputs are not the model's")


def _index_of(inv: Inventory, pname: str) -> int:
    for i, s in enumerate(inv.params):
        if s.name == pname:
            return i
    raise TraceError(f"internal: unknown parameter {pname!r}")


def _aliases_any(t: torch.Tensor, others: Any) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(o.untyped_storage().data_ptr() == ptr for o in others)


def _device_of(inputs: dict[str, torch.Tensor]) -> torch.device | None:
    for t in inputs.values():
        return t.device
    return None


def _pack(spec: ResultSpec, results: list[Any]) -> Any:
    if spec.kind == "none":
        return None
    if spec.kind == "tensor":
        return results[0]
    if spec.kind == "dict":
        return dict(zip(spec.keys, results))
    return tuple(results) if spec.kind == "tuple" else list(results)


def _finish(graph: Graph, marks: list[Ref]) -> Graph:
    """Passes after conversion: drop identities, give gradients their role, drop dead code.

    ``marks`` are clones of each gradient taken when backward produced it; they ride along as
    trailing outputs so the identity pass rewires them like everything else, then the value
    each one cloned gets the GRAD role and the marks go away.
    """
    n_marks = len(marks)
    with_marks = Graph(graph.nodes, graph.outputs + tuple(
        Output(r, OutputKind.RESULT, "mark") for r in marks), graph.info)

    def mark_grads(g: Graph) -> Graph:
        body, marked = g.outputs[:len(g.outputs) - n_marks], g.outputs[len(g.outputs) - n_marks:]
        grads: dict[str, set[int]] = {}
        for o in marked:
            clone = g.node(o.ref.node)
            src = clone.args[0] if clone.args and isinstance(clone.args[0], Ref) else o.ref
            grads.setdefault(src.node, set()).add(src.index)
        nodes = []
        for n in g.nodes:
            hit = grads.get(n.name)
            if hit and n.kind is NodeKind.OP:
                outs = tuple(m.with_role(Role.GRAD) if i in hit and isinstance(m, TensorMeta)
                             else m for i, m in enumerate(n.outputs))
                n = dataclasses.replace(n, outputs=outs)
            nodes.append(n)
        return Graph(tuple(nodes), body, g.info)

    mark_grads.__name__ = "mark_grads"
    graph = run_passes(with_marks, (remove_identity_ops, merge_host_scalars, mark_grads,
                                    eliminate_dead_code))
    return verify(graph)
