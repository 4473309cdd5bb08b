"""The ``meshplan`` command line. Subcommands grow with the pipeline; each prints one clear
error line (what, where, how to fix) and exits non-zero instead of a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable, Sequence

from ._errors import MeshplanError

# what ``meshplan --help`` says above the commands (whole sentences, not the docstring's first
# line)
DESCRIPTION = ("meshplan traces an ordinary PyTorch training step into one graph, plans how to "
               "shard it across a device mesh, runs the plan on local worker processes and "
               "records what every rank did. Every command reports a mistake as one error line "
               "(what, where, how to fix) and exits non-zero, without a traceback.")


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, stderr=stderr)


def load_target(spec: str) -> tuple[Callable[..., Any], tuple]:
    """``path/to/file.py:NAME`` -> (the step function, its example inputs).

    Example inputs come from ``NAME.example_inputs`` or the file's module-level
    ``example_inputs`` (a tuple, or a zero-argument callable returning one).
    """
    from ._cli_run import example_inputs, load_step

    module, fn, name = load_step(spec)
    return fn, example_inputs(module, fn, name, None)


# ---- commands ------------------------------------------------------------------------------

def cmd_trace(args: argparse.Namespace) -> int:
    import meshplan

    fn, example = load_target(args.target)
    traced = meshplan.trace(fn, *example)
    traced.graph.save(args.out)
    g = traced.graph
    _console().print(f"traced {g.info.name}: {len(g.nodes)} nodes, {g.num_params():,} parameters "
                     f"-> {args.out}")
    return 0


def cmd_ir_show(args: argparse.Namespace) -> int:
    from .ir import Graph, summarize

    graph = Graph.load(args.graph)
    s = summarize(graph, top=args.top)
    if args.json:
        print(json.dumps(_summary_dict(s), indent=2))
        return 0
    print_summary(s, graph=graph)
    return 0


def _summary_dict(s: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(s)


def _fmt_count(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def print_summary(s: Any, console: Any = None, graph: Any = None) -> None:
    """Print ``ir.summarize``'s facts; with the ``graph`` they were taken from, the largest
    activations also say their phase (and a backward value is not labelled with its forward's
    function)."""
    from rich.table import Table

    console = console or _console()
    console.print(f"[bold]{s.name}[/bold]: {sum(c for _, c in s.nodes_by_kind)} nodes "
                  f"({', '.join(f'{c} {k}' for k, c in s.nodes_by_kind)}), "
                  f"{s.num_params:,} parameters, {_fmt_count(s.flops)}FLOP per step "
                  f"({', '.join(f'{p} {_fmt_count(f)}' for p, f in s.flops_by_phase)}), "
                  f"{_fmt_count(s.bytes_moved)}B moved")
    roles = Table(title="inputs by role")
    for col in ("role", "tensors", "bytes"):
        roles.add_column(col, justify="right" if col != "role" else "left")
    for role, count, nbytes in s.inputs_by_role:
        roles.add_row(role, str(count), _fmt_count(nbytes))
    console.print(roles)
    ops = Table(title="ops")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, count in s.ops[:15]:
        ops.add_row(op, str(count))
    if len(s.ops) > 15:
        ops.add_row(f"... {len(s.ops) - 15} more", str(sum(c for _, c in s.ops[15:])))
    console.print(ops)
    acts = Table(title="largest activations")
    for col in ("node", "op", "phase", "shape", "bytes", "source"):
        acts.add_column(col)
    for v in s.largest_activations:
        phase, where = _phase_and_source(graph, v.node, v.where)
        acts.add_row(v.node, v.target, phase, f"{v.dtype}{list(v.shape)}", _fmt_count(v.nbytes),
                     where)
    console.print(acts)


def _phase_and_source(graph: Any, node: str, where: str) -> tuple[str, str]:
    """A value's phase and its source as people should read it: a backward node carries the
    ``file:line`` of the forward call it differentiates (whose function is usually
    ``forward``), so it reads "backward of FILE:LINE", not "FILE:LINE in forward"."""
    if graph is None or node not in graph:
        return "-", where
    n = graph.node(node)
    src = n.source
    if src is None:
        return n.phase.value, where
    if n.phase.value == "backward":
        return "backward", f"backward of {src.file}:{src.line}"
    return n.phase.value, str(src)


def cmd_demo(args: argparse.Namespace) -> int:
    from .examples.demo import run_demo

    return run_demo(steps=args.steps, console=_console())


def cmd_calibrate(args: argparse.Namespace) -> int:
    from ._errors import PlanError
    from .planner._calibrate import QUICK_SIZES, calibration_tables, measure

    folder = os.path.dirname(os.path.abspath(args.out or "."))
    if not os.path.isdir(folder):                     # say so before measuring, not after
        raise PlanError(f"--out {args.out}: folder {folder} does not exist; create it first")
    console = _console(stderr=args.json)
    if args.from_telemetry:
        return _calibrate_from_telemetry(args, console)
    quick = {"sizes": QUICK_SIZES, "repeats": 2} if args.quick else {}
    console.print(f"measuring this machine with {args.world_size} gloo processes over loopback ...")
    cal = measure(args.world_size, timeout_s=args.timeout, **quick)
    if not args.json:
        for table in calibration_tables(cal):
            console.print(table)
    if args.out:
        cal.topology.save(args.out)
        console.print(f"wrote {args.out}; pass its path wherever a topology name is accepted")
    if args.json:
        print(json.dumps({
            "source": "measured", "world_size": cal.world_size, "threads": cal.threads,
            "samples": len(cal.samples), "wall_s": cal.wall_s,
            "links": {str(getattr(k, "value", k)): _link_json(v) for k, v in cal.fits.items()},
            "matmul_sizes": dict(cal.matmul_sizes), "phase_s": dict(cal.phase_s),
            "topology": cal.topology.to_dict(), "out": args.out}, indent=2))
    return 0


def _link_json(link: Any) -> dict[str, Any] | None:
    if link is None:
        return None
    return {"latency_s": link.latency, "bandwidth_bytes_per_s": link.bandwidth,
            "wait_s": link.wait,
            "kinds": [{"kind": k, "bandwidth_bytes_per_s": bw, "latency_s": lat}
                      for k, bw, lat in link.kinds]}


def _calibrate_from_telemetry(args: argparse.Namespace, console: Any) -> int:
    from .planner._calibrate import LINK_SPAN, from_telemetry
    from .planner._summary import format_bytes
    from .telemetry import Store

    with Store.open(args.db) as store:
        fit = from_telemetry(store, args.run, args.topology)
    topo, link, comp = fit.topology, fit.link, fit.compute
    base = repr(topo.name.split("+")[0])
    if link is not None:
        what = ("blocking probes the calibration ran (link_probes)" if fit.probed
                else "measured collectives")
        console.print(f"links fitted to {len(fit.samples)} {what}: latency "
                      f"{link.latency * 1e6:.1f} us, bandwidth {format_bytes(link.bandwidth)}/s")
        for kind, bw, lat in link.kinds:
            console.print(f"  {kind}: latency {lat * 1e6:.1f} us, bandwidth "
                          f"{format_bytes(bw)}/s")
    else:
        console.print(f"links from {base} (the run's collectives do not span {LINK_SPAN}x in "
                      "size, gradient buckets aside, so no link is fitted)")
    if topo.intra_node.wait:
        console.print(f"  a blocking collective waits {topo.intra_node.wait * 1e6:.1f} us more "
                      "for busy ranks to be scheduled (probe_wait)")
    if comp is not None:
        rates = ", ".join(f"{d} {f / 1e9:.1f} GFLOP/s" for d, f in sorted(comp.flops.items()))
        console.print(f"compute fitted to {comp.ops} sampled ops ({comp.measured_s * 1e3:.1f} ms "
                      f"measured, {comp.roofline_s * 1e3:.1f} ms by the fitted roofline before "
                      f"{len(comp.op_factors)} per-op factors): {rates}; memory "
                      f"{format_bytes(comp.memory_bandwidth)}/s; op floor "
                      f"{comp.kernel_floor_s * 1e6:.1f} us")
    else:
        console.print(f"compute numbers from {base} (record at level 'ops' to fit them)")
    if fit.measured_step_s is not None and fit.model_step_s is not None:
        console.print(f"step overhead {topo.step_overhead_s * 1e3:.1f} ms: the run measured "
                      f"{fit.measured_step_s * 1e3:.1f} ms per step, its plan priced on the "
                      f"fitted machine {fit.model_step_s * 1e3:.1f} ms")
    if args.out:
        topo.save(args.out)
        console.print(f"wrote {args.out}; pass its path wherever a topology name is accepted")
    if args.json:
        print(json.dumps({
            "source": "telemetry", "run": args.run, "samples": len(fit.samples),
            "probed": fit.probed, "link": _link_json(link),
            "compute": None if comp is None else {
                "flops_per_s": dict(comp.flops), "memory_bytes_per_s": comp.memory_bandwidth,
                "kernel_floor_s": comp.kernel_floor_s, "ops": comp.ops,
                "measured_s": comp.measured_s, "roofline_s": comp.roofline_s,
                "op_factors": dict(comp.op_factors)},
            "measured_step_s": fit.measured_step_s, "model_step_s": fit.model_step_s,
            "step_overhead_s": topo.step_overhead_s,
            "topology": topo.to_dict(), "out": args.out}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshplan", description=DESCRIPTION)
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("trace", help="trace FILE.py:STEP into an IR graph (JSON)")
    t.add_argument("target", help="FILE.py:NAME of the training step")
    t.add_argument("--out", "-o", required=True, help="where to write the graph JSON")
    t.set_defaults(func=cmd_trace)

    ir = sub.add_parser("ir", help="inspect IR graphs")
    ir_sub = ir.add_subparsers(dest="ir_command", required=True)
    show = ir_sub.add_parser("show", help="summarise a graph: nodes, parameters, FLOPs")
    show.add_argument("graph")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.add_argument("--top", type=int, default=8, help="how many largest activations to list")
    show.set_defaults(func=cmd_ir_show)

    c = sub.add_parser("calibrate", help="measure this machine (compute, memory, gloo links) "
                       "and write it as a topology JSON")
    c.add_argument("--world-size", type=int, default=2, help="local processes to measure with")
    c.add_argument("--out", "-o", help="where to write the topology JSON (atomically)")
    c.add_argument("--quick", action="store_true", help="messages up to 4 MiB, 2 repeats")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    c.add_argument("--json", action="store_true",
                   help="the fitted machine and the fits behind it as JSON (the messages go "
                        "to stderr)")
    c.add_argument("--from-telemetry", action="store_true",
                   help="instead of measuring, fit the machine to a recorded run: links to its "
                   "collectives, compute to its op times (level ops), the step overhead")
    c.add_argument("--db", help="with --from-telemetry: the telemetry store")
    c.add_argument("--run", help="with --from-telemetry: the run (default: the latest)")
    c.add_argument("--topology", help="with --from-telemetry: where the numbers the run did not "
                   "measure come from (default: the run's own topology)")
    c.set_defaults(func=cmd_calibrate)

    d = sub.add_parser("demo", help="trace the example GPT step and replay it against eager")
    d.add_argument("--steps", type=int, default=5)
    d.set_defaults(func=cmd_demo)

    from ._cli_files import add_files_commands
    from ._cli_k8s import add_k8s_commands
    from ._cli_plan import add_plan_commands
    from ._cli_run import add_run_commands
    from ._cli_sandbox import add_sandbox_commands
    from ._cli_telemetry import add_telemetry_commands
    add_run_commands(sub)
    add_plan_commands(sub)
    add_files_commands(sub)
    add_telemetry_commands(sub)
    add_sandbox_commands(sub)
    add_k8s_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MeshplanError as e:
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
