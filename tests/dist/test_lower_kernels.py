"""Kernel substitution in the lowering (``backends/_kernels.py``): programs with kernels against
the same programs without, on a thread mesh (and on a GPU when one is present, also against
eager PyTorch there).

Tolerances: the torch foreach kernels run the graph's own ops in the graph's order, in place, so
their steps must be bit-identical to the op-by-op program. The numba AdamW computes the same
formula in one pass (a multiplication by 1/bias_correction2 where torch divides, FMA-free
float32), a few ulps per step apart: losses are compared with rtol 1e-5 / atol 1e-6, state with
rtol 1e-5 / atol 1e-5 after 3 steps (measured differences <= 3e-6; where the true gradient is ~0,
attention's key bias, AdamW's m / sqrt(v) divides rounding noise by rounding noise, the reason
test_distribute.py gives parameters atol 1e-5; a wrong update is off by ~lr = 1e-3..3e-3). The
Triton kernels (GPU) compute in fp32 with their own operation order: rtol 1e-4 / atol 1e-5.
On a GPU the programs are also compared with eager PyTorch on CUDA, the example's own step
(fp32 with TF32 off; tolerances and their reasons at ``EAGER_TOLERANCE``), and on the CPU one
case with eager PyTorch on the CPU, so that reference is exercised where CI runs.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch

import meshplan
from meshplan import kernels
from meshplan.backends import ThreadMesh
from meshplan.backends._kernels import KernelCall, kernel_summary, substitute
from meshplan.backends._lower import Reshard, lower, plan_steps, run, split_inputs
from meshplan.examples import gpt, mlp
from meshplan.planner import Replicate, plan_graph

CPU_OPTIMIZER_KERNELS = ("adamw_cpu", "adamw_foreach", "sgd_foreach")


# The GPTs with sequences of 4 tokens (the default's 16): the tests count which ops the
# kernels replace (per layer and norm, independent of the sequence length) and compare steps
# with the op-by-op programs; the Triton interpreter runs one program per row, so 4x fewer
# rows make the interpreted-kernel tests ~4x cheaper. The batch stays 4 (2 rows of sequences
# per rank on dp=2, no size-1 dims), the heads and widths as in the default.
_SHORT = 4
_BUILD = {"gpt": lambda: gpt.build(optimizer="adamw", clip=1.0,
                                   config=gpt.GPTConfig(seq_len=_SHORT)),
          "gpt-rms": lambda: gpt.build(optimizer="adamw", clip=1.0,
                                       config=gpt.GPTConfig(norm="rms", seq_len=_SHORT)),
          "gpt-swiglu": lambda: gpt.build(optimizer="adamw", clip=1.0,
                                          config=gpt.GPTConfig(activation="swiglu",
                                                               seq_len=_SHORT)),
          "mlp-sgd": lambda: mlp.build(optimizer="sgd", clip=1.0),
          "mlp": lambda: mlp.build(optimizer="adamw")}


@lru_cache(maxsize=None)
def _example(name: str):
    ex = _BUILD[name]()
    ex.step(*ex.batch(0))            # optimizer state exists: the steady-state graph
    return ex, meshplan.trace(ex.step, *ex.batch(1))


class _only:
    """Leave exactly one of the CPU optimizer kernels registered (the others compete for the
    same nodes)."""

    def __init__(self, keep: str | None) -> None:
        self.keep = keep
        self.removed: list = []

    def __enter__(self) -> None:
        for name in CPU_OPTIMIZER_KERNELS:
            if name != self.keep:
                self.removed.append(kernels.unregister_kernel(name))

    def __exit__(self, *exc) -> None:
        for spec in self.removed:
            kernels.register_kernel(spec)
        order = [s.name for s in kernels.registered_kernels()]
        assert set(CPU_OPTIMIZER_KERNELS) <= set(order)


@lru_cache(maxsize=None)
def _plan(name: str, axes: tuple[tuple[str, int], ...], strategy: str):
    """The plan of ``name`` on ``axes`` (items of the mesh dict) under ``strategy``, once per
    module: plans are immutable and the same inputs give the same plan."""
    return plan_graph(_example(name)[1].graph, dict(axes), topology="h100", strategy=strategy)


def _run_steps(name: str, axes: dict[str, int], strategy: str, *, use_kernels: bool,
               device: str = "cpu", steps: int = 3, keep: str | None = None):
    ex, traced = _example(name)
    graph = traced.graph
    plan = _plan(name, tuple(axes.items()), strategy)
    world = int(torch.tensor(plan.mesh.sizes).prod())
    with _only(keep):
        programs = [lower(plan, r, device=device, kernels=use_kernels) for r in range(world)]
    values = traced.input_values(*ex.batch(1))
    state_names = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    data_names = [n.target for n in graph.inputs if n.meta.role.value == "data"]
    state = [{k: v.to(device) for k, v in split_inputs(
        plan, r, {k: values[k].clone() for k in state_names}).items()} for r in range(world)]
    mesh = ThreadMesh(world, timeout_s=120)
    losses = []
    for i in range(steps):
        batch = {k: v.to(device) for k, v in zip(data_names, ex.batch(i + 2))}

        def one(comm, batch=batch):
            r = comm.rank
            return run(programs[r], comm, state[r], split_inputs(plan, r, batch))

        got = mesh.run(one)
        for r in range(world):
            state[r] = {**state[r], **got[r][1]}
        losses.append(got[0][0][0].cpu())
    return programs, losses, state


@lru_cache(maxsize=None)
def _op_by_op(name: str, axes: tuple[tuple[str, int], ...], strategy: str, steps: int):
    """``_run_steps`` without kernels on the CPU (the op-by-op programs the kernel tests compare
    with): its losses and final state, run once per module for each case and read-only to the
    tests that share it (the foreach, numba and interpreted-kernel tests of one case)."""
    _, losses, state = _run_steps(name, dict(axes), strategy, use_kernels=False, steps=steps)
    return losses, state


CASES = [("gpt", {"dp": 2}, "dp"), ("gpt", {"dp": 2}, "fsdp"),
         ("gpt", {"dp": 2, "tp": 2}, "megatron_tp"), ("mlp-sgd", {"dp": 2}, "dp"),
         ("mlp-sgd", {"dp": 2, "tp": 2}, "fsdp")]
_ids = lambda v: v if isinstance(v, str) else ",".join(f"{k}{n}" for k, n in v.items())  # noqa: E731


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "axes", "strategy"), CASES, ids=_ids)
def test_foreach_kernels_give_the_programs_steps_bit_for_bit(name, axes, strategy) -> None:
    """AdamW / SGD become one in-place foreach call per parameter group on every rank (28
    AdamW updates of the GPT in 2 calls, one per weight-decay group), and the steps do not
    change by a bit."""
    keep = "adamw_foreach" if name == "gpt" else "sgd_foreach"
    progs, losses, state = _run_steps(name, axes, strategy, use_kernels=True, keep=keep)
    want_losses, want_state = _op_by_op(name, tuple(axes.items()), strategy, 3)
    params = sum(n.meta.role.value == "param" for n in _example(name)[1].graph.inputs)
    for prog in progs:
        calls = [i for i in prog.instructions if isinstance(i, KernelCall)]
        assert {c.kernel for c in calls} == {keep}
        assert len(calls) == (2 if name == "gpt" else 1)          # weight-decay groups
        assert sum(len(c.anchors) for c in calls) == params         # every parameter's update
    assert all(torch.equal(a, b) for a, b in zip(losses, want_losses))
    for got, want in zip(state, want_state):
        assert got.keys() == want.keys()
        for k in want:
            assert torch.equal(got[k], want[k]), k


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "axes", "strategy"), CASES[:3], ids=_ids)
def test_numba_adamw_matches_the_op_chain(name, axes, strategy) -> None:
    pytest.importorskip("numba")
    progs, losses, state = _run_steps(name, axes, strategy, use_kernels=True, keep="adamw_cpu")
    want_losses, want_state = _op_by_op(name, tuple(axes.items()), strategy, 3)
    assert [k for k, *_ in kernel_summary(progs[0].instructions)] == ["adamw_cpu"]
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(state, want_state):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


class _on_cpu:
    """Offer the GPU-only kernels ``names`` for the CPU too, where Triton runs them in its
    interpreter (``TRITON_INTERPRET=1``, set by conftest without a GPU): the lowering's
    substitution and the kernels then run end to end in a CPU program. The interpreter patches
    ``triton.language`` while a kernel runs, so the thread mesh's ranks take turns through a
    lock (none of these kernels waits for another rank)."""

    def __init__(self, *names: str) -> None:
        self.names = names
        self.saved: list = []
        self.adapters: dict = {}

    def __enter__(self) -> None:
        import dataclasses
        import threading

        from meshplan.kernels import Device
        from meshplan.kernels._apply import ADAPTERS
        lock = threading.Lock()
        for name in self.names:
            spec = kernels.unregister_kernel(name)
            self.saved.append(spec)
            kernels.register_kernel(dataclasses.replace(spec, devices=frozenset({Device.CPU})))
            self.adapters[name] = adapter = ADAPTERS[name]

            def one_at_a_time(ops, attrs, adapter=adapter):
                with lock:
                    return adapter(ops, attrs)

            ADAPTERS[name] = one_at_a_time

    def __exit__(self, *exc) -> None:
        from meshplan.kernels._apply import ADAPTERS
        ADAPTERS.update(self.adapters)
        for spec in self.saved:
            kernels.unregister_kernel(spec.name)
            kernels.register_kernel(spec)


def _interpreted(name: str, axes: dict[str, int], strategy: str,
                 *names: str) -> list[tuple[dict[str, tuple[int, int]], set[str]]]:
    """Run ``name``'s lowered programs 2 steps with the GPU kernels ``names`` offered for the
    CPU (the Triton interpreter), check losses and state against the op-by-op programs, and
    return each rank's ``({kernel: (calls, replaced nodes)}, aten targets left)``. 2 steps, not
    more: the interpreter takes seconds a step. Tolerance: the kernels reduce in their own
    order (fp32), so losses get rtol 1e-5 / atol 1e-6 and state rtol 1e-5 / atol 1e-5, as for
    the numba AdamW above; a wrong normalisation, loss or gradient is off by O(1)."""
    from meshplan.kernels._common import interpreting

    pytest.importorskip("triton")
    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (a CPU-only process)")
    with _on_cpu(*names):
        progs, losses, state = _run_steps(name, axes, strategy, use_kernels=True,
                                          keep="adamw_foreach", steps=2)
    want_losses, want_state = _op_by_op(name, tuple(axes.items()), strategy, 2)
    torch.testing.assert_close(losses, want_losses, rtol=1e-5, atol=1e-6)
    for got, want in zip(state, want_state):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
    return [({k: (calls, replaced) for k, calls, _, replaced in kernel_summary(p.instructions)},
             {i.node.target for i in p.instructions if hasattr(i, "node")}) for p in progs]


@pytest.mark.timeout(300)
def test_layer_norm_kernels_replace_forward_and_backward() -> None:
    """The GPT's 5 LayerNorms under FSDP on dp=2 (weights gathered for the op, their
    gradients reduce-scattered): each forward and each backward becomes its own Triton call
    (the forward's mean and rstd are the saved values the backward call reads) on every rank,
    and 2 steps match the op-by-op program (a Megatron dp=2 x tp=2 run took 46 s for 3 steps
    and passed as well)."""
    for summary, ops in _interpreted("gpt", {"dp": 2}, "fsdp", "layer_norm",
                                     "layer_norm_backward"):
        assert summary["layer_norm"] == (5, 5) and summary["layer_norm_backward"] == (5, 5)
        assert not ops & {"aten.native_layer_norm.default",
                          "aten.native_layer_norm_backward.default"}


@pytest.mark.timeout(300)
def test_rms_norm_kernels_replace_the_decomposed_forward_and_backward() -> None:
    """The RMSNorm GPT's 5 norms under FSDP on dp=2: each decomposed forward (pow, mean, add,
    rsqrt, mul, mul by the weight) becomes one Triton call returning the output, the rstd and
    the normalised values that aten's weight-gradient ops read; each input gradient (13 nodes,
    14 where the block adds it to the residual stream's gradient, which the kernel adds in its
    pass) another, reading the saved rstd. 2 steps match the op-by-op program."""
    for summary, ops in _interpreted("gpt-rms", {"dp": 2}, "fsdp", "rms_norm",
                                     "rms_norm_backward"):
        assert summary["rms_norm"] == (5, 30)
        assert summary["rms_norm_backward"] == (5, 4 * 14 + 13)
        assert not ops & {"aten.rsqrt.default", "aten.expand.default"}


@pytest.mark.timeout(300)
def test_cross_entropy_pair_never_writes_the_log_softmax() -> None:
    """The GPT's loss under FSDP on dp=2 (rows split, the total weight all-reduced for the
    backward): ``_log_softmax`` + ``nll_loss_forward`` become one Triton call that leaves the
    rows' log-sum-exp where the log-probabilities were, and ``nll_loss_backward`` +
    ``_log_softmax_backward_data`` one call that reads it with the logits (kept alive for it
    instead of the log-probabilities). No log-softmax op is left; 2 steps match the op-by-op
    program."""
    for summary, ops in _interpreted("gpt", {"dp": 2}, "fsdp", "cross_entropy",
                                     "cross_entropy_backward"):
        assert summary["cross_entropy"] == (1, 2) and summary["cross_entropy_backward"] == (1, 2)
        assert not ops & {"aten._log_softmax.default", "aten.nll_loss_forward.default",
                          "aten._log_softmax_backward_data.default"}


@pytest.mark.timeout(300)
def test_swiglu_pair_recomputes_the_silu_instead_of_keeping_it() -> None:
    """The SwiGLU GPT (Llama's MLP: ``silu(c_fc(x)) * c_up(x)``) under Megatron on tp=2 (the
    hidden layer column-split): each block's ``silu`` + ``mul`` become one Triton call and its
    three backward ops (``mul(dy, silu)``, ``mul(dy, up)``, ``silu_backward``) another, which
    recomputes ``silu(gate)`` from the gate; the forward leaves nothing in the silu's slot,
    so that activation is not kept between the passes. The backward call runs as soon as
    ``dy`` is there (the up projection's weight gradient reads its first result before the
    last replaced op would have run). 2 steps match the op-by-op program."""
    for summary, ops in _interpreted("gpt-swiglu", {"tp": 2}, "megatron_tp", "swiglu",
                                     "swiglu_backward"):
        assert summary["swiglu"] == (2, 4) and summary["swiglu_backward"] == (2, 6)
        assert not ops & {"aten.silu.default", "aten.silu_backward.default"}


def test_a_private_value_without_its_partner_keeps_both_ops() -> None:
    """Cross-entropy's forward leaves its log-sum-exp where the log-softmax was: with its
    backward kernel gone (or unable to take the backward ops), the forward keeps its ops too,
    since the backward's ops would read the wrong value there."""
    plan = _plan("gpt", (("dp", 2),), "dp")

    def used() -> set[str]:
        prog = lower(plan, 0, device="cuda", check_available=False)
        return {k for k, *_ in kernel_summary(prog.instructions)}

    pair = {"cross_entropy", "cross_entropy_backward"}
    assert pair <= used()
    for gone in ("cross_entropy_backward", "cross_entropy"):
        spec = kernels.unregister_kernel(gone)
        try:
            assert not pair & used(), gone
        finally:
            kernels.register_kernel(spec)


def test_switched_off_kernels_leave_the_plans_ops() -> None:
    plan = _plan("gpt", (("dp", 2),), "dp")
    assert kernel_summary(lower(plan, 0, kernels=False).instructions) == []
    with kernels.kernels_disabled():
        assert kernel_summary(lower(plan, 0).instructions) == []
    assert kernel_summary(lower(plan, 0).instructions)


@pytest.mark.timeout(120)
def test_the_callers_state_is_copied_unless_donated() -> None:
    """In-place kernels update the caller's tensors only when ``run(..., donate=True)``."""
    ex, traced = _example("mlp")
    graph = traced.graph
    plan = plan_graph(graph, {"dp": 1}, topology="h100", strategy="dp")
    prog = lower(plan, 0)
    assert kernel_summary(prog.instructions)
    values = traced.input_values(*ex.batch(1))
    names = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    data = dict(zip([n.target for n in graph.inputs if n.meta.role.value == "data"],
                    ex.batch(2)))
    state = {k: values[k].clone() for k in names}
    before = {k: v.clone() for k, v in state.items()}
    comm = ThreadMesh(1).communicators[0]
    _, kept = run(prog, comm, state, data)
    assert all(torch.equal(state[k], before[k]) for k in names)        # untouched
    _, donated = run(prog, comm, state, data, donate=True)
    changed = [k for k in names if not torch.equal(state[k], before[k])]
    assert changed and all(donated[k] is state[k] for k in changed)    # updated in place
    assert donated.keys() == kept.keys()     # the state outputs (hyperparameters are read only)
    for k in kept:                                                     # the same step
        torch.testing.assert_close(donated[k], kept[k], rtol=0, atol=0)


def test_an_update_whose_old_value_is_read_later_keeps_its_ops() -> None:
    """A value the kernel would overwrite that something reads after the call (here a
    redistribution of the old parameter appended at the end) keeps that parameter's ops; the
    other parameters are still substituted."""
    ex, traced = _example("mlp")
    graph = traced.graph
    plan = plan_graph(graph, {"dp": 2}, topology="h100", strategy="dp")
    base = list(lower(plan, 0, kernels=False, bucket_bytes=0).instructions)
    out_layout = {p.node: p.outputs for p in plan.placements}
    with _only("adamw_foreach"):
        calls = [i for i in substitute(base, graph, out_layout, plan.mesh.sizes, "cpu")
                 if isinstance(i, KernelCall)]
        assert len(calls) == 1
        param = calls[0].operands[0][0][1]              # the first member's param
        have = out_layout[param.node][param.index]
        steps, exact = plan_steps(have, (Replicate(),), plan.mesh.sizes, (0,))
        late = Reshard(param, have, (Replicate(),), steps, exact, "<late reader>")
        again = [i for i in substitute(base + [late], graph, out_layout, plan.mesh.sizes, "cpu")
                 if isinstance(i, KernelCall)]
    assert len(again) == 1 and len(again[0].anchors) == len(calls[0].anchors) - 1
    assert param not in [m[0][1] for m in again[0].operands]


GPU_KERNELS = {
    "gpt": {"adamw", "layer_norm", "layer_norm_backward", "cross_entropy",
            "cross_entropy_backward"},
    "gpt-rms": {"adamw", "rms_norm", "rms_norm_backward", "cross_entropy",
                "cross_entropy_backward"},
    "gpt-swiglu": {"adamw", "layer_norm", "layer_norm_backward", "swiglu", "swiglu_backward",
                   "cross_entropy", "cross_entropy_backward"},
    "mlp-sgd": {"sgd", "layer_norm", "layer_norm_backward"},
}


def _eager_steps(name: str, device: str, steps: int = 3):
    """The example's own step, eager PyTorch on ``device`` (no meshplan), from the state the
    lowered programs of ``_run_steps`` start from and on the same batches: the losses and the
    final state as ``{input name: whole tensor}``. The state is loaded by the graph's input
    names (``model.<param>``, ``opt.state.model.<param>.<key>``; a tied weight is one input,
    under its first name, and stays one tensor); AdamW's ``step`` stays where torch keeps it
    (a CPU scalar unless capturable). Hyperparameter inputs, if the trace lists them, are the
    optimizer's own; any other state input is an error here, not silently left out."""
    _, traced = _example(name)
    values = traced.input_values(*_example(name)[0].batch(1))
    ex = _BUILD[name]()
    model = ex.model.to(device)
    held = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    loaded: set[str] = set()
    with torch.no_grad():
        for n, t in held.items():
            t.copy_(values[f"model.{n}"])
            loaded.add(f"model.{n}")
    for n, p in model.named_parameters():
        prefix = f"opt.state.model.{n}."
        st = {k[len(prefix):]: v.clone() for k, v in values.items()
              if k.startswith(prefix) and "." not in k[len(prefix):]}
        if st:
            ex.opt.state[p] = {k: v if k == "step" else v.to(device) for k, v in st.items()}
            loaded |= {prefix + k for k in st}
    roles = {n.target: n.meta.role.value for n in traced.graph.inputs}
    left = {k for k, role in roles.items() if role not in ("data", "hyper")} - loaded
    assert not left, f"state inputs with no eager counterpart: {sorted(left)}"
    losses = []
    for i in range(steps):
        loss = ex.step(*(t.to(device) for t in ex.batch(i + 2)))
        losses.append(loss.detach().cpu())
    state = {f"model.{n}": t.detach() for n, t in held.items()}
    for n, p in model.named_parameters():
        state |= {f"opt.state.model.{n}.{k}": v for k, v in ex.opt.state.get(p, {}).items()
                  if isinstance(v, torch.Tensor)}
    assert set(state) == loaded, sorted(set(state) ^ loaded)
    return losses, state


def _whole(programs, state: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """The whole tensor of state input ``name`` from every rank's piece, after checking that
    every rank holds exactly its piece of it (``assemble`` reads one copy of a replicated
    piece; the others must be the same bits: each rank applies the same update to the same
    reduced gradient)."""
    from meshplan.backends import assemble, local_part

    layout, sizes = programs[0].inputs[name], programs[0].sizes
    whole = assemble({p.coords: s[name] for p, s in zip(programs, state)}, layout, sizes)
    for p, s in zip(programs, state):
        assert torch.equal(s[name], local_part(whole, layout, sizes, p.coords)), \
            f"{name}: rank {p.rank}'s piece differs from its replica on another rank"
    return whole


# Against eager PyTorch (the example's own step, no meshplan), per state key: (rtol, atol).
# Both sides fp32; they differ by summation orders (the ranks' partial sums, the kernels' own
# order, the portable attention twin against the device's fused attention), a few ulps a step.
# Parameters as for the Triton kernels (module docstring: AdamW's m / sqrt(v) amplifies
# rounding noise where the true gradient is ~0); exp_avg and momentum_buffer are in gradient
# units (clipped to norm 1 here), so atol 1e-6; exp_avg_sq in squared gradient units, so its
# atol is squared too, 1e-10; step is a count and must be equal. A wrong shard, reduction or
# update is off by the gradient (1e-4..1e-1) or by lr (1e-3..1e-1) per step.
EAGER_TOLERANCE = {"param": (1e-4, 1e-5), "exp_avg": (1e-4, 1e-6),
                   "momentum_buffer": (1e-4, 1e-6), "exp_avg_sq": (1e-4, 1e-10), "step": (0, 0)}


def _check_against_eager(name: str, device: str, progs, losses, state) -> None:
    """``_run_steps``' losses (rtol 1e-5 / atol 1e-6) and every state input, assembled from
    the ranks' pieces, against ``_eager_steps`` on ``device`` (``EAGER_TOLERANCE``)."""
    want_losses, want = _eager_steps(name, device, steps=len(losses))
    torch.testing.assert_close([x.cpu() for x in losses], want_losses, rtol=1e-5, atol=1e-6,
                               msg="losses against eager PyTorch")
    assert want.keys() <= state[0].keys(), sorted(set(want) - set(state[0]))
    for k, w in want.items():
        kind = k.rsplit(".", 1)[1] if k.startswith("opt.state.") else "param"
        rtol, atol = EAGER_TOLERANCE[kind]
        got = _whole(progs, state, k)
        assert got.device.type == w.device.type or kind == "step", (k, got.device, w.device)
        torch.testing.assert_close(got.cpu(), w.cpu(), rtol=rtol, atol=atol,
                                   msg=f"{k} against eager PyTorch on {device}")


@pytest.mark.timeout(120)
def test_lowered_programs_match_eager_torch_on_the_cpu() -> None:
    """The comparison the GPU test below makes with eager PyTorch on CUDA, on the CPU (FSDP on
    dp=2 with the CPU kernels): it keeps that test's reference (loading the traced state into
    a fresh model and optimizer, assembling the ranks' pieces) checked where CI runs."""
    progs, losses, state = _run_steps("gpt", {"dp": 2}, "fsdp", use_kernels=True)
    _check_against_eager("gpt", "cpu", progs, losses, state)


@pytest.fixture
def fp32_matmuls():
    """TF32 off for the test (cuBLAS matmuls and cuDNN convolutions), restored after: both the
    lowered programs and eager PyTorch must compute in fp32, or the comparison measures TF32's
    10-bit mantissa (~5e-4 relative per product, summed differently per shard) instead of the
    programs."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("name", "axes", "strategy"),
                         [("gpt", {"dp": 1}, "dp"), ("gpt", {"dp": 2}, "fsdp"),
                          ("gpt-rms", {"dp": 2}, "fsdp"), ("gpt-swiglu", {"tp": 2}, "megatron_tp"),
                          ("mlp-sgd", {"dp": 2}, "dp")], ids=_ids)
def test_programs_on_a_gpu_use_triton_and_match_eager_torch(name, axes, strategy,
                                                            fp32_matmuls) -> None:
    """On CUDA the optimizer update is the Triton kernel (one launch per dtype group), the
    norms, the loss and SwiGLU are Triton calls forward and backward, the program's tensors
    live on the GPU, and 3 steps match eager PyTorch on the GPU (the example's own step on
    CUDA from the same state and batches: losses and every parameter and optimizer state
    value; fp32, TF32 off; ``EAGER_TOLERANCE``), the op-by-op program on the GPU and the CPU
    program (tolerance: module docstring)."""
    progs, losses, state = _run_steps(name, axes, strategy, use_kernels=True, device="cuda")
    for prog in progs:
        assert {k for k, *_ in kernel_summary(prog.instructions)} == GPU_KERNELS[name]
    _check_against_eager(name, "cuda", progs, losses, state)
    _, off_losses, off_state = _run_steps(name, axes, strategy, use_kernels=False,
                                          device="cuda")
    _, cpu_losses, cpu_state = _run_steps(name, axes, strategy, use_kernels=False)
    for want_l, want_s in ((off_losses, off_state), (cpu_losses, cpu_state)):
        torch.testing.assert_close(losses, want_l, rtol=1e-5, atol=1e-6)
        for got, want in zip(state, want_s):
            for k in want:
                assert got[k].device.type == "cuda"
                torch.testing.assert_close(got[k].cpu(), want[k].cpu(), rtol=1e-4, atol=1e-5,
                                           msg=k)


@pytest.mark.parametrize("causal", [True, False])
def test_the_portable_attention_twin_matches_the_cpu_flash_kernel(causal: bool) -> None:
    """A graph traced on the CPU holds ``_scaled_dot_product_flash_attention_for_cpu``; programs
    for other devices run ``backends/_portable.py``'s twin. Same outputs and gradients
    (float32, rtol 1e-5 / atol 1e-5: two summation orders of the same softmax)."""
    from meshplan.backends._portable import DEVICE_TWINS

    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, 7, 8, generator=gen) for _ in range(4))
    fwd = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    bwd = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
    want = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    got = DEVICE_TWINS[fwd](q, k, v, 0.0, causal)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    want_g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, want[0], want[1], 0.0, causal)
    got_g = DEVICE_TWINS[bwd](dout, q, k, v, want[0], want[1], 0.0, causal)
    for a, b in zip(got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
