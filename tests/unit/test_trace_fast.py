"""Fast tracing: the steady graph traced first from predicted optimizer state, and models with
many identical blocks traced through a few of them and stamped.

Both paths must give exactly what the plain path gives. Tolerance: none. A stamped graph equals
the whole trace of the same step node for node once both are named canonically
(``canonical_names``: inputs after their state, other nodes ``<op>_<i>`` in order); replaying it
is bit-equal to eager PyTorch (``torch.equal``), because it runs exactly the ops eager runs.
Where a model's blocks do not provably repeat, the step must be traced whole, and the test
checks that this happened and that the result equals the plain path. No timings are asserted:
the structural checks count how many blocks were actually traced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshplan
from meshplan.examples import gpt, llama, mlp
from meshplan.examples._common import Example, make_optimizer, seeded
from meshplan.frontend import _capture, _probe, _template, _traced
from meshplan.frontend._stamp import canonical_names
from meshplan.ir import Graph, Role, verify

TINY5 = dataclasses.replace(llama.PRESETS["tiny"], n_layer=5)


# ---- helpers -----------------------------------------------------------------------------------

@pytest.fixture
def traced_params(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Number of parameters in the inventory of every stage-one trace, in order."""
    seen: list[int] = []
    real = _traced.trace_stage_one

    def spy(step: Any, inv: Any, *rest: Any) -> Any:
        seen.append(len(inv.params))
        return real(step, inv, *rest)

    monkeypatch.setattr(_traced, "trace_stage_one", spy)
    yield seen


def _plain(step: Callable[..., Any], args: tuple, monkeypatch: pytest.MonkeyPatch,
           first: bool = True) -> meshplan.TracedStep:
    """The plain path: every block traced; with ``first``, also the first step traced before
    the steady one (without, the steady graph alone, as fast as it gets)."""
    with monkeypatch.context() as m:
        m.setattr(_template, "MIN_BLOCKS", 10**9)
        if first:
            m.setattr(_traced, "guess_steady_spec", lambda inv, spec: None)
        traced = meshplan.trace(step, *args)
        if first:
            traced.first_step_graph  # noqa: B018 - computed inside the context
        return traced


def _same_graph(stamped: Graph | None, whole: Graph | None) -> None:
    assert (stamped is None) == (whole is None)
    if stamped is not None and whole is not None:
        assert stamped.to_json() == canonical_names(whole).to_json()


def _snapshot(ex: Example) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in ex.model.parameters()],
            "opt": [{k: v.clone() if isinstance(v, Tensor) else v for k, v in st.items()}
                    for st in ex.opt.state.values()]}


def _assert_bit_equal(a: Any, b: Any) -> None:
    if isinstance(a, Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_bit_equal(a[key], b[key])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_bit_equal(x, y)
    else:
        assert a == b


# ---- stamping equals the whole trace ------------------------------------------------------------

def test_llama_blocks_are_stamped_from_three(traced_params: list[int],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5-layer LLaMA traces 3 blocks once (steady state); its graph, and the first-step graph
    traced when asked for, equal the plain path's 5-block traces node for node."""
    ex = llama.build(TINY5, device="meta")
    fast = meshplan.trace(ex.step, *ex.batch(0))
    per_block = 9
    full, three = 1 + 5 * per_block + 2, 1 + 3 * per_block + 2
    assert traced_params == [three]                          # one trace, three blocks
    first = fast.first_step_graph
    assert traced_params == [three, three]
    assert isinstance(ex.model.layers, nn.ModuleList) and len(ex.model.layers._modules) == 5

    plain = _plain(ex.step, ex.batch(0), monkeypatch)
    assert traced_params[2:] == [full, full]
    _same_graph(fast.graph, plain.graph)
    _same_graph(first, plain.first_step_graph)
    verify(fast.graph, shapes=True)
    paths = {n.module_path.split(".")[2] for n in fast.graph.nodes
             if n.module_path.startswith("model.layers.")}
    assert paths == {str(i) for i in range(5)}


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _on_meta(lambda: gpt.build("adamw", clip=1.0,
                                                    config=gpt.GPTConfig(n_layer=5))),
                 id="gpt-tied-layernorm-adamw-clip"),
    pytest.param(lambda: _on_meta(lambda: gpt.build("sgd", clip=None,
                                                    config=gpt.GPTConfig(n_layer=5, norm="rms"))),
                 id="gpt-rmsnorm-sgd-momentum"),
])
def test_gpt_blocks_are_stamped(make: Callable[[], Example], traced_params: list[int],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT (tied embedding, biases, two AdamW groups or SGD momentum) stamps exactly too."""
    ex = make()
    fast = meshplan.trace(ex.step, *ex.batch(0))
    plain = _plain(ex.step, ex.batch(0), monkeypatch, first=False)
    assert len(traced_params) == 2 and traced_params[0] < traced_params[1]
    _same_graph(fast.graph, plain.graph)


def _on_meta(build: Callable[[], Example]) -> Example:
    with torch.device("meta"):
        return build()


def test_real_models_are_traced_whole_and_replay_exactly(traced_params: list[int]) -> None:
    """A real 5-layer LLaMA is never stamped (a graph that runs must be exact; the stamp has a
    documented blind spot), and traced before its first step (steady graph first) it replays
    3 steps bit-equal to eager: losses, parameters and AdamW state."""
    eager, replayed = llama.build(TINY5), llama.build(TINY5)
    expected = [eager.step(*eager.batch(i)) for i in range(3)]
    traced = meshplan.trace(replayed.step, *replayed.batch(0))
    assert traced_params == [sum(1 for _ in replayed.model.parameters())]
    assert not replayed.opt.state
    got = [traced(*replayed.batch(i)) for i in range(3)]
    _assert_bit_equal(expected, got)
    _assert_bit_equal(_snapshot(eager), _snapshot(replayed))


def test_llama3_8b_plans_from_three_traced_blocks(traced_params: list[int]) -> None:
    """The 8B preset on the meta device: three blocks traced once, all 32 stamped; every block
    has the same nodes; AdamW state for every parameter; 8.03e9 parameters."""
    ex = llama.build(config="llama3_8b", device="meta")
    graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    assert traced_params == [1 + 3 * 9 + 2]
    assert 8.0e9 < graph.num_params() < 8.1e9
    per_block = [sum(1 for n in graph.nodes if n.module_path.startswith(f"model.layers.{i}."))
                 for i in range(32)]
    assert len(set(per_block)) == 1 and per_block[0] > 100
    assert len(graph.inputs_with_role(Role.OPT_STATE)) == 3 * len(
        graph.inputs_with_role(Role.PARAM))


# ---- blocks that do not repeat are traced whole --------------------------------------------------

class _Block(nn.Module):
    def __init__(self, d: int, scale: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.scale = scale

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.fc(x)) * self.scale


class _Toy(nn.Module):
    """Five residual blocks; ``variant`` picks how the forward walks them."""

    def __init__(self, variant: str, d: int = 8, n: int = 5) -> None:
        super().__init__()
        self.variant = variant
        scales = [1.0 if variant != "late-scale" or i < 3 else 2.0 for i in range(n)]
        self.inp = nn.Linear(d, d)      # so that the first block's input needs a gradient too
        self.layers = nn.ModuleList(_Block(d, s) for s in scales)
        self.gates = nn.ParameterList(nn.Parameter(torch.ones(())) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x)
        if self.variant == "index":
            for i in range(len(self.layers)):
                x = self.layers[i](x)
        elif self.variant == "zip":
            for layer, gate in zip(self.layers, self.gates):
                x = layer(x) * gate
        else:
            for layer in self.layers:
                x = layer(x)
        if self.variant == "depth":
            x = x / len(self.layers)
        if self.variant != "zip":
            x = x * sum(self.gates)
        return self.head(x)


def _toy(variant: str) -> Example:
    with seeded(0), torch.device("meta"):      # only models on the meta device are stamped
        model = _Toy(variant)
    opt = make_optimizer(model.parameters(), "adamw", foreach=False, lrs={"adamw": 1e-2})

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def batch(i: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    return Example(model=model, opt=opt, step=step, batch=batch)


@pytest.mark.parametrize("variant,stamped", [
    ("plain", True),
    ("depth", True),          # len(self.layers) still says 5 while 3 blocks are traced
    ("index", False),         # self.layers[i] for i >= 3 does not exist in the trace
    ("zip", False),           # each block reads its own gate from outside the blocks
    ("late-scale", False),    # blocks 3 and 4 hold a different Python attribute
])
def test_blocks_are_stamped_only_when_they_provably_repeat(
        variant: str, stamped: bool, traced_params: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    ex = _toy(variant)
    fast = meshplan.trace(ex.step, *ex.batch(0))
    n_full = 2 + 2 * 5 + 5 + 2
    assert (traced_params[-1] < n_full) is stamped
    plain = _plain(ex.step, ex.batch(0), monkeypatch, first=False)
    if stamped:
        _same_graph(fast.graph, plain.graph)
    else:
        assert fast.graph.to_json() == plain.graph.to_json()
    assert isinstance(ex.model.layers, nn.ModuleList) and len(ex.model.layers._modules) == 5
    assert all(type(b) is _Block for b in ex.model.layers)


# ---- the steady graph first ---------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    pytest.param(lambda: mlp.build("adamw", clip=1.0), id="adamw"),
    pytest.param(lambda: mlp.build("sgd"), id="sgd"),
    pytest.param(lambda: _with_opt(torch.optim.SGD, lr=0.1, momentum=0.9), id="sgd-momentum"),
    pytest.param(lambda: _with_opt(torch.optim.Adam, lr=1e-2, amsgrad=True), id="adam-amsgrad"),
    pytest.param(lambda: _with_opt(torch.optim.AdamW, lr=1e-2, maximize=True), id="adamw-max"),
])
def test_predicted_state_is_the_state_a_step_creates(make: Callable[[], Example]) -> None:
    """The optimizer state predicted before any step is exactly the state one eager step
    leaves (keys, shapes, dtypes), for every optimizer the tracer supports."""
    ex = make()
    inv = _traced.discover(ex.step)
    spec0 = _capture.current_spec(inv)
    guess = _probe.guess_steady_spec(inv, spec0)
    ex.step(*ex.batch(0))
    after = _capture.current_spec(inv)
    assert (guess or spec0).opt == after.opt


def _with_opt(cls: type[torch.optim.Optimizer], **kw: Any) -> Example:
    ex = mlp.build("sgd")
    opt = cls(ex.model.parameters(), **kw)
    model = ex.model

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return Example(model=model, opt=opt, step=step, batch=ex.batch)


def test_steady_graph_is_traced_once_and_first_step_on_demand(
        traced_params: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first step, trace() traces only the steady step; the first-step graph is
    traced when asked for (or when the step is called with no state) and both equal the plain
    path's graphs byte for byte."""
    ex = mlp.build("adamw", clip=1.0)
    fast = meshplan.trace(ex.step, *ex.batch(0))
    assert len(traced_params) == 1
    plain = _plain(ex.step, ex.batch(0), monkeypatch)
    assert fast.graph.to_json() == plain.graph.to_json()
    assert len(traced_params) == 3
    assert fast.first_step_graph is not None
    assert len(traced_params) == 4
    assert fast.first_step_graph.to_json() == plain.first_step_graph.to_json()

    called = meshplan.trace(ex.step, *ex.batch(0))
    called(*ex.batch(0))                                   # no state yet: the first-step graph
    assert len(traced_params) == 6
    assert called.first_step_graph is not None and len(traced_params) == 6


def test_unused_parameter_falls_back_to_tracing_the_first_step(
        traced_params: list[int]) -> None:
    """A parameter that never gets a gradient gets no optimizer state: the prediction (state
    for every parameter) is refused and the first step is traced to find out, as before."""
    ex = mlp.build("adamw")
    spare = nn.Parameter(torch.zeros(3))
    ex.opt.add_param_group({"params": [spare]})
    traced = meshplan.trace(ex.step, *ex.batch(0))
    names = {n.target for n in traced.graph.inputs_with_role(Role.OPT_STATE)}
    assert not any("param_groups.1" in name for name in names)
    assert len(traced_params) == 3                         # predicted, first, steady
    assert traced.first_step_graph is not None
