"""Several meshes in one program and ``meshplan.transfer`` between them
(``runtime/_transfer.py``).

- The RL example (``examples/rl_grpo.py``): a generator (Megatron tensor parallel, inference
  only) and a trainer (FSDP) alive at once on their own ranks, the trainer's weights sent to
  the generator after every update, equal to the same loop in one process: the same sampled
  tokens at every step (Gumbel-max sampling with the noise as an input: an argmax of
  continuous values, which the mesh's float32 rounding does not flip), the losses within
  ``1e-5`` (FSDP's reduce-scatter sums the gradient in another order than one process: ~1e-7
  relative per step) and the parameters within ``1e-4``: the attention's key bias has a zero
  gradient in exact arithmetic (softmax ignores a constant added to every key of a query), so
  its float32 gradient is rounding noise of either order, which AdamW divides by its own
  size: such an entry moves by up to ``lr = 1e-2`` a step on either side (measured: 2.8e-5
  after 3 steps; every other parameter within 2e-7). Under the local launcher (``shm``) and
  under mpi (``rma``: the two mpiexec worlds joined).
- Transfers between running meshes of different layouts and sizes (FSDP on 2, Megatron on
  2x2, a 2-stage pipeline, into replicated, Megatron on 2 and FSDP on 4 ranks), by ``shm``
  and by ``tcp`` (the path of ranks on other hosts without MPI, here on loopback): the
  destination's state afterwards equals the source's, bit for bit (copies only).
- A step that is not running takes the values through the controller; bad names and shapes
  are one clear error. The copy plan itself is tested exhaustively in
  ``tests/unit/test_transfer_plan.py``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import meshplan
from meshplan import RuntimeFailure
from meshplan.examples import rl_grpo
from meshplan.examples.gpt import GPT, GPTConfig

STEPS = 3


def _check_rl(launcher: str, method: str) -> None:
    one = rl_grpo.reference(STEPS)
    mesh = rl_grpo.run(STEPS, launcher=launcher)
    for i in range(STEPS):
        assert torch.equal(one.samples[i], mesh.samples[i]), f"step {i}: other tokens sampled"
    torch.testing.assert_close(torch.tensor(mesh.losses), torch.tensor(one.losses),
                               rtol=0, atol=1e-5)
    for k, v in one.params.items():
        assert (mesh.params[k] - v).abs().max() <= 1e-4, k
    assert {r.method for r in mesh.syncs} == {method}
    assert all(r.controller_bytes == 0 and r.tensors > 0 and r.nbytes > 0 for r in mesh.syncs)


@pytest.mark.timeout(300)
def test_the_rl_loop_on_two_meshes_equals_one_process():
    _check_rl("local", "shm")


@pytest.mark.timeout(300)
def test_the_rl_loop_under_mpi_reads_one_sidedly_across_the_two_worlds():
    _check_rl("mpi", "rma")


_CFG = GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)


def _step(seed: int, train: bool):
    torch.manual_seed(seed)
    model = GPT(_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def infer(x):
        with torch.no_grad():
            return model(x)

    return model, (train_step if train else infer)


@pytest.mark.timeout(300)
def test_transfers_between_meshes_of_other_layouts_and_sizes_copy_exactly():
    x = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len))
    steps = []
    try:
        srcs = []
        for mesh, strategy in (({"dp": 2}, "fsdp"), ({"dp": 2, "tp": 2}, "megatron_tp"),
                               ({"pp": 2}, "auto")):
            _, fn = _step(0, True)
            step = meshplan.distribute(fn, mesh=mesh, strategy=strategy, telemetry=False)
            steps.append(step)
            step(x)
            step(x)                   # the weights differ from any fresh model's
            srcs.append(step)
        dsts = []
        fresh = _step(1, False)[0].state_dict()    # put back before each copy
        for mesh, strategy in (({"dp": 2}, "dp"), ({"tp": 2}, "megatron_tp"),
                               ({"dp": 4}, "fsdp")):
            model, fn = _step(1, False)
            step = meshplan.distribute(fn, mesh=mesh, strategy=strategy, telemetry=False)
            steps.append(step)
            step(x)
            dsts.append((model, step))
        layouts = set()
        for src in srcs:
            want = src.state_dict()["model"]
            for (model, dst), method in itertools.product(dsts, ("shm", "tcp")):
                dst.load_state_dict({"model": fresh, "optim": {}})
                report = meshplan.transfer(src, dst, method=None if method == "shm" else method)
                assert report.method == method and report.controller_bytes == 0
                got = dst.state_dict()["model"]
                assert sorted(got) == sorted(want)
                for k in want:
                    assert torch.equal(got[k], want[k]), (src.mesh, dst.mesh, method, k)
                layouts |= {(str(src.plan.input_layouts[n]), str(dst.plan.input_layouts[n]))
                            for n in dst.plan.input_layouts if n in src.plan.input_layouts}
        # the destination computes with what it got: its output is the source model's
        model, dst = dsts[1]
        model.load_state_dict(srcs[0].state_dict()["model"])
        meshplan.transfer(srcs[0], dst)
        with torch.no_grad():
            torch.testing.assert_close(dst(x), model(x), rtol=1e-5, atol=1e-6)
        # resharding happened: a row split into a column split and FSDP's rows into others
        assert ("(Shard(dim=0),)", "(Shard(dim=1),)") in layouts
        assert ("(Replicate(), Shard(dim=1))", "(Shard(dim=0),)") in layouts
        # a source shut down without sync(): what it trained is gone, and transfer says so
        srcs[0].shutdown()
        with pytest.raises(RuntimeFailure, match="mesh was shut down, and what it trained"):
            meshplan.transfer(srcs[0], dst)
    finally:
        for step in steps:
            step.shutdown()


def test_a_step_not_running_takes_the_values_through_the_controller():
    x = torch.randint(0, _CFG.vocab_size, (4, _CFG.seq_len))
    src_model, src_fn = _step(0, True)
    dst_model, dst_fn = _step(1, False)
    src = meshplan.distribute(src_fn, mesh={"dp": 2}, example_inputs=(x,), telemetry=False)
    dst = meshplan.distribute(dst_fn, mesh={"tp": 2}, example_inputs=(x,), telemetry=False)
    report = meshplan.transfer(src, dst, names=["lm_head.weight", "transformer.h.0.ln_1.weight"])
    assert report.method == "controller" and "no running mesh" in report.why
    assert report.tensors == 2            # the tied lm_head is wte: one tensor
    assert torch.equal(dst_model.lm_head.weight, src_model.lm_head.weight)
    assert torch.equal(dst_model.transformer.h[0].ln_1.weight,
                       src_model.transformer.h[0].ln_1.weight)
    assert not torch.equal(dst_model.transformer.h[1].ln_1.weight.detach(),
                           src_model.transformer.h[1].ln_1.weight.detach() + 1)
    with pytest.raises(RuntimeFailure, match="'nope' is not a state_dict key of"):
        meshplan.transfer(src, dst, names=["nope"])
    with pytest.raises(RuntimeFailure, match=r"has shape \[16\] in .* and \[64, 16\]"):
        meshplan.transfer(src, dst, names={"transformer.h.0.ln_1.weight": "transformer.h.0."
                                           "mlp.c_fc.weight"})
    with pytest.raises(RuntimeFailure, match="both go to"):
        meshplan.transfer(src, dst, names={"transformer.h.0.ln_1.weight": "lm_head.weight",
                                           "transformer.h.1.ln_1.weight": "lm_head.weight"})
    with pytest.raises(RuntimeFailure, match="no running mesh"):
        meshplan.transfer(src, dst, method="shm")
    with pytest.raises(RuntimeFailure, match="pass a step made by meshplan.distribute"):
        meshplan.transfer(src_fn, dst)
