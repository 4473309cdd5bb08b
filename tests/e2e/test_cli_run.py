"""``meshplan compile`` and ``meshplan run`` end to end, through ``python -m meshplan`` in fresh
processes, on ``examples/gpt_distributed.py`` (copied with its imports into a temporary folder,
so one test can edit the step after compiling).

Pins down: ``compile --json`` writes a plan that loads and whose numbers the summary repeats;
``run --steps 3`` on 2 local processes prints the losses of the same step run eagerly in this
process; each bad input (truncated, tampered or foreign plan, a plan for another graph, another
torch, another mesh, a missing function or file, an unavailable launcher) exits 1 with ONE
stderr line and no traceback, and ``--debug`` adds the traceback.

Compiling and running are subprocesses; the bad inputs go through ``cli.main`` in this
process (each subprocess costs a torch import).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from meshplan.cli import main
from meshplan.planner import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli import Result  # noqa: E402  (one CLI result type for the e2e tests)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 180
STEP = "gpt_distributed.py:train_step"


def cli(cwd: Path, *args: str) -> Result:
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([sys.executable, "-m", "meshplan", *args], cwd=cwd, env=env, check=False,
                       capture_output=True, text=True, timeout=TIMEOUT)
    return Result(tuple(args), p.returncode, p.stdout, p.stderr)


def _rehash(path: Path, **body_changes: object) -> None:
    """Change fields of a plan's body and write a VALID content hash (a plan as another
    meshplan or torch would have written it)."""
    d = json.loads(path.read_text())
    d["body"].update(body_changes)
    text = json.dumps(d["body"], sort_keys=True, separators=(",", ":"), allow_nan=False)
    d["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    path.write_text(json.dumps(d))


def in_process(*args: str) -> Result:
    """``meshplan ARGS`` through ``cli.main`` in this process (what it prints to stderr is
    what the command prints; no torch import per case keeps the file fast)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    return Result(tuple(args), code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Result]:
    """Compile once, make the bad inputs, run every command; return their results by key.

    The good run is a subprocess on 2 workers; the bad inputs run in this process meanwhile."""
    folder = tmp_path_factory.mktemp("cli_run")
    for name in ("gpt_distributed.py", "gpt.py", "_common.py"):
        shutil.copy(REPO / "examples" / name, folder / name)
    results = {"compile": cli(folder, "compile", STEP, "-o", "gpt.plan", "--json")}
    assert results["compile"].returncode == 0, results["compile"]
    text = (folder / "gpt.plan").read_text()
    (folder / "truncated.plan").write_text(text[: len(text) // 2])
    tampered = json.loads(text)
    tampered["body"]["peak_memory_bytes"] += 1
    (folder / "tampered.plan").write_text(json.dumps(tampered))
    (folder / "foreign.plan").write_text(json.dumps({"format": "something.else", "x": 1}))
    shutil.copy(folder / "gpt.plan", folder / "old-torch.plan")
    _rehash(folder / "old-torch.plan", torch_version="1.13.1")
    step, plan = str(folder / STEP), str(folder / "gpt.plan")

    def run(*extra: str, plan: str = plan, target: str = step) -> Result:
        return in_process("run", target, "--plan", plan, "--steps", "3", *extra)

    with ThreadPoolExecutor(max_workers=1) as pool:
        good = pool.submit(cli, folder, "run", STEP, "--plan", "gpt.plan", "--steps", "3",
                           "--json", "--db", "tel.duckdb", "--telemetry", "ops",
                           "--save-checkpoint", "ckpt.safetensors")
        for case in ("truncated", "tampered", "foreign", "old-torch"):
            results[f"bad:{case}"] = run(plan=str(folder / f"{case}.plan"))
        results["bad:missing-plan"] = run(plan=str(folder / "nosuch.plan"))
        results["bad:mesh"] = run("--mesh", "dp=4")
        results["bad:no-function"] = run(target=str(folder / "gpt_distributed.py:nosuch"))
        results["bad:no-file"] = run(target=str(folder / "nofile.py:train_step"))
        results["bad:launcher"] = run("--launcher", "ray")
        results["bad:compile-no-function"] = in_process(
            "compile", str(folder / "gpt_distributed.py:nosuch"), "-o", str(folder / "x.plan"))
        results["bad:data"] = run("--data", "no_such_module_xyz:batches")
        results["bad:memory-limit"] = in_process("compile", step, "-o", str(folder / "x.plan"),
                                                 "--memory-limit", "lots")
        results["over-limit"] = in_process("compile", step, "-o", str(folder / "dp.plan"),
                                           "--strategy", "dp", "--memory-limit", "200KiB")
        results["debug:tampered"] = run("--debug", plan=str(folder / "tampered.plan"))
        results["run"] = good.result()
        # resume from the good run's checkpoint: its data starts again at batch 0
        resume = pool.submit(cli, folder, "run", STEP, "--plan", "gpt.plan", "--steps", "2",
                             "--json", "--telemetry", "off", "--checkpoint", "ckpt.safetensors",
                             "--fault-tolerance", "off")
        results["bad:checkpoint"] = run("--checkpoint", str(folder / "gpt.plan"))
        # the step changes after compiling (the gradient clip norm): the same file edited, run
        # in this process under another name (a subprocess would cost a torch import), while
        # the resumed run starts (its trace is a second core's work)
        src = (folder / "gpt_distributed.py").read_text()
        assert "clip_grad_norm_(model.parameters(), 1.0)" in src
        (folder / "gpt_changed.py").write_text(src.replace("parameters(), 1.0)",
                                                           "parameters(), 0.5)"))
        results["bad:changed-step"] = run(target=str(folder / "gpt_changed.py:train_step"))
        results["resume"] = resume.result()
    results["folder"] = folder    # type: ignore[assignment]
    return results


def test_compile_says_when_the_family_asked_for_does_not_fit(runs: dict[str, Result]) -> None:
    """A hand family over the limit is written (to inspect it) with a warning that says by
    how much and what would fit; ``auto`` refuses instead (tests/unit/test_planner.py)."""
    r = runs["over-limit"]
    assert r.returncode == 0 and "fits=False" in r.stdout
    assert re.search(r"warning: this dp plan needs [\d.]+ KiB per device, [\d.]+ KiB over the "
                     r"200.00 KiB limit, so it will not fit; --strategy auto", r.stderr), r.stderr


def test_compile_writes_a_plan_the_summary_describes(runs: dict[str, Result]) -> None:
    r = runs["compile"]
    summary = json.loads(r.stdout)
    plan = Plan.load(runs["folder"] / "gpt.plan")      # type: ignore[operator]
    assert summary["path"] == str(runs["folder"] / "gpt.plan")   # type: ignore[operator]
    assert summary["estimated_step_time_s"] == plan.estimated_step_time_s
    assert summary["peak_memory_bytes"] == plan.peak_memory_bytes
    assert summary["fits"] == plan.fits
    assert summary["graph_hash"] == plan.graph_hash
    assert summary["mesh"] == {"dp": 2} == dict(plan.mesh.axes)
    assert plan.torch_version == torch.__version__
    assert plan.meshplan_version is not None


def _eager_losses(folder: Path, steps: int, again: int = 0) -> list[float]:
    """The same file's step, undecorated, in this process from the same seed: ``steps``
    batches, then the first ``again`` batches once more (a run resumed from a checkpoint)."""
    spec = importlib.util.spec_from_file_location("_eager_gpt_distributed",
                                                  folder / "gpt_distributed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(folder))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    batches, repeat = module.batches(), module.batches()
    return ([module.train_step.fn(*next(batches)).item() for _ in range(steps)]
            + [module.train_step.fn(*next(repeat)).item() for _ in range(again)])


def test_run_matches_the_eager_step(runs: dict[str, Result]) -> None:
    """rtol 1e-5: on dp=2 each rank's gradient is summed across ranks (all-reduce), in another
    order than one process's sum, so fp32 rounding differs by ~1e-7 relative per step."""
    r = runs["run"]
    assert r.returncode == 0, r
    lines = [json.loads(line) for line in r.stdout.splitlines() if '"step"' in line]
    assert [d["step"] for d in lines] == [0, 1, 2], r
    eager = _eager_losses(runs["folder"], 3)           # type: ignore[arg-type]
    assert torch.allclose(torch.tensor([d["loss"] for d in lines]), torch.tensor(eager),
                          rtol=1e-5, atol=0), (lines, eager)


def test_run_saves_a_checkpoint_and_resumes_from_it(runs: dict[str, Result]) -> None:
    """``--save-checkpoint`` after 3 steps, then ``--checkpoint`` in a new run of 2 steps (its
    batches start at 0 again): the 5 losses equal one eager process running those 5 batches
    without a break. Tolerance as above."""
    folder = runs["folder"]
    first = [json.loads(line) for line in runs["run"].stdout.splitlines()]
    assert first[-1] == {"checkpoint": str(folder / "ckpt.safetensors")}    # type: ignore[operator]
    r = runs["resume"]
    assert r.returncode == 0, r
    losses = [d["loss"] for d in (json.loads(line) for line in
                                  (runs["run"].stdout + r.stdout).splitlines()) if "loss" in d]
    eager = _eager_losses(folder, 3, again=2)           # type: ignore[arg-type]
    assert torch.allclose(torch.tensor(losses), torch.tensor(eager), rtol=1e-5, atol=0), \
        (losses, eager)


BAD = {
    "truncated": ("PlanError", "not a meshplan plan"),
    "tampered": ("PlanError", "content hash"),
    "foreign": ("PlanError", "not a meshplan plan"),
    "missing-plan": ("PlanError", "nosuch.plan"),
    "old-torch": ("PlanError", "compiled with torch 1.13.1"),
    "changed-step": ("PlanError", "changed since the plan was compiled"),
    "mesh": ("PlanError", "pass --mesh dp=2"),
    "no-function": ("TraceError", "has no function 'nosuch'"),
    "no-file": ("TraceError", "nofile.py' does not exist"),
    "launcher": ("RuntimeFailure",
                 "launcher 'ray' is not available; use --launcher local, mpi, slurm or k8s"),
    "compile-no-function": ("TraceError", "has no function 'nosuch'"),
    "data": ("TraceError", "cannot import 'no_such_module_xyz'"),
    "memory-limit": ("PlanError", "expected a size such as 70GB"),
    "checkpoint": ("RuntimeFailure", "is not a safetensors file"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(runs: dict[str, Result], case: str) -> None:
    r = runs[f"bad:{case}"]
    kind, words = BAD[case]
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr + r.stdout, r
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r
    assert lines[0].startswith(f"{kind}: ") and words in lines[0], r


@pytest.mark.parametrize("case", ["tampered"])
def test_debug_shows_the_traceback(runs: dict[str, Result], case: str) -> None:
    r = runs[f"debug:{case}"]
    assert r.returncode == 1, r
    assert "Traceback (most recent call last)" in r.stderr, r
    assert r.stderr.strip().splitlines()[-1].startswith(BAD[case][0]), r


def test_a_plan_without_metadata_still_loads_and_runs_checks(runs: dict[str, Result],
                                                             tmp_path: Path) -> None:
    """Files written before the graph hash and versions were recorded: unknown, not an error."""
    old = tmp_path / "old.plan"
    shutil.copy(runs["folder"] / "gpt.plan", old)        # type: ignore[operator]
    d = json.loads(old.read_text())
    for key in ("graph_hash", "torch_version", "meshplan_version"):
        del d["body"][key]
    old.write_text(json.dumps(d))
    _rehash(old)
    plan = Plan.load(old)
    assert plan.torch_version is None and plan.meshplan_version is None
    plan.check_compatible(mesh={"dp": 2})
    new = Plan.load(runs["folder"] / "gpt.plan")        # type: ignore[operator]
    assert plan.graph_hash == new.graph_hash
    assert Plan.from_json(new.to_json()).to_json() == new.to_json()


def test_run_records_telemetry_the_sql_command_reads(runs: dict[str, Result]) -> None:
    """``run --db D --telemetry ops`` records every rank's steps (with the losses it printed)
    and op timings into D; ``telemetry sql --db D --json`` reads them back."""
    folder = runs["folder"]
    losses = [d["loss"] for d in map(json.loads, runs["run"].stdout.splitlines()) if "loss" in d]
    db = str(folder / "tel.duckdb")          # type: ignore[operator]
    r = in_process("telemetry", "sql", "SELECT rank, step, loss FROM steps WHERE rank >= 0 "
                   "ORDER BY step, rank", "--db", db, "--json")
    assert r.returncode == 0, r
    rows = json.loads(r.stdout)
    assert [(x["step"], x["rank"]) for x in rows] == [(i, k) for i in range(3) for k in (0, 1)]
    assert [x["loss"] for x in rows] == [v for v in losses for _ in (0, 1)]
    r = in_process("telemetry", "sql", "SELECT count(*) AS n FROM ops", "--db", db, "--json")
    assert json.loads(r.stdout)[0]["n"] > 0, r
