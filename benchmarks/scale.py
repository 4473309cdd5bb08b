"""Scale table (issue 20, point 5): published LLaMA-3 runs without pipeline stages, next to
what meshplan's planner does with the same model, batch, precision and GPUs.

    python benchmarks/scale.py [--only 8b] [--time-limit 120] [--cache DIR]
    python benchmarks/scale.py --pipeline [--only 405b]     # the runs with pipeline stages

For each run: the published layout and measured step time (tokens per step per GPU divided by
the published tokens/s/GPU), and the planner's automatic plan for the same step (traced on the
meta device; FSDP2-style bf16 mixed precision, ``precision="bf16"``; AdamW; the memory limit
of the GPU): its layout, its estimated step time, its peak memory and how long planning took.
The published layout is planned too (the ``fsdp`` family with the published recompute policy)
so the two estimates can be compared under one cost model.

With ``--pipeline``: the published runs that use pipeline stages (LLaMA-3 405B on 8,192 and
16,384 H100s, Megatron-LM's 1T GPT on 3,072 A100s), planned by ``plan_pipeline`` on the
published mesh (its ``pp`` size as given; the schedule, micro-batches, stage split and every
stage's layouts chosen), next to the step time the paper's TFLOP/s per GPU implies (its own
FLOP count per step over TFLOP/s x GPUs).

Estimates come from the cost model (roofline compute at each datasheet's dense peak, alpha-beta
collectives), not from runs; where they miss the measured step the table says which cost the
model leaves out instead of tuning constants to hit the number.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from dataclasses import dataclass

import meshplan
from meshplan.examples import llama
from meshplan.frontend._precision import precision as mixed_precision
from meshplan.ir import Graph, Role
from meshplan.planner import PlanError, plan_graph, plan_pipeline
from meshplan.planner._placement import Shard

LLAMA3_70B = llama.LlamaConfig(vocab_size=128256, seq_len=8192, n_layer=80, d_model=8192,
                               n_head=64, n_kv_head=8, hidden=28672, batch_size=1,
                               rope_theta=500000.0)
LLAMA3_8B = dataclasses.replace(llama.PRESETS["llama3_8b"], seq_len=8192, batch_size=1)

TITAN_A100 = ("torchtitan docs/performance.md (Llama 3 on 64 A100 80GB, FSDP2, bf16, "
              "sequence 8192)")
TITAN_H100 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1, H100 96GB "
              "HBM2e at 500 W, 400 Gb/s per GPU, sequence 8192)")


@dataclass(frozen=True)
class Published:
    """A published run: the model, its mesh and GPUs, and each data-parallel rank's batch."""

    name: str
    config: llama.LlamaConfig
    mesh: dict[str, int]
    topology: str
    local_batch: int            # sequences per data-parallel rank

    @property
    def dp(self) -> int:
        return self.mesh.get("dp", 1)

    @property
    def gpus(self) -> int:
        return math.prod(self.mesh.values())


@dataclass(frozen=True)
class Run(Published):
    recompute: str              # the published activation checkpointing
    tokens_per_s_per_gpu: float
    layout: str                 # as published
    source: str
    notes: str = ""
    family: str | None = "fsdp"  # the hand family that is the published layout, if one is

    @property
    def measured_step_s(self) -> float:
        tokens_per_gpu = self.local_batch * self.dp * self.config.seq_len / self.gpus
        return tokens_per_gpu / self.tokens_per_s_per_gpu


RUNS = [
    Run("llama3-8b", LLAMA3_8B, {"dp": 64}, "a100", 1, "selective", 2973,
        "FSDP 64, selective (op) AC", TITAN_A100),
    Run("llama3-70b", LLAMA3_70B, {"dp": 64}, "a100", 1, "full", 331,
        "FSDP 64, full AC", TITAN_A100),
    Run("llama3.1-8b", LLAMA3_8B, {"dp": 8}, "h100", 2, "selective", 5762,
        "FSDP 8, selective AC (Table 1, no compile)", TITAN_H100,
        "H100 at 500 W: the h100 preset's 989 TFLOP/s is the 700 W SXM figure"),
    Run("llama3.1-8b", LLAMA3_8B, {"dp": 128}, "h100", 2, "selective", 5605,
        "FSDP 128, selective AC (Table 3, no compile)", TITAN_H100,
        "H100 at 500 W, as above"),
    Run("llama3.1-70b", LLAMA3_70B, {"dp": 32, "tp": 8}, "h100", 16, "full", 829,
        "FSDP 32 x TP 8, full AC, torch.compile, Float8 (Table 4)", TITAN_H100,
        "H100 at 500 W; Float8 linears and torch.compile are not modelled (priced as bf16); "
        "FSDP+TP is not a hand family here, so only the automatic plan is shown",
        family=None),
]


# ---- pipeline runs (issue 24, point 5) ----------------------------------------------------

LLAMA3_405B = llama.LlamaConfig(vocab_size=128256, seq_len=8192, n_layer=126, d_model=16384,
                                n_head=128, n_kv_head=8, hidden=53248, batch_size=1,
                                rope_theta=500000.0)
# Megatron-LM's 1T GPT (Narayanan et al. 2021, Table 1: 128 layers, hidden 25600, 160 heads,
# sequence 2048, vocabulary 51200) as a LLaMA-style stand-in: the same width, depth and heads,
# a SwiGLU MLP of hidden 8d/3 (its 3 matrices hold the 8d^2 parameters and FLOPs of GPT's two
# 4d ones), RMSNorm and rotary positions instead of LayerNorm and learned ones
GPT_1T = llama.LlamaConfig(vocab_size=51200, seq_len=2048, n_layer=128, d_model=25600,
                           n_head=160, n_kv_head=160, hidden=68264, batch_size=1)
LLAMA3_PAPER = ("The Llama 3 Herd of Models (Meta, 2024), Table 4: 405B on H100 80GB, sequence "
                "8192, 16M tokens per batch")
MEGATRON_2021 = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU "
                 "Clusters Using Megatron-LM (SC 2021), Table 1")


@dataclass(frozen=True)
class PipelineRun(Published):
    tflops_per_gpu: float       # as published
    flops: str                  # how the paper counts them: "model" or "megatron" (eq. 3)
    layout: str
    source: str
    notes: str = ""

    def flops_per_step(self, params: int) -> float:
        """The paper's FLOPs per step: Meta's MFU counts model FLOPs, 6 N per token plus
        causal attention's 6 L s d; Megatron-LM counts its formula (3), recomputation
        included: 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
        c = self.config
        batch = self.local_batch * self.dp
        if self.flops == "megatron":
            s, lay, h, v = c.seq_len, c.n_layer, c.d_model, c.vocab_size
            return 96 * batch * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))
        return batch * c.seq_len * (6 * params + 6 * c.n_layer * c.seq_len * c.d_model)

    def measured_step_s(self, params: int) -> float:
        return self.flops_per_step(params) / (self.tflops_per_gpu * 1e12 * self.gpus)


PIPELINE_RUNS = [
    PipelineRun("llama3-405b", LLAMA3_405B, {"pp": 16, "dp": 64, "tp": 8}, "h100", 32, 430,
                "model", "TP 8, CP 1, PP 16, DP 64 (8,192 GPUs), 43% MFU", LLAMA3_PAPER),
    PipelineRun("llama3-405b", LLAMA3_405B, {"pp": 16, "dp": 128, "tp": 8}, "h100", 16, 400,
                "model", "TP 8, CP 1, PP 16, DP 128 (16,384 GPUs), 41% MFU", LLAMA3_PAPER),
    PipelineRun("megatron-1t", GPT_1T, {"pp": 64, "dp": 6, "tp": 8}, "a100", 512, 163,
                "megatron", "TP 8, PP 64, DP 6, interleaved 1F1B, full recompute (batch 3072)",
                MEGATRON_2021, "a LLaMA-style stand-in of the same size (see GPT_1T)"),
]


def run_pipeline(run: PipelineRun, time_limit: float, cache: str | None = None
                 ) -> dict[str, object]:
    t0 = time.perf_counter()
    graph = _trace(run, cache)
    row: dict[str, object] = {"run": run, "trace_s": time.perf_counter() - t0,
                              "params": graph.num_params()}
    t1 = time.perf_counter()
    try:
        plan = plan_pipeline(graph, run.mesh, topology=run.topology, time_limit_s=time_limit)
        row["plan"] = plan
    except PlanError as e:
        row["error"] = str(e)[:300]
    row["plan_s"] = time.perf_counter() - t1
    return row


def pipeline_markdown(rows: list[dict[str, object]]) -> str:
    out = ["| run | GPUs | published layout | measured step (s) | planner: schedule, inner "
           "layout | est. (s) | est./measured | bubble (s) | peak GiB | plan s | trace s |",
           "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        run = r["run"]
        assert isinstance(run, PipelineRun)
        measured = run.measured_step_s(int(r["params"]))
        plan = r.get("plan")
        if plan is None:
            cells = (f"no plan: {r['error']}", "-", "-", "-", "-")
        else:
            what = (f"{plan.schedule}, {plan.microbatches} micro-batches"
                    + (f", {plan.virtual_stages} chunks/device" if plan.virtual_stages > 1
                       else "") + f"; {layout_of(plan.inner)}")
            cells = (what, f"{plan.estimated_step_time_s:.3f}",
                     f"{plan.estimated_step_time_s / measured:.2f}", f"{plan.bubble_s:.3f}",
                     f"{plan.peak_memory_bytes / 2**30:.1f}"
                     + ("" if plan.fits else " (no fit)"))
        out.append(f"| {run.name} {run.topology} | {run.gpus} | {run.layout} | {measured:.3f} | "
                   f"{' | '.join(cells)} | {r['plan_s']:.1f} | {r['trace_s']:.1f} |")
    return "\n".join(out)


def _trace(run: Published, cache: str | None = None):
    cfg = dataclasses.replace(run.config, batch_size=run.local_batch * run.dp)
    path = None
    if cache:
        key = f"{cfg.n_layer}x{cfg.d_model}-b{cfg.batch_size}-s{cfg.seq_len}"
        path = os.path.join(cache, f"llama-{key}-bf16.json")
        if os.path.exists(path):
            return Graph.load(path)
    ex = llama.build(cfg, optimizer="adamw", device="meta")
    with mixed_precision("bf16"):
        graph = meshplan.trace(ex.step, *ex.batch(0)).graph
    if path:
        os.makedirs(cache, exist_ok=True)
        graph.save(path)
    return graph


def layout_of(plan) -> str:  # noqa: ANN001
    """The plan's family in words: how parameters and the batch are split, what recomputes."""
    names = plan.mesh.names
    params = [n for n in plan.graph.inputs if n.meta.role is Role.PARAM]
    layouts = plan.input_layouts
    sharded = {a for n in params for a, p in zip(names, layouts[n.target])
               if isinstance(p, Shard)}
    # how the tokens are split: the activation operand of the forward matrix products
    # (batch x sequence flattened to dim 0), as most of them have it
    graph = plan.graph
    votes: dict[tuple[str, ...], int] = {}
    for p in plan.placements:
        node = graph.node(p.node)
        arg = {"aten.mm.default": 0, "aten.addmm.default": 1}.get(p.target)
        if arg is not None and node.phase.value == "forward" and p.inputs[arg]:
            axes = tuple(a for a, q in zip(names, p.inputs[arg]) if isinstance(q, Shard)
                         and q.dim == 0)
            votes[axes] = votes.get(axes, 0) + 1
    batch = list(max(votes, key=votes.get)) if votes else []
    parts = [f"params sharded over {','.join(sorted(sharded)) or 'nothing'}",
             f"tokens over {','.join(batch) or 'nothing'}"]
    if plan.recompute is not None:
        parts.append(f"{plan.recompute[0]} recompute on {len(plan.recompute[1])} layers")
    else:
        parts.append("no recompute")
    return "; ".join(parts)


def state_comm_s(plan) -> float:  # noqa: ANN001
    """Seconds of the plan's collectives that move state: parameters (or their 16-bit copies)
    gathered for a use, gradients reduced for the update. FSDP2 prefetches the first and
    reduces the second in the background, under compute; the cost model adds them."""
    graph = plan.graph
    total = 0.0
    for r in plan.redistributions:
        node = graph.node(r.value.split("[")[0])
        src = node
        while src.kind.value == "op" and src.target == "aten._to_copy.default":
            src = graph.node(next(src.refs()).node)
        consumer = graph.node(r.consumer) if r.consumer in graph else None
        is_param = src.kind.value == "input" and src.meta.role is Role.PARAM
        to_update = r.consumer.startswith("<state") or (
            consumer is not None and consumer.phase.value == "update")
        if is_param or to_update:
            total += r.time_s * r.count
    return total


def run_one(run: Run, time_limit: float, cache: str | None = None) -> dict[str, object]:
    t0 = time.perf_counter()
    graph = _trace(run, cache)
    trace_s = time.perf_counter() - t0
    row: dict[str, object] = {"run": run, "trace_s": trace_s}
    tries: list[tuple[str, dict]] = [("auto", {"strategy": "auto"})]
    if run.family:
        tries.append(("published", {"strategy": run.family, "recompute": run.recompute}))
    else:
        row["published"] = {"error": "no hand family", "plan_s": 0.0}
    for key, kwargs in tries:
        t1 = time.perf_counter()
        try:
            plan = plan_graph(graph, run.mesh, topology=run.topology, time_limit_s=time_limit,
                              **kwargs)
            row[key] = {"step_s": plan.estimated_step_time_s, "comm_s": plan.comm_time_s,
                        "peak_gib": plan.peak_memory_bytes / 2**30, "fits": plan.fits,
                        "layout": layout_of(plan), "gap": plan.solver.get("mip_gap"),
                        "state_comm_s": state_comm_s(plan), "compute_s": plan.compute_time_s,
                        "plan_s": time.perf_counter() - t1}
        except PlanError as e:
            row[key] = {"error": str(e)[:200], "plan_s": time.perf_counter() - t1}
    return row


def markdown(rows: list[dict[str, object]]) -> str:
    out = ["| run | GPUs | published layout | measured step (s) | planner's layout (auto) | "
           "auto est. (s) | est./measured | with state comm overlapped (s) | ratio | "
           "published layout est. (s) | peak GiB (auto) | plan s (auto) | trace s |",
           "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        run, a, p = r["run"], r["auto"], r["published"]
        assert isinstance(run, Run) and isinstance(a, dict) and isinstance(p, dict)
        measured = run.measured_step_s
        if "error" in a:
            auto = (f"no plan: {a['error']}", "-", "-", "-", "-", "-")
        else:
            hidden = min(a["state_comm_s"], a["compute_s"])
            overlapped = a["step_s"] - hidden
            auto = (a["layout"], f"{a['step_s']:.3f}", f"{a['step_s'] / measured:.2f}",
                    f"{overlapped:.3f}", f"{overlapped / measured:.2f}",
                    f"{a['peak_gib']:.1f}{'' if a['fits'] else ' (no fit)'}")
        pub = "-" if "error" in p else f"{p['step_s']:.3f}" + (
            "" if p["fits"] else f" (does not fit: {p['peak_gib']:.0f} GiB)")
        out.append(f"| {run.name} {run.topology} | {run.gpus} | {run.layout} | {measured:.3f} | "
                   f"{auto[0]} | {auto[1]} | {auto[2]} | {auto[3]} | {auto[4]} | {pub} | "
                   f"{auto[5]} | {a['plan_s']:.1f} | {r['trace_s']:.1f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run only the runs whose name contains this (e.g. 8b)")
    ap.add_argument("--time-limit", type=float, default=120.0, help="solver seconds per solve")
    ap.add_argument("--cache", help="a folder to keep traced graphs in between runs")
    ap.add_argument("--pipeline", action="store_true",
                    help="the runs with pipeline stages (issue 24) instead")
    args = ap.parse_args()
    if args.pipeline:
        _table(PIPELINE_RUNS, run_pipeline, pipeline_markdown, args,
               lambda row: row["plan"].summary() if "plan" in row else None,
               (LLAMA3_PAPER, MEGATRON_2021))
    else:
        _table(RUNS, run_one, markdown, args, lambda row: None, (TITAN_A100, TITAN_H100))


def _table(runs, plan_one, table, args, detail, sources) -> None:  # noqa: ANN001
    """Plan each run (a row printed as it is done, with ``detail``), then the whole table,
    the runs' notes and the sources."""
    rows = []
    for run in runs:
        if args.only and args.only not in run.name:
            continue
        rows.append(plan_one(run, args.time_limit, args.cache))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        more = detail(rows[-1])
        if more:
            print(more, flush=True)
    print()
    print(table(rows))
    for run in runs:
        if run.notes and (not args.only or args.only in run.name):
            print(f"- {run.name} {run.topology} x{run.gpus}: {run.notes}")
    print("Sources:", " ; ".join(sources))

if __name__ == "__main__":
    main()
