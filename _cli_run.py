"""``meshplan compile`` and ``meshplan run``: plans made ahead of time, run later.

A step's file follows the conventions of ``examples/gpt_distributed.py``: ``NAME`` is a
``meshplan.distribute``-decorated step (or a plain step) whose ``example_inputs`` (a tuple or a
zero-argument callable; else the module's ``example_inputs``) gives the shapes to compile for,
and ``batches()`` returns an iterator of argument tuples, one per step, for ``run``.

Every failure is one line on stderr and exit status 1; ``--debug`` also prints the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import itertools
import json
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from ._errors import MeshplanError, PlanError, RuntimeFailure, TraceError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_FT_FLAG = {"auto": None, "on": True, "off": False}    # meshplan run --fault-tolerance


def add_run_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``compile`` and ``run``."""
    c = sub.add_parser("compile", help="trace and plan FILE.py:STEP ahead of time; write the plan")
    c.add_argument("target", help="FILE.py:NAME of the (meshplan.distribute-decorated) step")
    c.add_argument("--mesh", help="AXIS=SIZE,... e.g. dp=2,tp=2 (default: the decorator's)")
    c.add_argument("--topology", help="cpu, h100, or a file from `meshplan calibrate`")
    c.add_argument("--strategy", help="auto (default), dp, fsdp, megatron_tp or megatron_zero")
    c.add_argument("--memory-limit", help="per-device memory, e.g. 70GB or 512MiB")
    c.add_argument("--precision", help="fp32 (as written), bf16 or fp16: FSDP2-style mixed "
                   "precision (16-bit compute copies, fp32 reductions); default: the decorator's")
    c.add_argument("--recompute", choices=("auto", "none", "selective", "full"),
                   help="activation recompute of the repeated layers: auto (the planner decides "
                   "when memory is short), none, selective or full; default: the decorator's")
    c.add_argument("--schedule", choices=("auto", "gpipe", "1f1b", "interleaved", "zb-h1"),
                   help="with a pp mesh axis: the pipeline schedule (default: the "
                   "decorator's, else auto: the fastest that fits)")
    c.add_argument("--microbatches", type=int,
                   help="with a pp mesh axis: micro-batches per step (default: chosen)")
    c.add_argument("--example", help="MOD:FN (or FILE.py:FN) returning the example inputs")
    c.add_argument("--out", "-o", required=True, help="where to write the plan (atomically)")
    c.add_argument("--json", action="store_true", help="print a JSON summary")
    c.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    c.set_defaults(func=_guarded(cmd_compile))

    r = sub.add_parser("run", help="run FILE.py:STEP with a saved plan on local processes")
    r.add_argument("target", help="FILE.py:NAME of the step the plan was compiled from")
    r.add_argument("--plan", required=True, help="a plan written by `meshplan compile`")
    r.add_argument("--precision", help="the --precision the plan was compiled with "
                   "(default: the decorator's)")
    r.add_argument("--steps", type=int, default=1, help="how many steps to run")
    r.add_argument("--mesh", help="the mesh to run on (checked against the plan's)")
    r.add_argument("--launcher", default="local",
                   help="local (default), mpi (mpiexec; pip install 'meshplan[mpi]'), "
                   "slurm (srun, in the allocation this runs in or a new one from salloc) "
                   "or k8s (an Indexed Job's pods; pip install 'meshplan[k8s]')")
    r.add_argument("--hosts", help="with --launcher mpi: where the ranks run, a,b or a:4,b:4 "
                   "or a hostfile (default: $MESHPLAN_HOSTS, else this host)")
    r.add_argument("--slurm", metavar="OPTIONS",
                   help="with --launcher slurm: key=value,... such as nodes=2,partition=gpu,"
                   "time=30 (nodes, partition, time, account, qos, constraint, overcommit, "
                   "wait_s, job_name; args and srun_args: more salloc / srun arguments, "
                   "space-separated)")
    r.add_argument("--k8s", metavar="OPTIONS",
                   help="with --launcher k8s: key=value,... such as image=registry/train:1,"
                   "pods=2,namespace=ml,gpus_per_pod=8,queue=team-a (README, \"Kubernetes\")")
    r.add_argument("--fault-tolerance", choices=tuple(_FT_FLAG),
                   help="auto: on for CPU ranks under local, mpi and slurm (README, \"Fault "
                   "tolerance\"); on; off (default: the decorator's, else auto)")
    r.add_argument("--data", help="MOD:FN (or FILE.py:FN) returning an iterator of argument "
                   "tuples (default: the file's batches())")
    r.add_argument("--db", help="the telemetry store (default: $MESHPLAN_TELEMETRY or "
                   ".meshplan/telemetry.duckdb)")
    r.add_argument("--telemetry", metavar="LEVEL",
                   help="off, steps, collectives (default) or ops")
    r.add_argument("--checkpoint", metavar="FILE",
                   help="start from this checkpoint (written by --save-checkpoint or "
                   "save_checkpoint; any mesh); under mpi it is pushed to every host first")
    r.add_argument("--save-checkpoint", metavar="FILE",
                   help="after the last step, write the whole state here (safetensors, "
                   "atomically)")
    r.add_argument("--json", action="store_true", help="print one JSON line per step")
    r.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    r.set_defaults(func=_guarded(cmd_run))


def _guarded(cmd: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Any failure -> one stderr line and exit status 1 (plus the traceback with --debug)."""
    def run(args: argparse.Namespace) -> int:
        try:
            return cmd(args)
        except Exception as e:   # noqa: BLE001 - the CLI's one line, whatever failed
            if args.debug:
                traceback.print_exc(file=sys.stderr)
            text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            print(f"{type(e).__name__}: {text}", file=sys.stderr, flush=True)
            return 1
    run.__name__ = cmd.__name__
    return run


# ---- compile ---------------------------------------------------------------------------------

def cmd_compile(args: argparse.Namespace) -> int:
    import meshplan

    from ._compile import cuda_regions
    from .frontend._autocast import autocast_for
    from .frontend._precision import precision as mixed_precision
    from .planner import parse_mesh, plan_graph

    mesh = parse_mesh(args.mesh) if args.mesh else None
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise PlanError(f"-o {args.out}: folder {out_dir} does not exist; create it first")
    with _stages() as stage:
        stage(f"importing {args.target}")
        module, fn, name = load_step(args.target)
        example = example_inputs(module, fn, name, args.example)
        step = _unwrap(fn)
        if mesh is None:
            if not isinstance(fn, meshplan.DistributedStep):
                raise PlanError(f"{args.target} is not decorated with meshplan.distribute; "
                                "pass --mesh AXIS=SIZE,... (e.g. --mesh dp=2)")
            mesh = dict(fn.mesh)
        opts = _decorator_options(fn)
        stage("tracing")
        topology = args.topology or opts["topology"]
        with autocast_for(cuda_regions(topology)), \
                mixed_precision(args.precision or opts["precision"]):
            traced = meshplan.trace(step, *example)     # (autocast: a GPU plan without a GPU)
            graph = traced.graph
        if mesh.get("pp", 1) > 1:
            return _compile_pipeline(args, graph, mesh, topology, limit, opts, name, stage)
        if args.schedule or args.microbatches:
            raise PlanError("--schedule and --microbatches are for a mesh with a pp axis "
                            "(pipeline stages), e.g. --mesh pp=2,dp=2")
        stage(f"planning on mesh {_mesh_str(mesh)} (rules, solve)")
        with _quiet_stdout():                         # HiGHS prints its banner on fd 1
            plan = plan_graph(graph, mesh, topology=topology,
                              strategy=args.strategy or opts["strategy"],
                              memory_limit_bytes=limit or opts["memory_limit_bytes"],
                              compare_sharded=True,
                              recompute=args.recompute or opts["recompute"])
        stage(f"writing {args.out}")
        plan.save(args.out)
    summary = {"path": os.path.abspath(args.out), "mesh": dict(plan.mesh.axes),
               "strategy": plan.strategy, "estimated_step_time_s": plan.estimated_step_time_s,
               "peak_memory_bytes": plan.peak_memory_bytes, "fits": plan.fits,
               "fully_replicated": plan.fully_replicated, "graph_hash": plan.graph_hash}
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        _console().print(f"compiled {name} for mesh {plan.mesh} ({plan.strategy}): "
                         f"{plan.estimated_step_time_s * 1e3:.3f} ms/step estimated, peak "
                         f"{plan.peak_memory_bytes / 2**20:.2f} MiB/device, fits={plan.fits} "
                         f"-> {args.out}")
        if plan.fully_replicated:                     # say so, and what sharding would cost
            from .planner._report import plan_report
            from .planner._summary import replication_lines

            for line in replication_lines(plan_report(plan)):
                _console().print(f"  {line}", markup=False)
    if not plan.fits:                                 # a hand family over the limit
        from .planner._summary import format_bytes

        peak, limit = plan.peak_memory_bytes, plan.memory_limit_bytes
        print(f"meshplan compile: warning: this {plan.strategy} plan needs "
              f"{format_bytes(peak)} per device, {format_bytes(peak - limit)} over the "
              f"{format_bytes(limit)} limit, so it will not fit; --strategy auto searches "
              "sharding and activation recompute under the limit, or use a larger mesh or "
              "raise --memory-limit", file=sys.stderr, flush=True)
    return 0


def _compile_pipeline(args: argparse.Namespace, graph, mesh: dict[str, int], topology,
                      limit: int | None, opts: dict, name: str, stage) -> int:
    """``compile`` on a mesh with a ``pp`` axis: the pipeline plan (``plan_pipeline``),
    written as JSON, its stages and its schedule drawn; ``meshplan run`` runs it."""
    from .backends._pipeline_run import RUNS
    from .planner import plan_pipeline

    over = [f"--{k} {given} (the decorator asks {k}={asked!r})" for k, given, asked in (
        ("schedule", args.schedule, opts["schedule"]),
        ("microbatches", args.microbatches, opts["microbatches_asked"]))
        if given not in (None, "auto") and asked is not None and given != asked]
    if over:                 # the plan is written: it may be meant for another decorator
        print(f"warning: {'; '.join(over)}: `meshplan run {args.target} --plan {args.out}` "
              "will refuse this plan for this step; compile without them to follow the "
              "decorator, or change the decorator", file=sys.stderr, flush=True)
    stage(f"planning pipeline stages on mesh {_mesh_str(mesh)} (stage layouts, split, "
          "schedule)")
    with _quiet_stdout():
        plan = plan_pipeline(graph, mesh, topology=topology,
                             strategy=args.strategy or opts["strategy"],
                             schedule=(list(RUNS) if (args.schedule or opts["schedule"])
                                       in (None, "auto") else args.schedule or opts["schedule"]),
                             microbatches=args.microbatches or opts["microbatches_asked"],
                             memory_limit_bytes=limit or opts["memory_limit_bytes"],
                             recompute=args.recompute or opts["recompute"])
    stage(f"writing {args.out}")
    plan.save(args.out)
    if args.json:
        print(json.dumps({"path": os.path.abspath(args.out), "mesh": mesh,
                          "schedule": plan.schedule, "microbatches": plan.microbatches,
                          "virtual_stages": plan.virtual_stages,
                          "estimated_step_time_s": plan.estimated_step_time_s,
                          "peak_memory_bytes": plan.peak_memory_bytes, "fits": plan.fits}),
              flush=True)
        return 0
    print(plan.summary())
    print(plan.schedule_text())
    runs = ("`meshplan run` runs it" if plan.schedule in RUNS else
            f"the ranks run {', '.join(RUNS)} only yet, so `meshplan run` refuses "
            f"{plan.schedule}")
    print(f"compiled {name} as {plan.pp} pipeline stages -> {args.out} ({runs})", flush=True)
    return 0


def parse_size(text: str) -> int:
    """``70GB`` -> 70e9 bytes, ``512MiB`` -> 512 * 2**20, ``1000`` -> 1000."""
    m = _SIZE.match(text)
    if not m:
        raise PlanError(f"--memory-limit {text!r}: expected a size such as 70GB or 512MiB")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


# ---- run -------------------------------------------------------------------------------------

def cmd_run(args: argparse.Namespace) -> int:
    import meshplan

    from .planner import PipelinePlan, Plan, parse_mesh
    from .planner._pipeline import is_pipeline_file

    if args.launcher not in ("local", "mpi", "slurm", "k8s"):
        raise RuntimeFailure(f"launcher {args.launcher!r} is not available; use "
                             "--launcher local, mpi, slurm or k8s")
    if args.k8s and args.launcher != "k8s":
        raise RuntimeFailure("--k8s sets the Kubernetes launcher's options; add --launcher k8s")
    if args.hosts and args.launcher != "mpi":
        raise RuntimeFailure("--hosts places ranks under --launcher mpi; add --launcher mpi")
    if args.slurm and args.launcher != "slurm":
        raise RuntimeFailure("--slurm sets the Slurm launcher's options; add --launcher slurm")
    if args.steps < 1:
        raise RuntimeFailure(f"--steps {args.steps}: run at least one step")
    # a pipeline plan (format meshplan.pipeline-plan) or a plan; truncated, tampered: PlanError
    stages = PipelinePlan.load(args.plan) if is_pipeline_file(args.plan) else None
    plan = Plan.load(args.plan) if stages is None else None
    module, fn, name = load_step(args.target)
    opts = _decorator_options(fn)
    if stages is not None:
        from .backends._pipeline_run import RUNS

        mesh = dict(stages.mesh.axes)
        if args.mesh and parse_mesh(args.mesh) != mesh:
            raise RuntimeFailure(f"--mesh {args.mesh}: {args.plan} holds pipeline stages for "
                                 f"mesh {_mesh_str(mesh)}; drop --mesh or compile again")
        if stages.schedule not in RUNS:
            raise RuntimeFailure(
                f"{args.plan}: pipeline schedule {stages.schedule!r}: the stages run "
                f"{', '.join(RUNS)} only yet; compile with --schedule "
                f"{' or --schedule '.join(RUNS)}")
        asked = [f"{k}={v!r}" for k, v, got in (
            ("microbatches", opts["microbatches_asked"], stages.microbatches),
            ("schedule", opts["schedule"], stages.schedule)) if v is not None and v != got]
        if asked:                # as distribute(plan=) refuses it: the step asks otherwise
            raise RuntimeFailure(
                f"{args.plan} runs {stages.schedule} with {stages.microbatches} micro-batches, "
                f"but {name}'s decorator asks {', '.join(asked)}: compile it again without "
                "--schedule / --microbatches (compile then takes the decorator's), or change "
                "the decorator")
        opts["microbatches"] = stages.microbatches
        chosen = {"plan": stages}
    elif args.mesh:
        mesh = parse_mesh(args.mesh)
    elif isinstance(fn, meshplan.DistributedStep):
        mesh = dict(fn.mesh)
    else:
        mesh = dict(plan.mesh.axes)
    if plan is not None:
        plan.check_compatible(mesh=mesh)              # before tracing: the cheap checks first
        chosen = {"plan": plan}
    data = _data(module, args.target, args.data)
    example = example_inputs(module, fn, name, None)
    step = meshplan.distribute(_unwrap(fn), mesh=mesh, **chosen, example_inputs=example,
                               launcher=args.launcher, hosts=args.hosts or None,
                               slurm=args.slurm or None, k8s=args.k8s or None,
                               timeout_s=opts["timeout_s"],
                               telemetry=_telemetry(args), checkpoint=args.checkpoint,
                               precision=args.precision or opts["precision"],
                               fault_tolerance=_FT_FLAG[args.fault_tolerance]
                               if args.fault_tolerance else opts["fault_tolerance"],
                               microbatches=opts["microbatches"])
    done = 0
    with step:
        _ = step.plan                                 # traces; checks graph, mesh and torch
        table = None if args.json else _LossTable(name, step.plan, step.pipeline)
        for i, batch in enumerate(itertools.islice(data, args.steps)):
            loss = step(*(batch if isinstance(batch, (tuple, list)) else (batch,)))
            value = _loss_value(loss)
            if table is None:
                print(json.dumps({"step": i, "loss": value}), flush=True)
            else:
                table.add(i, value)
            done = i + 1
        run_id = step.run_id
        saved = step.save_checkpoint(args.save_checkpoint) if args.save_checkpoint else None
    if saved is not None and args.json:
        print(json.dumps({"checkpoint": saved}), flush=True)
    if table is not None:
        table.show()
        if saved is not None:
            _console().print(f"checkpoint: {saved}")
        if step.telemetry is not None and run_id is not None:
            db = step.telemetry.db
            _console().print(f"telemetry: run {run_id} in {db} (meshplan telemetry summary "
                             f"--db {db} --run {run_id})")
    if done < args.steps:
        raise RuntimeFailure(f"the data ran out after {done} of {args.steps} steps; pass "
                             "fewer --steps or a longer batches()")
    return 0


def _telemetry(args: argparse.Namespace) -> Any:
    """``distribute(telemetry=...)`` from ``--db`` and ``--telemetry``."""
    from .telemetry import Level, TelemetryConfig

    if args.telemetry is None and args.db is None:
        return None                               # the defaults (and $MESHPLAN_TELEMETRY*)
    level = Level.parse(args.telemetry or "collectives")
    if level is Level.OFF:
        return False
    return TelemetryConfig(level=level) if args.db is None else \
        TelemetryConfig(db=args.db, level=level)


def _loss_value(result: Any) -> float:
    """The step's loss: its result, or the first item of a tuple/list, or ``result["loss"]``."""
    if isinstance(result, dict):
        result = result.get("loss", next(iter(result.values()), float("nan")))
    elif isinstance(result, (tuple, list)) and result:
        result = result[0]
    if hasattr(result, "detach"):
        return float(result.detach().reshape(-1)[0])
    return float(result)


class _LossTable:
    def __init__(self, name: str, plan: Any, pipeline: Any = None) -> None:
        from rich.table import Table

        mesh = plan.mesh if pipeline is None else pipeline.mesh
        what = (f"{plan.strategy} plan" if pipeline is None else
                f"{pipeline.pp} stages of {plan.strategy} layouts, {pipeline.schedule}")
        self.table = Table(title=f"{name} on mesh {mesh} ({what})")
        self.table.add_column("step", justify="right")
        self.table.add_column("loss", justify="right")

    def add(self, step: int, loss: Any) -> None:
        self.table.add_row(str(step), f"{loss:.6f}")

    def show(self) -> None:
        _console().print(self.table)


def _data(module: ModuleType, target: str, spec: str | None) -> Iterator[Any]:
    if spec:
        fn = _load_callable(spec, "--data")
    else:
        fn = getattr(module, "batches", None)
        if not callable(fn):
            raise TraceError(f"{target.rpartition(':')[0]} has no batches() function; define "
                             "one returning an iterator of argument tuples, or pass --data MOD:FN")
    return iter(fn())


# ---- loading the user's code -----------------------------------------------------------------

def load_step(spec: str) -> tuple[ModuleType, Callable[..., Any], str]:
    """``FILE.py:NAME`` -> (the imported file, the object named NAME, NAME)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise TraceError(f"target {spec!r} is not of the form FILE.py:NAME "
                         "(e.g. examples/gpt.py:train_step)")
    if not os.path.isfile(path):
        raise TraceError(f"target file {path!r} does not exist")
    module = import_file(path)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        raise TraceError(f"{path} has no function {name!r}")
    return module, fn, name


def import_file(path: str) -> ModuleType:
    """Import a user's ``FILE.py`` (its folder on ``sys.path`` while it runs) once per
    process; an import that fails becomes one TraceError."""
    if not os.path.isfile(path):
        raise TraceError(f"file {path!r} does not exist")
    folder = os.path.dirname(os.path.abspath(path))
    mod_name = f"_meshplan_user_{abs(hash(os.path.abspath(path)))}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.path.insert(0, folder)
    try:
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    except MeshplanError:
        raise
    except Exception as e:
        raise TraceError(f"importing {path} failed: {type(e).__name__}: {e}") from e
    finally:
        sys.path.remove(folder)
    return module


def _load_callable(spec: str, flag: str) -> Callable[..., Any]:
    mod, sep, fn_name = spec.rpartition(":")
    if not sep or not mod or not fn_name:
        raise TraceError(f"{flag} {spec!r} is not of the form MOD:FN or FILE.py:FN")
    if mod.endswith(".py"):
        module = import_file(mod)
    else:
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise TraceError(f"{flag} {spec!r}: cannot import {mod!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise TraceError(f"{flag} {spec!r}: {mod} has no function {fn_name!r}")
    return fn


def example_inputs(module: ModuleType, fn: Any, name: str, spec: str | None) -> tuple:
    """The step's example inputs: ``--example`` (``spec``), else ``fn.example_inputs``, else
    the file's ``example_inputs`` (a tuple, or a zero-argument callable returning one)."""
    ex = _load_callable(spec, "--example") if spec else getattr(fn, "example_inputs", None)
    if ex is None:
        ex = getattr(module, "example_inputs", None)
    if callable(ex):
        ex = ex()
    if ex is None:
        raise TraceError(f"{name} has no example inputs; pass example_inputs= to "
                         f"meshplan.distribute, set `{name}.example_inputs = (x, y)` or a "
                         "module-level `example_inputs`, or pass --example MOD:FN")
    return tuple(ex) if isinstance(ex, (tuple, list)) else (ex,)


def _unwrap(fn: Any) -> Callable[..., Any]:
    import meshplan

    return fn.fn if isinstance(fn, meshplan.DistributedStep) else fn


def _decorator_options(fn: Any) -> dict[str, Any]:
    import meshplan

    if isinstance(fn, meshplan.DistributedStep):
        return {"topology": fn.topology, "strategy": fn.strategy,
                "memory_limit_bytes": fn.memory_limit_bytes, "timeout_s": fn.timeout_s,
                "precision": fn.precision, "recompute": fn.recompute,
                "fault_tolerance": fn._ft_asked, "microbatches": fn.microbatches,
                "microbatches_asked": fn._mb_asked, "schedule": fn._schedule}
    return {"topology": "cpu", "strategy": "auto", "memory_limit_bytes": None, "timeout_s": 300.0,
            "precision": None, "recompute": "auto", "fault_tolerance": None, "microbatches": 1,
            "microbatches_asked": None, "schedule": None}


# ---- output ----------------------------------------------------------------------------------

def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, stderr=stderr, log_path=False)


@contextlib.contextmanager
def _stages() -> Iterator[Callable[[str], None]]:
    """``stage("tracing")`` shows the current stage as a spinner on stderr when it is a
    terminal; otherwise nothing (scripts read stderr for the one error line)."""
    if not sys.stderr.isatty():
        yield lambda text: None
        return
    console = _console(stderr=True)
    with console.status("starting") as status:
        def stage(text: str) -> None:
            status.update(f"{text} ...")
            console.log(text)

        yield stage


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (native libraries' banners) so stdout stays parseable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _mesh_str(mesh: dict[str, int]) -> str:
    return ",".join(f"{a}={n}" for a, n in mesh.items())
