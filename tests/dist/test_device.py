"""``distribute(device=)``: where the ranks compute (``runtime/_distributed.resolve_device``,
``runtime/_handlers._rank_device``).

On this CPU machine: the default and its note in the plan summary, and one clear error for
each device that cannot be had. On a GPU (``gpu``-marked, run by ``tests/gpu/device_check.sh``):
the GPT on two ranks of the one GPU (they share it, so their collectives go through host
memory, ``HostStagedCommunicator``) equals the same step in one process on that GPU.
"""

from __future__ import annotations

import pytest
import torch

import meshplan
from meshplan._errors import RuntimeFailure
from meshplan.examples import gpt
from meshplan.runtime._distributed import resolve_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host's answers")
def test_on_a_host_without_a_gpu() -> None:
    device, note = resolve_device(None, "local")
    assert device == "cpu"
    assert note == "cpu (the default; this host sees no GPU), gloo between ranks"
    with pytest.raises(RuntimeFailure, match=r"device='cuda'\): torch sees no GPU on this host "
                       r"\(torch .*torch.cuda.is_available\(\) is False\); pass device='cpu'"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, device="cuda")
    ex = gpt.build(seed=0)
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", telemetry=False,
                               example_inputs=ex.batch(0))
    assert "device: cpu (the default; this host sees no GPU)" in step.plan.summary()


def test_devices_that_cannot_be_had(monkeypatch) -> None:
    with pytest.raises(RuntimeFailure, match="device='cuda:1'.*pass 'cuda'.*or 'cpu'"):
        resolve_device("cuda:1", "local")
    if not torch.cuda.is_available():    # a login node without a GPU: the ranks' nodes check
        device, note = resolve_device("cuda", "slurm")
        assert device == "cuda" and "the controller sees no GPU, each rank needs one" in note
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeFailure, match="launcher='mpi'.*not CUDA-aware.*'local' or "
                       "'slurm'"):
        resolve_device("cuda", "mpi")
    assert resolve_device(None, "mpi") == (          # a GPU seen, but mpi's default is cpu
        "cpu", "cpu (the default under launcher='mpi', whose MPI takes host memory), MPI "
        "between ranks")


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_two_ranks_on_one_gpu_equal_one_process_on_it() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ex, ref = gpt.build(seed=0), gpt.build(seed=0)
    ref.model.cuda()                  # in place: the optimizer's parameters move with it
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", telemetry=False,
                               device="cuda")
    got, want = [], []
    with step:
        for i in range(3):
            x, y = ex.batch(i)
            got.append(float(step(x, y)))
            want.append(float(ref.step(x.cuda(), y.cuda())))
        assert "device: cuda (as asked" in step.plan.summary()
        step.sync()
    # dp splits the batch: float32 sums in another order than one process (as on CPU,
    # tests/dist/test_distribute.py's tolerances)
    assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(ex.model.parameters(), ref.model.parameters()):
        assert torch.allclose(p, q.cpu(), atol=3e-5)
