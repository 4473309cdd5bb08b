"""No hidden mutation remains in a traced graph: running it leaves every input untouched, and
state that the step updates (batch norm's running statistics included) leaves through explicit
outputs."""

from __future__ import annotations

import pytest
import torch

import meshplan
from meshplan.examples import cnn, gpt, mlp
from meshplan.ir import OutputKind, Role, interpret


@pytest.mark.parametrize("build", [cnn.build, lambda: mlp.build(optimizer="adamw"), gpt.build],
                         ids=["cnn", "mlp", "gpt"])
def test_interpreting_a_traced_step_mutates_no_input(build) -> None:  # noqa: ANN001
    """Inputs are compared bitwise before and after: a graph op that wrote into an input (as
    aten.native_batch_norm does to its running stats) would change one."""
    ex = build()
    ex.step(*ex.batch(0))                               # optimizer state exists
    traced = meshplan.trace(ex.step, *ex.batch(1))
    from meshplan.frontend._traced import _Args

    inputs = traced._inputs(traced.graph, _Args.of(ex.batch(1)))
    before = {k: v.clone() for k, v in inputs.items()}
    interpret(traced.graph, inputs)
    for k, v in inputs.items():
        assert torch.equal(v, before[k]), f"the graph wrote into input {k}"


def test_batch_norm_running_stats_are_explicit_state_outputs() -> None:
    ex = cnn.build()
    g = meshplan.trace(ex.step, *ex.batch(0)).graph
    inputs = {n.target: n.name for n in g.inputs_with_role(Role.BUFFER)}
    stats = [o for o in g.outputs if o.kind is OutputKind.STATE and "running_" in o.name]
    assert len(stats) == 4
    for o in stats:
        assert o.ref.node != inputs[o.name], f"{o.name} is not updated by the graph"
    assert not any(n.target == "aten.native_batch_norm.default" for n in g.nodes)
