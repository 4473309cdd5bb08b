"""The planner's memory model against the memory the lowered programs hold.

Each plan's program runs one step on 2 thread ranks, its tensor storage counted as it runs
(``backends/_live.py``: distinct storages of its values and copies, views counted once), and
the largest rank's peak is compared with ``Plan.peak_memory_bytes``.

- A wide MLP (two 1024 x 4096 linears, SGD, batch 8): weights and gradients dominate and
  every term of the model is exact, so the peaks agree to 1 %: data parallel holds the
  weights and the reduced gradients (64 MiB: each gradient's unreduced original is dropped
  where its bucket's all-reduce starts), FSDP its shards, a gathered weight and gradient
  pieces (40.4 MiB), Megatron's split shards and their own gradients (64.2 MiB).
- The example GPT (2 layers, d_model 128, AdamW, clipping) under every family and ``auto``:
  the issue's +-10 % (measured: -1 % to +5.4 %; the rest is the gradient buckets' flat
  buffers, which the model counts as their members' copies).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import meshplan
from meshplan.backends import StepRNG, ThreadMesh
from meshplan.backends._live import Counter
from meshplan.backends._lower import lower, run, split_inputs
from meshplan.examples import gpt
from meshplan.planner import plan_graph


class _Peak:
    """A ``run`` observer that only counts the program's tensor memory."""

    time_ops = False
    track_memory = True

    def __init__(self) -> None:
        self.counter = Counter()

    def memory(self) -> Counter:
        return self.counter

    def compute(self, node, start_s, dur_s) -> None:
        pass

    def reshard(self, ins, first, last) -> None:
        pass

    def vote(self, first, last) -> None:
        pass


def _held(plan, traced, values, batch) -> int:
    """The largest rank's peak over one step of ``plan`` (state pieces of their own, donated,
    as a worker runs them)."""
    graph = plan.graph
    state = [n.target for n in graph.inputs if n.meta.role.value != "data"]
    data = [n.target for n in graph.inputs if n.meta.role.value == "data"]
    world = int(torch.tensor(plan.mesh.sizes).prod())
    programs = [lower(plan, r) for r in range(world)]
    local = [{k: v.clone() for k, v in split_inputs(plan, r, {k: values[k] for k in state}).items()}
             for r in range(world)]
    peaks = [_Peak() for _ in range(world)]
    feed = dict(zip(data, batch))
    ThreadMesh(world, timeout_s=60).run(lambda comm: run(
        programs[comm.rank], comm, local[comm.rank], split_inputs(plan, comm.rank, feed),
        peaks[comm.rank], donate=True, rng=StepRNG(0, 0)))
    return max(p.counter.peak for p in peaks)


@pytest.mark.timeout(300)
def test_the_wide_mlp_holds_what_each_plan_says() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x, y):  # noqa: ANN001, ANN202
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x, y = torch.randn(8, 1024), torch.randn(8, 1024)
    traced = meshplan.trace(step, x, y)
    values = traced.input_values(x, y)
    for strategy, want_mib in (("dp", 64.0), ("fsdp", 40.4), ("megatron_tp", 64.2)):
        plan = plan_graph(traced.graph, {"tp": 2}, topology="h100", strategy=strategy)
        held = _held(plan, traced, values, (x, y))
        assert held == pytest.approx(plan.peak_memory_bytes, rel=0.01), strategy
        assert held / 2**20 == pytest.approx(want_mib, abs=0.1), strategy


@pytest.mark.timeout(300)
def test_the_gpt_holds_what_each_plan_says_within_ten_percent() -> None:
    ex = gpt.build(optimizer="adamw", config=gpt.GPTConfig(
        vocab_size=512, seq_len=32, n_layer=2, n_head=4, d_model=128, batch_size=8))
    ex.step(*ex.batch(0))                      # the steady step: AdamW holds its state
    traced = meshplan.trace(ex.step, *ex.batch(1))
    values = traced.input_values(*ex.batch(1))
    for mesh, strategy in (({"dp": 2}, "dp"), ({"dp": 2}, "fsdp"), ({"tp": 2}, "megatron_tp"),
                           ({"dp": 2}, "auto")):
        plan = plan_graph(traced.graph, mesh, topology="cpu", strategy=strategy)
        held = _held(plan, traced, values, ex.batch(2))
        assert plan.peak_memory_bytes == pytest.approx(held, rel=0.10), (strategy, held)
