"""Pipeline stages (issue 24, point 6): meshplan's stages next to a hand-written
``torch.distributed.pipelining`` run of the same model, micro-batches and ranks.

    python benchmarks/pipeline.py [--pp 2] [--microbatches 4] [--steps 8] [--warmup 2]
                                  [--rounds 2] [--only torch-gpipe,torch-1f1b,meshplan-1f1b]
                                  [--chunks 2]

The GPT example of ``benchmarks/step_time.py`` (d_model 256, 4 layers, 4 heads, vocab 2048,
seq 64, global batch 16, AdamW, gradient clipping at 1.0), on ``pp`` CPU processes, the same
global batches for every variant:

- ``torch-gpipe`` / ``torch-1f1b`` / ``torch-interleaved``:
  ``torch.distributed.pipelining``'s ``PipelineStage`` with ``ScheduleGPipe`` /
  ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (``--chunks`` stages per rank, stage ``k``
  on rank ``k % pp``) on gloo, the stages written by hand as torchtitan does: the layers
  split evenly, the embeddings with the first stage, the final norm and the head with the
  last. The GPT ties its head to its token embedding, which torch's stages cannot share:
  the last stage holds a copy, and after the backward the two halves of its gradient are
  summed between the first and the last stage (one all-reduce, as Megatron does).
  Gradient clipping takes the norm over every stage (one all-reduce of the squared sums).
- ``meshplan-gpipe`` / ``meshplan-1f1b`` / ``meshplan-interleaved`` / ``meshplan-zb-h1``:
  ``meshplan.distribute(step, mesh={"pp": P}, microbatches=M, schedule=...)``: the user's
  unchanged step, the stages planned by ``plan_pipeline`` (for interleaved, the chunks per
  device too: with the benchmark's 4 layers on 2 ranks, 2, as ``--chunks``). torch has no
  ZB-H1 (its zero-bubble schedules, ``ScheduleInterleavedZeroBubble`` and
  ``ScheduleZBVZeroBubble``, hold several stages per rank): ``meshplan-zb-h1`` is set against
  torch's 1F1B, the schedule it improves on.
- ``meshplan-1f1b-mpi`` / ``meshplan-1f1b-mpi-rma``: 1F1B under ``launcher="mpi"`` (mpiexec),
  the stages' transfers MPI's sends and receives, or one-sided puts into the receiver's
  window (``MESHPLAN_STAGE_TRANSFERS=rma``, ``backends/_rma.py``'s ``Mailbox``).

Times: the baselines time each step on every rank after a barrier and keep the slowest;
meshplan is timed around each call on the controller (split the batch, the round trip,
the loss), and in its workers by ``step_time``'s plugin. Memory: each rank's peak RSS growth
(``VmHWM`` less the RSS before the model was built). ``--rounds R`` runs the list R times,
so that a slow minute of a shared machine hits every variant alike. The last loss of every
variant is printed: all run the same global batch, so they agree to float32 summation order.
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshplan
from meshplan.backends._pipeline_run import STAGE_TRANSFERS
from meshplan.benchmarks.step_time import (CLIP, CONFIG, SEED, TIMEOUT_S, Result, _batches,
                                           _free_port, _rss_kib, _threads, measure_mesh,
                                           spawn_ranks)
from meshplan.examples import gpt
from meshplan.examples._common import decay_groups, make_optimizer

VARIANTS = ("torch-gpipe", "torch-1f1b", "torch-interleaved", "meshplan-gpipe", "meshplan-1f1b",
            "meshplan-interleaved", "meshplan-zb-h1", "meshplan-1f1b-mpi",
            "meshplan-1f1b-mpi-rma")


class _Stage(nn.Module):
    """Stage ``s`` of ``p`` (virtual stages, under interleaved) of the example GPT, by hand:
    its share of the blocks, the embeddings on the first stage, the final norm and the head on
    the last (with its own copy of the tied weight)."""

    def __init__(self, model: nn.Module, s: int, p: int) -> None:
        super().__init__()
        tr, n = model.transformer, len(model.transformer["h"])
        lo, hi = s * n // p, (s + 1) * n // p
        self.first, self.last = s == 0, s == p - 1
        self.blocks = nn.ModuleList(tr["h"][lo:hi])
        if self.first:
            self.wte, self.wpe = tr["wte"], tr["wpe"]
        if self.last:
            self.ln_f = tr["ln_f"]
            self.head = nn.Linear(tr["wte"].weight.shape[1], tr["wte"].weight.shape[0],
                                  bias=False)
            self.head.weight = nn.Parameter(tr["wte"].weight.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], dtype=torch.long)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def _loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _torch_rank(rank: int, schedule: str, p: int, m: int, v: int, port: int, threads: int,
                skip: int, steps: int, out: Any) -> None:
    """One rank of the ``torch.distributed.pipelining`` baseline (spawned): its stage, or
    under interleaved its ``v`` stages ``rank``, ``rank + p``, ..."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)

    faulthandler.dump_traceback_later(TIMEOUT_S - 5)
    base = _rss_kib("VmRSS")
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=p)
    tied = dist.new_group([0, p - 1]) if p > 1 else None
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=CLIP, seed=SEED)
    v = v if schedule == "torch-interleaved" else 1
    n = p * v
    mods = [_Stage(ex.model, k, n) for k in range(rank, n, p)]
    first = mods[0] if mods[0].first else None
    last = mods[-1] if mods[-1].last else None
    mod = nn.ModuleList(mods)
    opt = make_optimizer(decay_groups(mod, 0.1), "adamw", foreach=False, lrs=gpt._LR)
    stages = [PipelineStage(md, k, n, torch.device("cpu"))
              for md, k in zip(mods, range(rank, n, p))]
    if schedule == "torch-interleaved":
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=_loss)
    else:
        kind = ScheduleGPipe if schedule == "torch-gpipe" else Schedule1F1B
        sched = kind(stages[0], m, loss_fn=_loss)
    params = [q for q in mod.parameters()]
    times, loss = [], torch.zeros(())
    for i, (x, y) in enumerate(_batches(skip + steps)):
        dist.barrier()
        t0 = time.perf_counter()
        losses: list[Tensor] = []
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=losses)
        else:
            sched.step()
        if tied is not None:                    # the tied weight's two halves, summed
            w = first.wte.weight if rank == 0 else last.head.weight if rank == p - 1 else None
            if w is not None:
                dist.all_reduce(w.grad, group=tied)
        # clipping by the whole model's norm: the tied weight counted once (on stage 0)
        own = [q for q in params if not (last is not None and p > 1 and q is last.head.weight)]
        sq = torch.stack([q.grad.pow(2).sum() for q in own if q.grad is not None]).sum()
        dist.all_reduce(sq)
        coef = torch.clamp(CLIP / (sq.sqrt() + 1e-6), max=1.0)
        for q in params:
            if q.grad is not None:
                q.grad.mul_(coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= skip:
            times.append(time.perf_counter() - t0)
        if losses:
            loss = torch.stack(losses).mean().detach()
    out.put({"rank": rank, "times": times, "rss": _rss_kib(), "base": base,
             "loss": float(loss)})
    dist.destroy_process_group()


def run_torch(schedule: str, p: int, m: int, v: int, skip: int, steps: int) -> Result:
    port, threads = _free_port(), _threads(p)
    reps = spawn_ranks(schedule, p, _torch_rank,
                       lambda q: (schedule, p, m, v, port, threads, skip, steps, q))
    if isinstance(reps, Result):
        return reps
    return Result(variant=schedule, ranks=p,
                  step_s=tuple(max(ts) for ts in zip(*(r["times"] for r in reps))),
                  rss_kib=tuple(r["rss"] for r in reps), base_kib=tuple(r["base"] for r in reps),
                  loss=reps[-1]["loss"])


def run_meshplan(variant: str, p: int, m: int, v: int, warmup: int, steps: int) -> Result:
    ex = gpt.build(config=CONFIG, optimizer="adamw", clip=CLIP, seed=SEED)
    batches = _batches(2 + warmup + steps)
    words = variant.split("-")
    step = meshplan.distribute(ex.step, mesh={"pp": p}, microbatches=m, topology="cpu",
                               schedule="-".join(w for w in words[1:] if w not in ("mpi", "rma")),
                               example_inputs=batches[0], timeout_s=TIMEOUT_S, telemetry=False,
                               launcher="mpi" if "mpi" in words else "local")
    r = measure_mesh(step, batches, warmup, variant, p,
                     env={STAGE_TRANSFERS: "rma" if "rma" in words else "p2p"})
    got = step.pipeline
    if not r.error and variant.endswith("interleaved") and got.virtual_stages != v:
        return Result(variant=variant, ranks=p, error=f"planned {got.virtual_stages} chunks "
                      f"per device, not --chunks {v}")
    return r


def _merge(a: Result | None, b: Result) -> Result:
    if a is None or a.error or b.error:
        return b if a is None or b.error else a
    return replace(a, step_s=a.step_s + b.step_s, worker_s=a.worker_s + b.worker_s,
                   rss_kib=tuple(max(x, y) for x, y in zip(a.rss_kib, b.rss_kib)),
                   round_s=a.round_s + b.round_s, loss=b.loss)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=2, help="stages per rank, interleaved")
    ap.add_argument("--only", default=",".join(VARIANTS))
    args = ap.parse_args()
    only = [v.strip() for v in args.only.split(",") if v.strip()]
    bad = [v for v in only if v not in VARIANTS]
    if bad:
        sys.exit(f"--only: unknown {bad}; choose from {list(VARIANTS)}")
    p, m = args.pp, args.microbatches
    results: dict[str, Result] = {}
    for rnd in range(args.rounds):
        for v in only:
            if v.startswith("meshplan"):
                r = run_meshplan(v, p, m, args.chunks, args.warmup, args.steps)
            else:
                r = run_torch(v, p, m, args.chunks, 2 + args.warmup, args.steps)
            if not r.error:
                r = replace(r, round_s=(statistics.median(r.step_s),))
            results[v] = _merge(results.get(v), r)
            said = r.error or f"{statistics.median(r.step_s) * 1e3:.1f} ms"
            print(f"  round {rnd + 1}: {v}: {said}", file=sys.stderr, flush=True)
    ref_name = next((v for v in ("torch-1f1b", "torch-gpipe") if v in results), None)
    ref = results.get(ref_name) if ref_name else None
    print(f"GPT {CONFIG}, AdamW, clip {CLIP}; pp={p}, {m} micro-batches, interleaved with "
          f"{args.chunks} chunks per rank; median of "
          f"{args.steps} steps after {args.warmup + 2}, {args.rounds} rounds")
    print(f"| variant | step (median) | x {ref_name or '-'} (rounds) | in workers | peak RSS "
          "growth per rank | last loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for v, r in results.items():
        if r.error:
            print(f"| {v} | {r.error} | | | | |")
            continue
        med = statistics.median(r.step_s)
        ratio = ""
        if ref is not None and not ref.error:
            rounds = [a / b for a, b in zip(r.round_s, ref.round_s)]
            ratio = (f"{med / statistics.median(ref.step_s):.2f}x "
                     f"({min(rounds):.2f}-{max(rounds):.2f})")
        work = f"{statistics.median(r.worker_s) * 1e3:.1f} ms" if r.worker_s else ""
        growth = " / ".join(f"{(a - b) / 1024:.0f}" for a, b in zip(r.rss_kib, r.base_kib))
        print(f"| {v} | {med * 1e3:.1f} ms | {ratio} | {work} | {growth} MiB | "
              f"{r.loss:.6f} |")


if __name__ == "__main__":
    main()
