"""Micro-batches (``distribute(microbatches=m)``, ``backends/_microbatch.py``): each rank runs
its batch in ``m`` parts, the gradients summed, the optimizer once, equal to the whole batch
at once.

Tolerances: the losses ``rtol=1e-5, atol=1e-6`` and the state ``1e-5``, as the mesh runs
without micro-batches (``test_distribute.py``): summing ``m`` partial gradients instead of one
matmul over the batch changes only the summation order (float32 rounding, ~1e-7 relative per
step), which AdamW amplifies to a few 1e-6 where the true gradient is near zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_distribute import check_equal_to_one_process  # noqa: E402
from test_lower import _example, _inputs, _plan, _reference  # noqa: E402

from meshplan.backends import ThreadMesh  # noqa: E402
from meshplan.backends._layout import assemble, rank_coords  # noqa: E402
from meshplan.backends._lower import split_inputs  # noqa: E402
from meshplan.backends._microbatch import (  # noqa: E402
    lower_microbatched,
    microbatch_plan,
    run_microbatched,
    split_microbatched,
)
from meshplan.planner import PlanError  # noqa: E402


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "axes", "strategy", "m"), [
    ("gpt", {"dp": 2}, "dp", 2),
    ("gpt-b16", {"dp": 2}, "fsdp", 4),
    ("gpt", {"dp": 2, "tp": 2}, "megatron_tp", 2),
    ("mlp-sgd", {"dp": 2}, "dp", 2),
], ids=["gpt-dp2-m2", "gpt-fsdp2-m4", "gpt-dp2tp2-m2", "mlp-mse-mean-dp2-m2"])
def test_microbatched_steps_equal_the_whole_batch(name, axes, strategy, m) -> None:
    """Three steps on a thread mesh against the single-process interpreter: every rank's loss
    each step, then the state. The micro-batch part of a rank's program holds no optimizer
    op and the step part no op that reads the batch; nll_loss's count is worked out first.
    The MLP's ``mse_loss`` takes ``reduction="mean"``: its backward on a micro-batch divides by
    the whole batch's count (``loss.py``'s local op), with nothing worked out first."""
    ex, traced = _example(name)
    graph = traced.graph
    plan = _plan(name, axes, strategy)
    mb = microbatch_plan(plan, m)
    world = int(torch.tensor(plan.mesh.sizes).prod())
    programs = [lower_microbatched(mb, r) for r in range(world)]
    p0 = programs[0]
    assert len(p0.parts) == m and len(p0.hoisted) == (name != "mlp-sgd") and p0.partials
    update = {n.name for n in graph.nodes if n.phase.value == "update"}
    assert not any(getattr(i, "node", None) is not None and i.node.name in update
                   for i in p0.parts[0].instructions)
    assert "x" not in p0.step.input_nodes.values()
    full = {n.target: t.clone() for n, t in zip(graph.inputs, _inputs(traced, ex))}
    state_names = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    reference, ref_state = _reference(name)
    local = [split_inputs(plan, r, {k: full[k] for k in state_names}) for r in range(world)]
    mesh = ThreadMesh(world, timeout_s=60)
    for step in range(3):
        batch = dict(zip([n.target for n in graph.inputs if n.meta.role.value == "data"],
                         ex.batch(step + 2)))

        def one(comm, batch=batch):
            r = comm.rank
            return run_microbatched(programs[r], comm, local[r], split_microbatched(mb, r, batch))

        got = mesh.run(one)
        for r in range(world):
            local[r] = {**local[r], **got[r][1]}
            for g, w in zip(got[r][0], reference[step]):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    sizes = plan.mesh.sizes
    for k in state_names:
        whole = assemble({rank_coords(r, sizes): local[r][k] for r in range(world)},
                         plan.input_layouts[k], sizes)
        torch.testing.assert_close(whole, ref_state[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.timeout(300)
def test_distribute_with_microbatches_equals_one_process() -> None:
    """Local processes, ``distribute(microbatches=2)``: losses every step, parameters and AdamW
    state after the steps, as one process (``check_equal_to_one_process``'s tolerances)."""
    check_equal_to_one_process("gpt", {"dp": 2}, "dp", microbatches=2)


def test_what_cannot_run_in_microbatches_is_refused_by_name() -> None:
    # batch norm: its statistics are the whole batch's, so no micro-batch can go on alone
    plan = _plan("cnn", {"dp": 2}, "dp")
    with pytest.raises(PlanError, match=r"micro-batches: .*batch_norm.* at .*cnn.py:\d+.* is a "
                                        r"batch norm in training.*microbatches=1"):
        lower_microbatched(microbatch_plan(plan, 2), 0)
    plan = _plan("gpt", {"dp": 2}, "dp")            # 4 sequences: 2 per rank
    with pytest.raises(PlanError, match=r"microbatches=4: input 'x' of shape \[4, 16\] gives "
                                        r"each rank 2 rows.*divisor of 2"):
        microbatch_plan(plan, 4)
    for bad in (0, 1.5, True):
        with pytest.raises(PlanError, match="positive int"):
            microbatch_plan(plan, bad)
    import meshplan

    # a model run sequence-first: a Linear on (sequence, batch, features) reshapes it to
    # (sequence x batch, features), where no piece of the batch is a contiguous piece of the
    # merged dim; the refusal names the reshape and says to run it batch-first
    lin = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)

    def seq_first(x):
        loss = lin(x.transpose(0, 1)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    from meshplan.planner import plan_graph
    plan = plan_graph(meshplan.trace(seq_first, torch.randn(4, 3, 8)).graph, {"dp": 2},
                      strategy="dp")
    with pytest.raises(PlanError, match=r"_unsafe_view.* at .*test_microbatch.py:\d+.* merges "
                                        r"the batch's dim .*\[3, 4, 8\] -> \[12, 8\].*run it "
                                        r"batch-first.*nn.GRU, nn.LSTM.*Use microbatches=1, "
                                        r"or run the model batch-first$"):
        lower_microbatched(microbatch_plan(plan, 2), 0)
    with pytest.raises(meshplan.RuntimeFailure, match=r"microbatches=2, calibrate=True"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, microbatches=2, calibrate=True)
    with pytest.raises(meshplan.RuntimeFailure, match=r"distribute\(microbatches=0"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, microbatches=0)


class _Attend(torch.nn.Module):
    """``nn.MultiheadAttention`` (batch-first, its averaged weights asked for, a padding mask)
    between two Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 16)
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, x, pad):
        h = self.inp(x)
        a, w = self.mha(h, h, h, key_padding_mask=pad)
        return self.head((h + a).mean(1)) + w.sum((1, 2)).unsqueeze(1)


@pytest.mark.timeout(120)
def test_multihead_attention_in_microbatches_equals_one_process() -> None:
    """``nn.MultiheadAttention`` splits over the batch: meshplan traces it batch-major
    (``frontend/_attention.py``; torch's own merges (sequence x batch) rows, and micro-batches
    refused it). On ``dp=2`` in 2 micro-batches, cross-entropy and SGD: losses and parameters
    as one process after 3 steps (this file's tolerances; the projections' rows run in
    another order, which changes float32 rounding only)."""
    import copy

    import meshplan

    torch.manual_seed(0)
    model = _Attend()
    mine = copy.deepcopy(model)

    def stepper(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)

        def train_step(x, pad, y):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x, pad), y)
            loss.backward()
            opt.step()
            return loss
        return train_step

    one, step_fn = stepper(model), stepper(mine)
    pad = torch.zeros(8, 5, dtype=torch.bool)
    pad[::3, -2:] = True
    batches = [(torch.randn(8, 5, 6), pad, torch.randint(0, 5, (8,))) for _ in range(3)]
    with meshplan.distribute(step_fn, mesh={"dp": 2}, microbatches=2, telemetry=False) as step:
        for b in batches:
            torch.testing.assert_close(step(*b).detach(), one(*b).detach(), rtol=1e-5,
                                       atol=1e-6)
        step.sync()
    for (name, a), b in zip(model.named_parameters(), mine.parameters()):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.timeout(300)
def test_a_user_step_in_microbatches_equals_one_process() -> None:
    """A step written for one process (an MLP with a buffer, ``mse_loss(reduction="sum") /
    batch`` plus a zero made with ``new_zeros`` and a ``binary_cross_entropy_with_logits``
    term, SGD with momentum, the automatic plan) in 4 parts on 2 ranks: losses and parameters
    as one process. Its backward's seed, ``ones_like(loss)``, reads the loss's shape only, so
    the micro-batches need no sum of the loss before their backward. The BCE's traced
    ``1 - y`` is ``empty_like(y).fill_(1) - y``: a stand-in of ``y``'s shape once replaced
    ``y`` itself for every reader (losses of 1e32, then NaN, without an error)."""
    import copy

    import meshplan

    class Scaled(torch.nn.Sequential):      # a buffer the step reads and returns unchanged
        def __init__(self, *layers):
            super().__init__(*layers)
            self.register_buffer("scale", torch.tensor(0.5))

        def forward(self, x):
            return super().forward(x) * self.scale

    torch.manual_seed(0)
    model = Scaled(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                   torch.nn.Tanh(), torch.nn.Linear(64, 4))
    twin = copy.deepcopy(model)

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step(x, y):
            out = model(x)
            # an auxiliary term made with new_zeros from a batch-split value (it reads only
            # its dtype: refused as needing the whole batch until new_* took any layout)
            loss = torch.nn.functional.mse_loss(out, y, reduction="sum") / x.shape[0] \
                + out.new_zeros(()) \
                + 0.1 * torch.nn.functional.binary_cross_entropy_with_logits(out, y.sigmoid())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss
        return step

    one = make(twin)
    mesh = meshplan.distribute(make(model), mesh={"dp": 2}, microbatches=4, telemetry=False)
    g = torch.Generator().manual_seed(1)
    with mesh:
        for i in range(4):
            x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
            torch.testing.assert_close(mesh(x, y).detach(), one(x, y).detach(), rtol=1e-5,
                                       atol=1e-6, msg=f"loss at step {i}")
        mesh.sync()
    for (k, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5, msg=k)


class _Block(torch.nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        # no key bias: its true gradient is 0 (softmax ignores a shift), and AdamW turns the
        # rounding noise standing in for it into lr-sized steps, whatever computes it
        self.q_proj, self.k_proj = torch.nn.Linear(d, d), torch.nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.c_fc, self.c_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        y = self.ln1(x)
        q, k, v = (m(y).view(b, t, self.h, d // self.h).transpose(1, 2)
                   for m in (self.q_proj, self.k_proj, self.v_proj))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.c_proj(torch.nn.functional.gelu(self.c_fc(self.ln2(x))))


@pytest.mark.timeout(300)
def test_megatron_layouts_in_microbatches_with_ignored_targets() -> None:
    """Megatron's layouts on dp=2 x tp=2 of a user's language model (q/k/v/o_proj, SDPA, tied
    head), 2 micro-batches, a fifth of the targets -100 and piled into the first rows (so
    every part counts a different number): the loss of each step and the state after two
    equal the interpreter's, since each part's sum and backward divide by the whole batch's
    count (the loss was once each part's mean, averaged: 1e-3 off with gradients right). Its
    layouts change a value split over dp and tp on one dim: moving it must not gather over
    the micro-batches (``lower_parts``), which the plan's generic fallback did."""
    import meshplan
    from meshplan.planner import plan_graph

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 64)
            self.pos = torch.nn.Parameter(torch.randn(16, 64) * 0.02)
            self.layers = torch.nn.ModuleList([_Block(64, 4), _Block(64, 4)])
            self.ln_f = torch.nn.LayerNorm(64)
            self.head = torch.nn.Linear(64, 64, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            x = self.emb(idx) + self.pos[: idx.shape[1]]
            for block in self.layers:
                x = block(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(0)
    model = LM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x).view(-1, 64), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    g = torch.Generator().manual_seed(1)

    def batch():
        x = torch.randint(0, 64, (16, 16), generator=g)
        y = torch.randint(0, 64, (16, 16), generator=g)
        y[torch.rand(16, 16, generator=g) < 0.2] = -100
        y[:4][torch.rand(4, 16, generator=g) < 0.7] = -100
        return x, y

    step(*batch())
    traced = meshplan.trace(step, *batch())
    graph = traced.graph
    plan = plan_graph(graph, {"dp": 2, "tp": 2}, strategy="megatron_tp", topology="cpu")
    _, local, ref = _against_the_interpreter(traced, plan, 2, batch, steps=2)
    for k, v in ref.items():
        whole = assemble({rank_coords(r, (2, 2)): local[r][k] for r in range(4)},
                         plan.input_layouts[k], plan.mesh.sizes)
        torch.testing.assert_close(whole, v, rtol=1e-5, atol=1e-5, msg=k)


_WEIGHTS = torch.rand(7, generator=torch.Generator().manual_seed(2)) + 0.5
_CE = torch.nn.functional.cross_entropy
_LOSSES = {   # the loss of logits o, targets y (-100: padding) and a float mask the step is given
    "label_smoothing": lambda o, y, mask, n: _CE(o, y, label_smoothing=0.1),
    "weights_and_smoothing": lambda o, y, mask, n: _CE(o, y, weight=_WEIGHTS,
                                                       label_smoothing=0.1),
    "masked_mean": lambda o, y, mask, n: (_CE(o, y, reduction="none") * mask).sum() / mask.sum(),
    "masked_mean_int_count": lambda o, y, mask, n: (
        _CE(o, y, reduction="none") * mask).sum() / mask.long().sum(),
    "mean_plus_z_loss": lambda o, y, mask, n: _CE(o, y) + 1e-2 * torch.logsumexp(o, -1).pow(
        2).mean(),
    "sum_over_given_count": lambda o, y, mask, n: _CE(o, y, reduction="sum") / n,
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss", list(_LOSSES))
def test_losses_of_the_whole_batch_in_microbatches(loss: str) -> None:
    """Losses that divide by something of the whole batch, padding targets (-100) piled into
    the first micro-batch, on ``dp=2`` in 2 micro-batches, SGD with momentum: the loss of
    every step and the state after three equal the interpreter's. Label smoothing's count of
    the targets not ignored, a mask's sum, class weights' sum: values of the data alone, made
    before the micro-batches (refused before 2026-12-05, or a ``TypeError`` where the plan
    gathered a given mask itself); a mean added to a partial term runs once per step on the
    sums; a 0-d count given to the step is every rank's (it was "refused": no batch dim)."""
    import meshplan
    from meshplan.planner import plan_graph

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 7))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = _LOSSES[loss]

    def step(x, y, mask, n):
        opt.zero_grad()
        out = loss_fn(model(x), y, mask, n)
        out.backward()
        opt.step()
        return out

    g = torch.Generator().manual_seed(1)

    def batch():
        y = torch.randint(0, 7, (8,), generator=g)
        y[:3] = -100
        mask = (y >= 0).float() * (1 + torch.rand(8, generator=g))     # weights 1-2
        return torch.randn(8, 16, generator=g), y.clamp(min=0) if "mask" in loss else y, \
            mask, torch.tensor(5.0)

    step(*batch())
    traced = meshplan.trace(step, *batch())
    graph = traced.graph
    plan = plan_graph(graph, {"dp": 2}, strategy="dp", topology="cpu")   # state replicated
    programs, local, ref = _against_the_interpreter(traced, plan, 2, batch, steps=3)
    if loss == "label_smoothing":
        assert len(programs[0].hoisted) == 2     # nll_loss's count and the smoothing's
    for k, v in ref.items():
        torch.testing.assert_close(local[0][k], v, rtol=1e-5, atol=1e-5, msg=k)


def _against_the_interpreter(traced, plan, m: int, batch, steps: int):
    """``steps`` steps of ``plan`` in ``m`` micro-batches on a thread mesh, each call of
    ``batch()`` a new batch, next to the reference interpreter: every rank's loss each step
    equal to it (this file's tolerance). Returns the ranks' programs and state, and the
    interpreter's state."""
    from meshplan.ir import interpret

    graph = traced.graph
    mb = microbatch_plan(plan, m)
    world = int(torch.tensor(plan.mesh.sizes).prod())
    programs = [lower_microbatched(mb, r) for r in range(world)]
    values = traced.input_values(*batch())
    data = [n.target for n in graph.inputs if n.meta.role.value == "data"]
    ref = {n.target: values[n.target].clone() for n in graph.inputs if n.target not in data}
    local = [split_inputs(plan, r, ref) for r in range(world)]
    mesh = ThreadMesh(world, timeout_s=60)
    for _ in range(steps):
        b = dict(zip(data, batch()))
        outs = interpret(graph, {**ref, **b})
        ref.update({o.name: v for v, o in zip(outs, graph.outputs) if o.kind.value == "state"})
        got = mesh.run(lambda comm, b=b: run_microbatched(
            programs[comm.rank], comm, local[comm.rank], split_microbatched(mb, comm.rank, b)))
        local = [{**local[r], **got[r][1]} for r in range(world)]
        loss = next(v for v, o in zip(outs, graph.outputs) if o.kind.value != "state")
        for r in range(world):
            torch.testing.assert_close(got[r][0][0], loss, rtol=1e-5, atol=1e-6, msg="loss")
    return programs, local, ref
