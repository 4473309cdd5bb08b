"""Facts about the graphs ``meshplan.trace`` makes from the example training steps.

Pins down what later stages rely on: every op node has a phase; forward ops point at the user's
line and module; backward ops of a layer point at the forward call that made them; there is one
PARAM input per unique parameter (the tied GPT weight once); gradients carry the GRAD role;
optimizer state and data inputs have predictable names; no node mutates anything; the graphs
verify on meta tensors; the first-step graph exists exactly when the optimizer has no state
yet; and tracing is deterministic.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import meshplan
from meshplan.examples import cnn, gpt, mlp
from meshplan.ir import Graph, NodeKind, OutputKind, Phase, Role, TensorMeta, verify
from meshplan.ir._ops import is_mutating_op

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _traced_examples import default_gpt  # noqa: E402  (one GPT trace for the unit tests)

LINEAR_OPS = ("aten.mm.default", "aten.addmm.default")
ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class Traced:
    """A traced example and the model it closes over."""

    traced: meshplan.TracedStep
    model: nn.Module
    example: Any


def _trace(build: Callable[[], Any]) -> Traced:
    ex = build()
    return Traced(meshplan.trace(ex.step, *ex.batch(0)), ex.model, ex)


@pytest.fixture(scope="module")
def gpt_traced() -> Traced:
    """The default GPT (tied weights, AdamW in two param groups, gradient clipping), traced
    once for the unit tests (read-only here)."""
    ex, traced = default_gpt()
    return Traced(traced, ex.model, ex)


@pytest.fixture(scope="module")
def mlp_sgd() -> Traced:
    return _trace(lambda: mlp.build("sgd"))


@pytest.fixture(scope="module")
def mlp_adamw() -> Traced:
    return _trace(lambda: mlp.build("adamw", clip=1.0))


@pytest.fixture(scope="module")
def cnn_traced() -> Traced:
    return _trace(cnn.build)


@pytest.fixture(scope="module")
def all_graphs(gpt_traced: Traced, mlp_sgd: Traced, mlp_adamw: Traced,
               cnn_traced: Traced) -> dict[str, Graph]:
    out: dict[str, Graph] = {}
    for name, t in (("gpt", gpt_traced), ("mlp-sgd", mlp_sgd), ("mlp-adamw", mlp_adamw),
                    ("cnn", cnn_traced)):
        out[f"{name}/steady"] = t.traced.graph
        if t.traced.first_step_graph is not None:
            out[f"{name}/first"] = t.traced.first_step_graph
    return out


def _param_names(t: Traced) -> list[str]:
    return [n.target for n in t.traced.graph.inputs_with_role(Role.PARAM)]


# ---- phases and source locations ------------------------------------------------------------

def test_every_gpt_op_has_a_phase_in_step_order(gpt_traced: Traced) -> None:
    """OP and HOST nodes are forward, backward or update; all three occur, in that order
    (forward ops first, then backward, then clipping and the optimizer); host scalars (step
    counters) belong to the update."""
    g = gpt_traced.traced.graph
    order = {Phase.FORWARD: 0, Phase.BACKWARD: 1, Phase.UPDATE: 2}
    phases = [n.phase for n in g.nodes if n.kind in (NodeKind.OP, NodeKind.HOST)]
    assert all(isinstance(p, Phase) for p in phases)
    assert set(phases) == set(Phase)
    ranks = [order[p] for p in phases]
    assert ranks == sorted(ranks)
    assert {n.phase for n in g.nodes if n.kind is NodeKind.HOST} == {Phase.UPDATE}


def test_forward_matmuls_point_at_the_user_line_and_module(gpt_traced: Traced) -> None:
    """Forward matmuls carry a source in examples/gpt.py and a module path under ``model.``;
    the attention's QKV projection points at the ``self.c_attn(x)`` line."""
    g = gpt_traced.traced.graph
    gpt_file = Path(gpt.__file__).resolve()
    fwd = [n for n in g.nodes if n.target in LINEAR_OPS and n.phase is Phase.FORWARD]
    assert len(fwd) == 4 * gpt_traced.example.model.cfg.n_layer + 1   # 4 per block + lm_head
    for n in fwd:
        assert n.source is not None, n.name
        assert Path(n.source.file).resolve() == gpt_file
        assert n.source.file.endswith("examples/gpt.py")
        assert n.module_path.startswith("model."), n.module_path
    attn = [n for n in fwd if n.module_path.endswith("attn.c_attn")]
    assert [n.module_path for n in attn] == [f"model.transformer.h.{i}.attn.c_attn"
                                            for i in range(gpt_traced.example.model.cfg.n_layer)]
    assert all("self.c_attn(x)" in n.source.code for n in attn)
    assert all(n.source.function == "forward" for n in attn)


def test_backward_of_a_linear_layer_points_at_its_forward_call(gpt_traced: Traced) -> None:
    """For every linear layer, its backward nodes (two matmuls at least) carry exactly the
    file:line of the forward call, so a planner message about a gradient names the user's
    line."""
    g = gpt_traced.traced.graph
    layers = {n.module_path for n in g.nodes if n.target in LINEAR_OPS and n.phase is Phase.FORWARD}
    assert "model.lm_head" in layers
    for m in sorted(layers):
        def where(phase: Phase) -> set[tuple[str, int]]:
            return {(n.source.file, n.source.line) for n in g.nodes
                    if n.module_path == m and n.phase is phase and n.kind is NodeKind.OP
                    and n.source is not None}

        fwd, bwd = where(Phase.FORWARD), where(Phase.BACKWARD)
        assert len(fwd) == 1, (m, fwd)
        assert bwd == fwd, (m, fwd, bwd)
        n_mm = sum(1 for n in g.nodes if n.module_path == m and n.phase is Phase.BACKWARD
                   and n.target == "aten.mm.default")
        assert n_mm >= 2, m


# ---- inputs and roles -----------------------------------------------------------------------

def test_one_param_input_per_unique_parameter(gpt_traced: Traced) -> None:
    """The tied lm_head/wte weight is ONE input (named by its first path); ``num_params``
    counts every parameter element once; the lm_head matmul reads that same input."""
    g, model = gpt_traced.traced.graph, gpt_traced.model
    params = g.inputs_with_role(Role.PARAM)
    targets = [n.target for n in params]
    assert len(targets) == len(set(targets)) == len(list(model.parameters()))
    assert "model.transformer.wte.weight" in targets
    assert "model.lm_head.weight" not in targets
    assert g.num_params() == sum(p.numel() for p in model.parameters())
    named = dict(model.named_parameters())
    for n in params:
        assert n.meta.shape == tuple(named[n.target.removeprefix("model.")].shape)
    t_lm = [n for n in g.nodes if n.module_path == "model.lm_head"
            and n.phase is Phase.FORWARD and n.target == "aten.t.default"]
    assert [n.args[0].node for n in t_lm] == ["p_model_transformer_wte_weight"]


@pytest.mark.parametrize("which", ["mlp_sgd", "mlp_adamw"])
def test_mlp_has_one_grad_value_per_parameter(which: str, request: pytest.FixtureRequest) -> None:
    """Exactly one value per parameter carries the GRAD role, with that parameter's shape."""
    t: Traced = request.getfixturevalue(which)
    g = t.traced.graph
    grads = [m for n in g.nodes for m in n.outputs
             if isinstance(m, TensorMeta) and m.role is Role.GRAD]
    shapes = collections.Counter(m.shape for m in grads)
    assert len(grads) == len(list(t.model.parameters()))
    assert shapes == collections.Counter(tuple(p.shape) for p in t.model.parameters())


def test_adamw_state_input_names(mlp_adamw: Traced, gpt_traced: Traced) -> None:
    """AdamW state inputs are ``<optimizer variable>.state.<param>.exp_avg|exp_avg_sq|step``,
    one of each per parameter."""
    for t in (mlp_adamw, gpt_traced):
        state = {n.target for n in t.traced.graph.inputs_with_role(Role.OPT_STATE)}
        expected = {f"opt.state.{p}.{k}" for p in _param_names(t) for k in ADAMW_KEYS}
        assert state == expected


def test_data_inputs_are_named_after_step_parameters(all_graphs: dict[str, Graph]) -> None:
    """The step's tensor arguments become DATA inputs named ``x`` and ``y``, in order."""
    for name, g in all_graphs.items():
        assert [n.target for n in g.inputs_with_role(Role.DATA)] == ["x", "y"], name


def test_inputs_have_state_or_data_roles_and_unique_targets(all_graphs: dict[str, Graph]) -> None:
    """Every input is a param, grad, optimizer state, buffer, data or hyperparameter, named
    once; the CNN's BatchNorm buffers are BUFFER inputs and get new values as STATE outputs."""
    allowed = {Role.PARAM, Role.GRAD, Role.OPT_STATE, Role.BUFFER, Role.DATA, Role.HYPER}
    for name, g in all_graphs.items():
        assert {n.role for n in g.inputs} <= allowed, name
        targets = [n.target for n in g.inputs]
        assert len(targets) == len(set(targets)), name
    cnn_g = all_graphs["cnn/steady"]
    buffers = {n.target for n in cnn_g.inputs_with_role(Role.BUFFER)}
    assert "model.features.1.running_mean" in buffers
    written = {o.name for o in cnn_g.outputs_of(OutputKind.STATE) if o.role is Role.BUFFER}
    assert written == buffers


# ---- purity and validity ----------------------------------------------------------------------

def test_no_mutating_ops(all_graphs: dict[str, Graph]) -> None:
    """The IR is functional: no in-place or out= op survives tracing."""
    for name, g in all_graphs.items():
        bad = [n.target for n in g.nodes if n.kind is NodeKind.OP and is_mutating_op(n.target)]
        assert bad == [], (name, bad)


def test_traced_graphs_verify_with_shapes(all_graphs: dict[str, Graph]) -> None:
    """Structural checks and a meta-tensor re-run agree with the recorded metadata."""
    assert set(all_graphs) >= {"gpt/steady", "gpt/first", "mlp-sgd/steady", "cnn/steady"}
    for g in all_graphs.values():
        verify(g, shapes=True)


# ---- first-step graph and determinism --------------------------------------------------------

def test_first_step_graph_only_before_the_first_step(mlp_adamw: Traced) -> None:
    """Traced before any step, AdamW has no state yet: the first-step graph creates it (state
    outputs without inputs). After eager steps the state exists and there is none."""
    first = mlp_adamw.traced.first_step_graph
    assert first is not None
    assert first.inputs_with_role(Role.OPT_STATE) == ()
    created = {o.name for o in first.outputs_of(OutputKind.STATE) if o.role is Role.OPT_STATE}
    steady = {n.target for n in mlp_adamw.traced.graph.inputs_with_role(Role.OPT_STATE)}
    assert created == steady

    ex = mlp.build("adamw", clip=1.0)
    for i in range(2):
        ex.step(*ex.batch(i))
    later = meshplan.trace(ex.step, *ex.batch(2))
    assert later.first_step_graph is None
    assert later.graph.to_json() == mlp_adamw.traced.graph.to_json()


def test_tracing_is_deterministic(mlp_adamw: Traced) -> None:
    """Tracing the same step again gives byte-identical JSON, first-step graph included."""
    ex = mlp_adamw.example
    again = meshplan.trace(ex.step, *ex.batch(0))
    assert again.graph.to_json() == mlp_adamw.traced.graph.to_json()
    assert again.first_step_graph is not None and mlp_adamw.traced.first_step_graph is not None
    assert again.first_step_graph.to_json() == mlp_adamw.traced.first_step_graph.to_json()
