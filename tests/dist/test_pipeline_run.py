"""Pipeline stages run on ranks (``backends/_pipeline_run.py``): a ``plan_pipeline`` plan's
per-stage programs on thread ranks, GPipe order, against the single-process interpreter; and
``distribute`` on a mesh with a ``pp`` axis (local worker processes) against one process.

Tolerances: the loss ``rtol=1e-5, atol=1e-6`` and the state ``1e-5``, those of the mesh
without stages (``test_distribute.py``): the stages run the same ops on the same values, and
the micro-batches' partial gradients are summed in another order than one matmul over the
batch (float32 rounding, which AdamW amplifies to a few 1e-6 where a gradient is near 0).
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.backends import ThreadMesh
from meshplan.backends._layout import assemble, coords_rank, rank_coords
from meshplan.backends._lower import Recv, Send, split_inputs
from meshplan.backends._pipeline_run import lower_pipeline, run_pipeline
from meshplan.examples import gpt
from meshplan.ir import interpret
from meshplan.planner._pipeline import plan_pipeline, unit_map

STEPS = 2


@lru_cache(maxsize=None)
def _example(layers: int):
    ex = gpt.build(optimizer="adamw", clip=1.0, config=gpt.GPTConfig(
        vocab_size=256, seq_len=32, n_layer=layers, n_head=2, d_model=64, batch_size=16))
    ex.step(*ex.batch(0))            # AdamW holds state: the steady graph
    traced = meshplan.trace(ex.step, *ex.batch(1))
    values = traced.input_values(*ex.batch(1))
    state = {n.target: values[n.target].clone() for n in traced.graph.inputs
             if n.meta.role.value != "data"}
    data = [n.target for n in traced.graph.inputs if n.meta.role.value == "data"]
    want, ref = [], dict(state)
    for step in range(STEPS):
        outs = interpret(traced.graph, {**ref, **dict(zip(data, ex.batch(step + 2)))})
        want.append([o for o, spec in zip(outs, traced.graph.outputs)
                     if spec.kind.value == "result"])
        ref = {**ref, **{spec.name: o for o, spec in zip(outs, traced.graph.outputs)
                         if spec.kind.value == "state"}}
    return ex, traced, state, data, want, ref


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layers", "axes", "m", "strategy", "schedule"), [
    (2, {"pp": 2}, 4, "auto", "gpipe"),
    (2, {"pp": 2, "dp": 2}, 2, "auto", "gpipe"),
    (2, {"pp": 2, "tp": 2}, 2, "megatron_tp", "gpipe"),
    (4, {"pp": 4}, 2, "auto", "gpipe"),
    (4, {"pp": 4}, 4, "auto", "1f1b"),
    (4, {"pp": 2, "dp": 2}, 4, "auto", "interleaved"),
    (4, {"pp": 4}, 4, "auto", "zb-h1"),
], ids=["pp2-m4", "pp2dp2-m2", "pp2tp2-m2", "pp4-m2", "pp4-m4-1f1b", "pp2dp2-m4-interleaved",
        "pp4-m4-zb-h1"])
def test_stages_equal_one_process(layers, axes, m, strategy, schedule) -> None:
    """Every stage holds its own state only; the loss comes out of the last stage each step,
    and each state tensor, assembled from its stage's ranks, equals the interpreter's."""
    ex, traced, state, data, want, ref = _example(layers)
    graph = traced.graph
    pp = plan_pipeline(graph, axes, topology="h100", schedule=schedule, microbatches=m,
                       strategy=strategy)
    assert pp.schedule == schedule and (pp.virtual_stages > 1) == (schedule == "interleaved")
    inner, sizes = pp.inner, pp.mesh.sizes
    a, world = pp.mesh.index("pp"), int(torch.tensor(sizes).prod())
    programs = [lower_pipeline(pp, r) for r in range(world)]
    # in a micro-batch's forward and backward, stage s exchanges with stages s - 1 and s + 1
    # only (and p - 1 with 0, where each device holds several chunks: interleaved), but for
    # the tied embedding: the head's share of its gradient, made on the last stage, goes to
    # the first (the head's weight itself is sent once per step, before)
    for sp in programs:
        for prog in (x for progs in sp.parts.values() for x in progs):
            for i in prog.instructions:
                if isinstance(i, (Send, Recv)):
                    peer = rank_coords(i.peer, sizes)[a]
                    assert abs(peer - sp.stage) == 1 or (
                        pp.virtual_stages > 1 and {peer, sp.stage} == {0, pp.pp - 1}) or (
                        {peer, sp.stage} == {0, pp.pp - 1}
                        and graph.node(i.ref.node).module_path == "model.lm_head"), (sp.stage, i)

    def inner_rank(r: int) -> int:
        cs = rank_coords(r, sizes)
        return coords_rank(cs[:a] + cs[a + 1:], inner.mesh.sizes)

    _, unit = unit_map(graph)
    stage_of = {u: k % pp.pp for k, chunk in enumerate(pp.chunks) for u in chunk}
    by_target = {n.target: n.name for n in graph.inputs}
    hyper = {n.target for n in graph.inputs if n.meta.role.value == "hyper"}
    owner = {k: stage_of[unit[by_target[k]]] for k in state if k not in hyper}
    local = [{k: v for k, v in split_inputs(inner, inner_rank(r), state).items()
              if k in hyper or owner[k] == rank_coords(r, sizes)[a]} for r in range(world)]
    mesh = ThreadMesh(world, timeout_s=60)
    for step in range(STEPS):
        batch = dict(zip(data, ex.batch(step + 2)))

        def one(comm, batch=batch):
            r = comm.rank
            return run_pipeline(programs[r], comm, local[r],
                                split_inputs(inner, inner_rank(r), batch))

        got = mesh.run(one)
        for r in range(world):
            assert set(got[r][1]) == set(local[r]) - hyper      # its own state, all of it
            local[r] = {**local[r], **got[r][1]}
            last = rank_coords(r, sizes)[a] == pp.pp - 1
            assert len(got[r][0]) == (len(want[step]) if last else 0)
            for g, w in zip(got[r][0], want[step]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    for k, v in ref.items():
        if k in hyper:
            continue
        ranks = [r for r in range(world) if rank_coords(r, sizes)[a] == owner[k]]
        whole = assemble({rank_coords(inner_rank(r), inner.mesh.sizes): local[r][k]
                          for r in ranks}, inner.input_layouts[k], inner.mesh.sizes)
        torch.testing.assert_close(whole, v, rtol=1e-5, atol=1e-5, msg=k)


def test_what_is_not_lowered_yet_is_said() -> None:
    from dataclasses import replace

    ex, traced, *_ = _example(2)
    pp = plan_pipeline(traced.graph, {"pp": 2}, topology="h100", schedule="1f1b",
                       microbatches=2)
    with pytest.raises(meshplan.LoweringError, match="'zb-v': not lowered yet.*'gpipe', "
                                                     "'1f1b', 'interleaved', 'zb-h1' run"):
        lower_pipeline(replace(pp, schedule="zb-v"), 0)
    with pytest.raises(meshplan.LoweringError, match="'1f1b' with 2 chunks per device: only "
                                                     "'interleaved' runs several"):
        lower_pipeline(replace(pp, virtual_stages=2), 0)


sys.path.insert(0, str(Path(__file__).parent))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("axes", "launcher", "schedule"), [
    ({"pp": 2, "dp": 2}, "local", "interleaved"), ({"pp": 4}, "mpi", "1f1b")],
    ids=["pp2dp2-interleaved", "pp4-mpi"])
def test_distribute_runs_stages_equal_to_one_process(axes, launcher, schedule,
                                                     monkeypatch) -> None:
    """``distribute`` on a 4-layer GPT, ``pp=2 x dp=2`` on local processes in interleaved
    1F1B's order (2 chunks of a layer each per device) and ``pp=4`` in 1F1B's order under
    mpiexec, its transfers one-sided puts (``MESHPLAN_STAGE_TRANSFERS=rma``; MPI's two-sided
    sends are ``test_mpi.py``'s): losses every step, the state gathered after 5 steps and
    the state written back equal one process's (``check_equal_to_one_process``'s
    tolerances); the transfers between stages are recorded as sends."""
    from test_distribute import check_equal_to_one_process

    if launcher == "mpi":
        monkeypatch.setenv("MESHPLAN_STAGE_TRANSFERS", "rma")

    def stages(step) -> None:
        assert step.pipeline.pp == axes["pp"] and step.pipeline.microbatches == 2
        assert step.pipeline.schedule == schedule
        assert step.pipeline.virtual_stages == (2 if schedule == "interleaved" else 1)
        assert f"{axes['pp']} stages" in step.plan.summary()
        assert all(any(c["kind"] == "send" for c in rank) for rank in step.last_comm)

    check_equal_to_one_process("gpt4", axes, "auto", after_steps=stages, microbatches=2,
                               launcher=launcher, telemetry=False, timeout_s=60,
                               schedule=schedule)


@pytest.mark.timeout(240)
def test_stages_save_and_load_checkpoints(tmp_path) -> None:
    """Each stage's ranks hold only their stage's state: a checkpoint gathers it from them, a
    mesh launched from a checkpoint reads each stage's pieces, and so does a running one
    (``load_checkpoint``); the losses follow one process's through all three."""
    ref = gpt.build(optimizer="adamw", clip=1.0)

    def mesh():
        ex = gpt.build(optimizer="adamw", clip=1.0)
        return ex, meshplan.distribute(ex.step, mesh={"pp": 2}, topology="h100",
                                       microbatches=2, telemetry=False)

    def same(got, i) -> None:
        torch.testing.assert_close(got.detach(), ref.step(*ref.batch(i)).detach(), rtol=1e-5,
                                   atol=1e-6, msg=f"loss at step {i}")

    ex_a, a = mesh()
    with a:
        for i in range(2):
            same(a(*ex_a.batch(i)), i)
        first = a.save_checkpoint(tmp_path / "a.safetensors")
        ex_b, b = mesh()
        b.load_checkpoint(first)
        with b:                               # launched from the file
            same(b(*ex_b.batch(2)), 2)
            second = b.save_checkpoint(tmp_path / "b.safetensors")
        a.load_checkpoint(second)             # into the running mesh
        same(a(*ex_a.batch(3)), 3)
        sd = a.state_dict()
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(sd["model"][k], v.detach(), rtol=1e-5, atol=1e-5, msg=k)


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))
        self.out = torch.nn.Linear(16, 10)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


def _two_copies(model_cls, loss_fn, lr: float, adam_and_clip: bool = False,
                zero_first: bool = False):
    """A model and a copy of it, each with its own training step (SGD with momentum, or Adam
    with ``clip_grad_norm_``; ``opt.zero_grad()`` last, or first with ``zero_first``, which
    keeps the gradients between steps): the first runs in this process, the second under
    ``distribute``."""
    import copy

    plain = model_cls()
    mine = copy.deepcopy(plain)

    def stepper(model):
        opt = (torch.optim.Adam(model.parameters(), lr=lr) if adam_and_clip else
               torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))

        def train_step(x, y):
            if zero_first:
                opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            if adam_and_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if not zero_first:
                opt.zero_grad()
            return loss
        return train_step

    return plain, mine, stepper(plain), stepper(mine)


@pytest.mark.timeout(120)
def test_a_user_classifier_on_stages_equals_one_process() -> None:
    """A step not written for meshplan: ``cross_entropy`` on 1-D class labels with label
    smoothing and padding targets (-100) piled into the first micro-batch (the loss's mean
    and the smoothing term divide by the whole batch's count of the targets, which the stages
    work out before the micro-batches; the smoothing's count was once refused), SGD with
    momentum, on ``pp=2`` in 2 micro-batches: losses and parameters as one process
    (``rtol=1e-5, atol=1e-6``: the micro-batches' gradients summed in another order).
    ``microbatches=1`` is refused by name before any rank starts."""
    torch.manual_seed(0)
    plain, mine, one, step_fn = _two_copies(
        _Classifier, lambda out, y: torch.nn.functional.cross_entropy(out, y,
                                                                       label_smoothing=0.1),
        lr=0.1)
    with pytest.raises(meshplan.RuntimeFailure, match=r"microbatches=1\) on mesh pp=2"):
        meshplan.distribute(step_fn, mesh={"pp": 2}, microbatches=1)(
            torch.randn(8, 16), torch.randint(0, 10, (8,)))

    def targets():
        y = torch.randint(0, 10, (8,))
        y[:3] = -100
        return y
    batches = [(torch.randn(8, 16), targets()) for _ in range(3)]
    with meshplan.distribute(step_fn, mesh={"pp": 2}, microbatches=2, telemetry=False) as step:
        for x, y in batches:
            torch.testing.assert_close(step(x, y).detach(), one(x, y).detach(), rtol=1e-5,
                                       atol=1e-6)
        step.sync()
    for (name, a), b in zip(plain.named_parameters(), mine.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6, msg=name)


class _Wrapped(torch.nn.Module):
    """Layers between an input and an output Linear, the activation and one LayerNorm shared
    by every gap in the parent's code; the blocks' parameters come first (clipping's
    coefficient then goes with the first block's)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.inp = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 10)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = self.norm(torch.relu(block(x)))
        return self.out(x)


@pytest.mark.timeout(180)
def test_user_models_that_once_failed_on_stages_equal_one_process() -> None:
    """Two user trials' models: ``x = torch.relu(block(x))`` (the parent's activation ran
    with the head, so the stages passed every activation to the last and back: 1F1B gave
    wrong parameters on pp=2 and hung on pp=4), with Adam and gradient clipping over
    parameters whose first is a block's (the head's clipped gradient went with the first
    block, and the last stage failed on its Adam state: ``KeyError``). On ``pp=4`` in 1F1B's
    order, losses (``rtol=1e-5, atol=1e-6``: the micro-batches' gradients summed in another
    order than one matmul) and parameters (``1e-5``, the state's tolerance of this file: Adam
    turns that rounding into a few 1e-6 where a gradient is near 0) as one process after 3
    steps. The loss is a mean ``mse_loss`` plus a mean penalty on the output (once refused on
    stages: the mean's backward divided by a micro-batch's count, and the penalty's gradient
    was planned on the whole batch), and one LayerNorm runs in every gap (once refused under
    1F1B: every gap's norm ran on the last stage)."""
    torch.manual_seed(0)
    plain, mine, one, step_fn = _two_copies(
        _Wrapped, lambda out, y: torch.nn.functional.mse_loss(out, y) + 1e-3 * out.pow(2).mean(),
        lr=0.01, adam_and_clip=True)
    batches = [(torch.randn(16, 16), torch.randn(16, 10)) for _ in range(3)]
    with meshplan.distribute(step_fn, mesh={"pp": 4}, microbatches=4, schedule="1f1b",
                             telemetry=False) as step:
        for x, y in batches:
            torch.testing.assert_close(step(x, y).detach(), one(x, y).detach(), rtol=1e-5,
                                       atol=1e-6)
        assert step.pipeline.schedule == "1f1b"
        step.sync()
    for (name, a), b in zip(plain.named_parameters(), mine.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-5, msg=name)


class _SharedNorm(torch.nn.Module):
    """One LayerNorm of the parent after every layer (a user trial's model)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(12, 16)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = self.norm(torch.relu(layer(h)))
        return self.out(h)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero_first", [False, True], ids=["zero_grad_last", "zero_grad_first"])
def test_a_shared_norm_with_sgd_on_stages_equals_one_process(zero_first: bool) -> None:
    """The norm's gradient is summed on the first stage and updated on the last, which
    receives it in the layout the update reads it in (P(avg) over the inner dp=1): the fused
    SGD kernel read it as R, normalised, and got None (``TypeError`` on the worker). With
    ``zero_grad()`` first the step keeps that gradient, and keeps it where it is summed (it
    was kept by the parameter's stage, which was never sent it: ``LoweringError``). Losses
    and parameters as one process (``rtol=1e-5, atol=1e-6``), 1F1B on ``pp=2``."""
    torch.manual_seed(0)
    plain, mine, one, step_fn = _two_copies(_SharedNorm, torch.nn.functional.mse_loss, lr=0.05,
                                            zero_first=zero_first)
    x, y = torch.randn(8, 12), torch.randn(8, 4)
    with meshplan.distribute(step_fn, mesh={"pp": 2}, microbatches=4, schedule="1f1b",
                             telemetry=False) as step:
        for _ in range(3):
            torch.testing.assert_close(step(x, y).detach(), one(x, y).detach(), rtol=1e-5,
                                       atol=1e-6)
        step.sync()
    for (name, a), b in zip(plain.named_parameters(), mine.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-6, msg=name)
