"""The kernel registry: registration rules, the off switch, and matches on traced steps.

The GPT example (AdamW, LayerNorm, GELU, tied embeddings, cross-entropy) is traced once; each
expected pattern is counted from the model's structure (2 layers: 5 LayerNorms, 2 MLP GELUs,
28 parameters), not from the matcher's own output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan import kernels
from meshplan.examples import gpt
from meshplan.ir import NodeKind, Ref, Role, split_foreach
from meshplan.kernels import Backend, Device, KernelError, KernelSpec, Match

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _traced_examples import default_gpt  # noqa: E402  (one GPT trace for the unit tests)


@pytest.fixture(scope="module")
def gpt_graph():
    ex, traced = default_gpt()             # gpt.build() at batch(0), shared with other files
    _OPTIMIZERS[id(traced.graph)] = ex.opt
    return traced.graph


@pytest.fixture(scope="module")
def sgd_rms_graph():
    ex = gpt.build(optimizer="sgd", config=gpt.GPTConfig(norm="rms", n_layer=1))
    return _traced(ex.step, ex.opt, *ex.batch(0))


@pytest.fixture(scope="module")
def swiglu_graph():
    torch.manual_seed(0)
    gate, up, out = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 5)
    params = [*gate.parameters(), *up.parameters(), *out.parameters()]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)

    def step(x, y):
        loss = F.cross_entropy(out(F.silu(gate(x)) * up(x)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return _traced(step, opt, torch.randn(4, 8), torch.randint(0, 5, (4,)))


def _by_kernel(matches: list[Match]) -> dict[str, list[Match]]:
    out: dict[str, list[Match]] = {}
    for m in matches:
        out.setdefault(m.kernel, []).append(m)
    return out


def _spec(name: str) -> KernelSpec:
    return KernelSpec(name=name, backend=Backend.TORCH, devices=frozenset({Device.CPU}),
                      dtypes=frozenset({"float32"}), targets=frozenset({"aten.mm.default"}),
                      matcher=_match_mm, entry="._flatten_torch:flatten_into_torch")


def _match_mm(graph) -> list[Match]:
    return [Match("test_mm", n.name, (n.name,), (("a", n.args[0]), ("b", n.args[1])))
            for n in graph.nodes if n.target == "aten.mm.default"]


def test_registering_a_name_twice_is_an_error(gpt_graph) -> None:
    kernels.register_kernel(_spec("test_mm"))
    try:
        with pytest.raises(KernelError, match="already registered"):
            kernels.register_kernel(_spec("test_mm"))
        found = [m for m in kernels.find_kernels(gpt_graph, "cpu") if m.kernel == "test_mm"]
        mm_nodes = [n for n in gpt_graph.nodes if n.target == "aten.mm.default"]
        assert [m.anchor for m in found] == [n.name for n in mm_nodes]
        assert kernels.load_kernel("test_mm") is kernels.flatten_into_torch
    finally:
        kernels.unregister_kernel("test_mm")
    with pytest.raises(KernelError, match="no kernel named"):
        kernels.get_kernel("test_mm")
    with pytest.raises(KernelError, match="already registered"):
        kernels.register_kernel(kernels.get_kernel("adamw"))


def test_spec_validation() -> None:
    with pytest.raises(KernelError, match="identifier"):
        _spec("not a name")
    with pytest.raises(KernelError, match="devices"):
        KernelSpec(name="x", backend=Backend.TORCH, devices=frozenset(), dtypes=frozenset(),
                   targets=frozenset(), matcher=_match_mm, entry="._numba:flatten_into")


def test_off_switch_by_function_and_environment(gpt_graph, monkeypatch) -> None:
    assert kernels.find_kernels(gpt_graph, "cuda", check_available=False)
    with kernels.kernels_disabled():
        assert not kernels.kernels_enabled()
        assert kernels.find_kernels(gpt_graph, "cuda", check_available=False) == []
    assert kernels.kernels_enabled()
    monkeypatch.setenv("MESHPLAN_KERNELS", "off")
    assert kernels.find_kernels(gpt_graph, "cpu") == []
    kernels.set_kernels_enabled(True)       # the function overrides the environment
    try:
        assert kernels.find_kernels(gpt_graph, "cpu")
    finally:
        kernels.set_kernels_enabled(None)
    assert not kernels.kernels_enabled()


def test_gpt_matches_adamw_layer_norm_gelu_and_cross_entropy(gpt_graph) -> None:
    found = _by_kernel(kernels.find_kernels(gpt_graph, "cuda", {"float32"},
                                            check_available=False))
    params = gpt_graph.inputs_with_role(Role.PARAM)
    assert sorted(m.operand("param").node for m in found["adamw"]) == sorted(p.name for p in params)
    state_outputs = {o.ref for o in gpt_graph.outputs}
    for m in found["adamw"]:
        assert {m.result(k) for k in ("param", "exp_avg", "exp_avg_sq")} <= state_outputs
        # hyperparameters are graph inputs: the kernels read them when they run
        assert m.attr("beta1") is None and _at_run(gpt_graph, m.attr("lerp_weight")) == 1 - 0.9
        assert _at_run(gpt_graph, m.attr("eps")) == 1e-8
    decays = sorted({round(_at_run(gpt_graph, m.attr("decay")), 6) for m in found["adamw"]})
    assert decays == [0.9997, 1.0]  # lr 3e-3 * wd 0.1 on matrices, no decay elsewhere
    # one scalar per param group, not one per parameter: the updates batch into one launch
    assert len({m.attr("decay") for m in found["adamw"]}) == 2

    layer_norms = [n for n in gpt_graph.nodes if n.target == "aten.native_layer_norm.default"]
    assert [m.anchor for m in found["layer_norm"]] == [n.name for n in layer_norms]
    assert all(m.nodes == (m.anchor,) for m in found["layer_norm"])     # the forward alone
    backward = found["layer_norm_backward"]             # one per forward, reading its stats
    assert sorted(m.operand("mean").node for m in backward) == sorted(n.name for n in layer_norms)
    assert all(m.operand("rstd") == Ref(m.operand("mean").node, 2) for m in backward)
    assert all(gpt_graph.node(m.anchor).target == "aten.native_layer_norm_backward.default"
               for m in backward)
    # offered for fp32 only: in fp16 / bf16 the Triton LayerNorm was slower than aten's (H200)
    assert kernels.get_kernel("layer_norm").dtypes == {"float32"}
    assert kernels.get_kernel("layer_norm_backward").dtypes == {"float32"}

    assert len(found["bias_gelu"]) == 2
    for m in found["bias_gelu"]:
        bias = gpt_graph.node(m.operand("bias").node)
        assert bias.kind is NodeKind.INPUT and bias.target.endswith("mlp.c_fc.bias")
        assert any(gpt_graph.node(n).target == "aten.gelu_backward.default" for n in m.nodes)

    (xent,) = found["cross_entropy"]
    assert gpt_graph.node(xent.anchor).target == "aten.nll_loss_forward.default"
    assert xent.attr("ignore_index") == -100 and len(xent.nodes) == 2   # the forward alone
    (xent_b,) = found["cross_entropy_backward"]     # reads the forward's lse in its slot
    assert xent_b.operand("lse") == xent.result("lse") and xent.private == xent_b.private
    assert xent_b.operand("logits") == xent.operand("logits")
    assert {gpt_graph.node(n).target for n in xent_b.nodes} == {
        "aten.nll_loss_backward.default", "aten._log_softmax_backward_data.default"}
    assert "swiglu" not in found and "grad_buckets" not in found  # numba is CPU-only


def test_grad_buckets_lists_raw_gradients_in_backward_order(gpt_graph) -> None:
    matches = _by_kernel(kernels.find_kernels(gpt_graph, "cpu"))
    (numba_match,) = matches["grad_buckets"]
    (torch_match,) = matches["grad_buckets_torch"]
    assert numba_match.operands == torch_match.operands
    params = gpt_graph.inputs_with_role(Role.PARAM)
    assert len(numba_match.operands) == len(params)
    position = {n.name: i for i, n in enumerate(gpt_graph.nodes)}
    order = [position[ref.node] for _, ref in numba_match.operands]
    assert order == sorted(order, reverse=True)
    for _, ref in numba_match.operands:  # before clipping: produced by backward, not update
        assert gpt_graph.node(ref.node).phase.value == "backward"
    sizes = numba_match.attr("sizes_bytes")
    assert sum(sizes) == sum(p.meta.nbytes for p in params)
    buckets = kernels.plan_buckets(sizes, numba_match.attr("dtypes"), 16 << 10)
    assert sum(len(b.indices) for b in buckets) == len(params)


def test_sgd_and_rms_norm_on_gpt(sgd_rms_graph) -> None:
    found = _by_kernel(kernels.find_kernels(sgd_rms_graph, "cuda", check_available=False))
    params = sgd_rms_graph.inputs_with_role(Role.PARAM)
    assert len(found["sgd"]) == len(params)
    assert all(-_at_run(sgd_rms_graph, m.attr("neg_lr")) == pytest.approx(0.1)
               for m in found["sgd"])
    # ln_1, ln_2 and ln_f: three RMSNorms, each scaled by its weight.
    assert len(found["rms_norm"]) == 3
    assert all(sgd_rms_graph.node(m.operand("weight").node).role is Role.PARAM
               for m in found["rms_norm"])
    for m in found["rms_norm"]:    # what aten's backward reads of the forward is returned
        assert sgd_rms_graph.node(m.result("rstd").node).target == "aten.rsqrt.default"
        assert m.result("normed").node in m.nodes and m.result("out").node == m.anchor
    assert "layer_norm" not in found


def test_swiglu_and_foreach_sgd_momentum_on_a_small_step(swiglu_graph) -> None:
    with pytest.raises(KernelError, match="split_foreach"):
        kernels.find_kernels(swiglu_graph, "cuda", check_available=False)
    opt = _OPTIMIZERS[id(swiglu_graph)]
    swiglu_graph = split_foreach(swiglu_graph)
    _OPTIMIZERS[id(swiglu_graph)] = opt
    found = _by_kernel(kernels.find_kernels(swiglu_graph, "cuda", check_available=False))
    (sw,) = found["swiglu"]            # the forward alone, handing its backward the silu slot
    assert swiglu_graph.node(sw.operand("gate").node).target == "aten.addmm.default"
    assert {swiglu_graph.node(n).target for n in sw.nodes} == {"aten.silu.default",
                                                                "aten.mul.Tensor"}
    (bw,) = found["swiglu_backward"]
    assert bw.operand("silu") == sw.result("silu") and sw.private == bw.private == ("silu",)
    assert (bw.operand("gate"), bw.operand("up")) == (sw.operand("gate"), sw.operand("up"))
    targets = [swiglu_graph.node(n).target for n in bw.nodes]
    assert sorted(targets) == ["aten.mul.Tensor", "aten.mul.Tensor", "aten.silu_backward.default"]
    assert len(found["sgd"]) == 6
    for m in found["sgd"]:
        assert _at_run(swiglu_graph, m.attr("momentum")) == pytest.approx(0.9)
        buf = swiglu_graph.node(m.operand("momentum_buffer").node)
        assert buf.role is Role.OPT_STATE
        assert isinstance(m.result("momentum_buffer"), Ref)


def test_foreach_adamw_matches_like_single_tensor_adamw(gpt_graph) -> None:
    ex = gpt.build(foreach=True)
    graph = split_foreach(_traced(ex.step, ex.opt, *ex.batch(0)))
    _OPTIMIZERS[id(graph)] = ex.opt
    split = _by_kernel(kernels.find_kernels(graph, "cuda", check_available=False))
    single = _by_kernel(kernels.find_kernels(gpt_graph, "cuda", check_available=False))
    assert {k: len(v) for k, v in split.items()} == {k: len(v) for k, v in single.items()}

    def values(g, matches):
        return sorted(tuple((k, float(_at_run(g, v)) if v is not None else None)
                            for k, v in m.attrs) for m in matches)

    assert values(graph, split["adamw"]) == values(gpt_graph, single["adamw"])


def test_dtype_and_device_filters(gpt_graph) -> None:
    assert kernels.find_kernels(gpt_graph, "cuda", {"bfloat16"}, check_available=False) == []
    with pytest.raises(KernelError, match="unknown device"):
        kernels.find_kernels(gpt_graph, "tpu")
    if not torch.cuda.is_available():  # only the torch fallback runs on a device we lack
        assert {m.kernel for m in kernels.find_kernels(gpt_graph, "cuda")} <= {"grad_buckets_torch"}


def test_importing_the_package_does_not_import_triton() -> None:
    import subprocess
    import sys

    code = ("import sys, meshplan.kernels as k; k.find_kernels; "
            "print('triton' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def _at_run(graph, x):
    """The value a kernel attribute has when the step runs: a constant, or the host scalar
    computed from hyperparameter inputs (``opt.param_groups.<g>.<key>[.<i>]``), read from the
    optimizer the graph was traced with."""
    from meshplan.ir._ops import resolve
    if not isinstance(x, Ref):
        return x
    node = graph.node(x.node)
    if node.kind is NodeKind.INPUT:
        assert node.meta.role is Role.HYPER, node
        parts = node.target.split(".")
        at = parts.index("param_groups")
        value = _OPTIMIZERS[id(graph)].param_groups[int(parts[at + 1])][parts[at + 2]]
        return torch.tensor(value if at + 3 == len(parts) else value[int(parts[at + 3])],
                            dtype=torch.float64)
    return resolve(node)(*[_at_run(graph, a) for a in node.args], **dict(node.kwargs))


_OPTIMIZERS: dict[int, torch.optim.Optimizer] = {}     # id(graph) -> its traced optimizer


def _traced(ex_step, opt, *args):
    graph = meshplan.trace(ex_step, *args).graph
    _OPTIMIZERS[id(graph)] = opt
    return graph
