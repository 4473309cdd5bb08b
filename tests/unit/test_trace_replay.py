"""Replay parity: a step traced by ``meshplan.trace`` and replayed matches eager PyTorch exactly.

Tolerance: none. The traced graph executes exactly the aten ops that eager PyTorch runs, in the
same order, on the same process and shapes, so every loss and, at the end, every parameter,
buffer, gradient and optimizer-state tensor must be BIT-equal (``torch.equal``), not merely close.
A mismatch in the last bit means the graph computes something different from the user's program.

Each case builds two identical copies of an example (same seed). Copy A runs ``STEPS`` eager
steps; copy B is traced once and the ``TracedStep`` is called ``STEPS`` times, writing its new
state back into B's model and optimizer. Also covered: tracing before the first step (no
optimizer state yet) and after warm-up steps (state and step counters exist), meta-device
models, that tracing has no side effects, dict and tuple results, and tied weights.

Suite time: a GPT trace costs seconds, so each (case, warm-up) is traced once per module
(``_traced_once``): the replay test replays that trace, and the side-effect and parameter-count
checks read the snapshots taken around it and its graph. The default GPT traced for the other
unit-test files (``_traced_examples``) is the meta test's real GPT.
"""

from __future__ import annotations

import copy
import itertools
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshplan
from meshplan.examples import cnn, gpt, mlp
from meshplan.examples._common import Example

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _traced_examples import default_gpt  # noqa: E402  (one GPT trace for the unit tests)

STEPS = 4
WARMUP = 2


@dataclass(frozen=True, slots=True)
class Case:
    """One example configuration; ``build()`` returns a fresh, identically seeded copy."""

    id: str
    build: Callable[[], Example]


def _mlp_cases() -> list[Case]:
    combos = itertools.product(("sgd", "adamw"), (False, True), (None, 0.5))
    return [
        Case(f"mlp-{o}-{'foreach' if f else 'loop'}-{'clip' if c else 'noclip'}",
             lambda o=o, f=f, c=c: mlp.build(o, foreach=f, clip=c))
        for o, f, c in combos
    ]


def _gpt_cases() -> list[Case]:
    return [
        Case(f"gpt-{n}norm-adamw-{'foreach' if f else 'loop'}",
             lambda n=n, f=f: gpt.build("adamw", foreach=f, config=gpt.GPTConfig(norm=n)))
        for n, f in itertools.product(("layer", "rms"), (False, True))
    ]


CASES: list[Case] = [
    *_mlp_cases(),
    *_gpt_cases(),
    Case("cnn-sgd-momentum-loop", lambda: cnn.build("sgd", foreach=False)),
    Case("cnn-sgd-momentum-foreach", lambda: cnn.build("sgd", foreach=True)),
]
# clip_grad_norm_(foreach=True) refuses meta tensors even in eager PyTorch, so the meta cases
# keep clipping (if any) on the per-tensor path.
META_CASES: list[Case] = [
    Case("mlp-adamw-foreach", lambda: mlp.build("adamw", foreach=True)),
    Case("gpt-layernorm-adamw-clip", lambda: gpt.build("adamw", foreach=False, clip=1.0)),
    Case("cnn-sgd-momentum", lambda: cnn.build("sgd")),
]
# The real model's graph of a meta case that is already traced elsewhere: gpt.build()'s defaults
# are AdamW, per-tensor, clip 1.0, LayerNorm, and it is traced at batch(0) before any step.
_SHARED_REAL_GRAPHS: dict[str, Callable[[], Any]] = {
    "gpt-layernorm-adamw-clip": lambda: default_gpt()[1].graph,
}


def _pick(*ids: str) -> list[Case]:
    by_id = {c.id: c for c in CASES}
    return [by_id[i] for i in ids]


# One case per model family and optimizer, for the checks that need no full sweep.
FAMILY_CASES: list[Case] = _pick(
    "mlp-sgd-loop-noclip",
    "mlp-adamw-foreach-clip",
    "gpt-rmsnorm-adamw-loop",
    "cnn-sgd-momentum-loop",
)


def _params(cases: Sequence[Case]) -> list[Any]:
    return [pytest.param(c, id=c.id) for c in cases]


def _run_eager(ex: Example, start: int, n: int) -> list[Any]:
    return [ex.step(*ex.batch(i)) for i in range(start, start + n)]


def _assert_equal_tree(a: Any, b: Any, where: str) -> None:
    """Bitwise equality of nested dicts/lists/tuples of tensors and plain values."""
    if isinstance(a, Tensor):
        assert isinstance(b, Tensor), f"{where}: expected a tensor, got {type(b).__name__}"
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), (
            f"{where}: {a.dtype}{tuple(a.shape)}@{a.device} vs {b.dtype}{tuple(b.shape)}@{b.device}"
        )
        if a.device.type != "meta" and not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            pytest.fail(f"{where}: not bit-equal (max abs diff {diff:.3g})")
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{where}: expected a mapping, got {type(b).__name__}"
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            _assert_equal_tree(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{where}: {a!r:.200} vs {b!r:.200}"
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def _snapshot(ex: Example) -> dict[str, Any]:
    """Deep copies of parameters, buffers, gradients and optimizer state."""
    model = ex.model
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()},
        "grads": {
            k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()
        },
        "opt": copy.deepcopy(ex.opt.state_dict()),
    }


def _param_ids(ex: Example) -> list[list[int]]:
    """Identity of the model's parameters and of the optimizer's, per group."""
    return [[id(p) for p in ex.model.parameters()]] + [
        [id(p) for p in g["params"]] for g in ex.opt.param_groups
    ]


@dataclass(slots=True)
class Traced:
    """One copy of a case, warmed up by ``warmup`` eager steps and traced at ``batch(warmup)``,
    with deep snapshots of its state when built, just before and just after tracing.

    ``example`` and ``traced`` are handed to the one test that replays them (``_take``); the
    other tests read only the snapshots, the parameter identities and the graph."""

    example: Example
    traced: meshplan.TracedStep
    built: dict[str, Any]
    before: dict[str, Any]
    after: dict[str, Any]
    ids_before: list[list[int]]
    ids_after: list[list[int]]
    opt_state_after: bool
    taken: bool = False


_TRACED: dict[tuple[str, int], Traced] = {}


def _traced_once(case: Case, warmup: int) -> Traced:
    """The module's trace of ``(case, warmup)``: made on first use."""
    key = (case.id, warmup)
    if key not in _TRACED:
        ex = case.build()
        built = _snapshot(ex)
        _run_eager(ex, 0, warmup)
        before, ids = _snapshot(ex), _param_ids(ex)
        traced = meshplan.trace(ex.step, *ex.batch(warmup))
        _TRACED[key] = Traced(ex, traced, built, before, _snapshot(ex), ids, _param_ids(ex),
                              bool(ex.opt.state))
    return _TRACED[key]


def _take(case: Case, warmup: int) -> Traced:
    """The module's trace of ``(case, warmup)`` to replay (replaying changes the copy's
    state), or a new one if it was replayed already (a test run twice)."""
    if _traced_once(case, warmup).taken:
        del _TRACED[(case.id, warmup)]
    t = _traced_once(case, warmup)
    t.taken = True
    return t


@pytest.mark.parametrize("warmup", [0, WARMUP], ids=["fresh", f"after-{WARMUP}-steps"])
@pytest.mark.parametrize("case", _params(CASES))
def test_replay_is_bit_equal_to_eager(case: Case, warmup: int) -> None:
    """K traced calls equal K eager steps, whether traced before any step or after warm-up."""
    eager, t = case.build(), _take(case, warmup)
    replayed, traced, ids = t.example, t.traced, t.ids_before
    _assert_equal_tree(_snapshot(eager), t.built, "initial state")
    _run_eager(eager, 0, warmup)

    expected = _run_eager(eager, warmup, STEPS)
    _assert_equal_tree(t.before, t.after, f"{case.id}: state changed by tracing")
    got = [traced(*replayed.batch(i)) for i in range(warmup, warmup + STEPS)]

    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        _assert_equal_tree(e, g, f"{case.id}: loss of step {warmup + i}")
    _assert_equal_tree(_snapshot(eager), _snapshot(replayed), f"{case.id}: final state")
    assert _param_ids(replayed) == ids, "state must be written back into the same Parameter objects"


@pytest.mark.parametrize("case", _params(META_CASES))
def test_meta_model_traces_without_execution(case: Case) -> None:
    """A model built under ``torch.device("meta")`` traces to a graph of the real model's size."""
    real = case.build()
    with torch.device("meta"):
        meta = case.build()
    assert all(p.is_meta for p in meta.model.parameters())
    args = real.batch(0)

    shared = _SHARED_REAL_GRAPHS.get(case.id)
    real_graph = shared() if shared else meshplan.trace(real.step, *args).graph
    meta_graph = meshplan.trace(meta.step, *(a.to("meta") for a in args)).graph

    assert len(meta_graph.nodes) == len(real_graph.nodes)
    assert meta_graph.num_params() == real_graph.num_params()
    assert all(p.is_meta for p in meta.model.parameters())


@pytest.mark.parametrize("warmup", [0, WARMUP], ids=["fresh", f"after-{WARMUP}-steps"])
@pytest.mark.parametrize("case", _params(FAMILY_CASES))
def test_trace_has_no_side_effects(case: Case, warmup: int) -> None:
    """Tracing leaves parameters, buffers, grads and optimizer state bitwise unchanged.

    In particular, tracing before the first step must not create optimizer state. (The replay
    test checks the same for every case; this one names the property on its own. Both read the
    snapshots taken around the module's one trace of the case.)
    """
    t = _traced_once(case, warmup)
    _assert_equal_tree(t.before, t.after, f"{case.id}: state after trace")
    assert t.ids_after == t.ids_before
    if warmup == 0:
        assert not t.opt_state_after, "tracing created optimizer state"


def _dict_step(ex: Example) -> Callable[[Tensor, Tensor], dict[str, Tensor]]:
    model, opt = ex.model, ex.opt

    def step(x: Tensor, y: Tensor) -> dict[str, Tensor]:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return {"loss": loss, "grad_norm": grad_norm}

    return step


def _tuple_step(ex: Example) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    model, opt = ex.model, ex.opt

    def step(x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss, out.detach()

    return step


@pytest.mark.parametrize("make_step", [_dict_step, _tuple_step], ids=["dict", "tuple"])
def test_structured_results_replay(make_step: Callable[[Example], Callable[..., Any]]) -> None:
    """A step returning a dict or a tuple of tensors replays to the same structure, bit-equal."""
    eager, replayed = mlp.build("adamw"), mlp.build("adamw")
    eager_step, replayed_step = make_step(eager), make_step(replayed)

    expected = [eager_step(*eager.batch(i)) for i in range(STEPS)]
    traced = meshplan.trace(replayed_step, *replayed.batch(0))
    got = [traced(*replayed.batch(i)) for i in range(STEPS)]

    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        _assert_equal_tree(e, g, f"result of step {i}")
    _assert_equal_tree(_snapshot(eager), _snapshot(replayed), f"state after {STEPS} steps")


@pytest.mark.parametrize("case", _params(FAMILY_CASES))
def test_num_params_counts_each_parameter_once(case: Case) -> None:
    """``graph.num_params()`` counts elements of distinct parameters (a tied weight once)."""
    t = _traced_once(case, 0)         # the replay test's copy: its parameters keep their shapes
    assert t.traced.graph.num_params() == sum(p.numel() for p in t.example.model.parameters())


def test_tied_weight_is_one_parameter_and_stays_tied() -> None:
    """GPT's lm_head/wte tie: one graph parameter; after replay both names share one tensor."""
    ex = gpt.build()
    model = ex.model
    wte = model.transformer["wte"].weight
    assert model.lm_head.weight is wte
    with_dups = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    unique = sum(p.numel() for p in model.parameters())
    assert unique == with_dups - wte.numel()

    traced = meshplan.trace(ex.step, *ex.batch(0))
    assert traced.graph.num_params() == unique
    for i in range(2):
        traced(*ex.batch(i))
    assert model.lm_head.weight is model.transformer["wte"].weight is wte
