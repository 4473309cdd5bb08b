"""The ``meshplan`` command line, run as a user runs it: ``python -m meshplan ...`` in a fresh
process from the repository root.

Pins down: ``trace`` writes a graph that loads and verifies; ``ir show`` prints the parameter
count and FLOPs (and ``--json`` is machine-readable); a bad target or a corrupt graph file exits
1 with ONE line ``TraceError: ...`` / ``IRError: ...`` on stderr and no Python traceback;
``demo`` replays the traced GPT step bit-identically to eager PyTorch.

Every command costs a fresh interpreter and a torch import, so the independent commands are
started together when the module's first test needs them (``ir show`` starts as soon as
``trace`` has finished); each test then waits only for its own command. Of the bad inputs, one
per command (``trace``, ``ir show``) runs in a fresh process; the others, and ``ir show --json``
(``ir show`` runs in a fresh process), go through ``cli.main`` in this process from the
repository root (what it prints to stderr is what the command prints), which saves a torch
import each.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from meshplan.cli import main
from meshplan.ir import (
    Graph,
    GraphInfo,
    Node,
    NodeKind,
    Output,
    OutputKind,
    Ref,
    Role,
    TensorMeta,
    verify,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 300
BAD_TARGETS = {
    "nofile.py:x": r"target file 'nofile.py' does not exist",
    "examples/gpt.py:nosuch": r"has no function 'nosuch'",
    "examples/gpt.py": r"is not of the form FILE.py:NAME",
}
# the bad inputs run in a fresh process (the rest: in this process, see the module docstring)
IN_A_PROCESS = {"bad:examples/gpt.py:nosuch", "corrupt:bogus-device"}


@dataclass(frozen=True)
class Result:
    """What one CLI invocation did."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"meshplan {' '.join(self.args)} -> {self.returncode}\n--- stdout\n"
                f"{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")


def meshplan_cli(*args: str) -> Result:
    """Run ``python -m meshplan ARGS`` from the repository root (wide terminal for rich)."""
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "meshplan", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    return Result(tuple(args), proc.returncode, proc.stdout, proc.stderr)


def in_process(*args: str) -> Future[Result]:
    """``meshplan ARGS`` through ``cli.main`` in this process from the repository root, as a
    finished future (the subprocesses' threads print nothing while it redirects stdout)."""
    err, out = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(args))
    done: Future[Result] = Future()
    done.set_result(Result(tuple(args), code, out.getvalue(), err.getvalue()))
    return done


@dataclass(frozen=True)
class Runs:
    """Futures of the module's CLI invocations and the files they use."""

    graph: Path
    corrupt: dict[str, Path]
    futures: dict[str, Future[Result]]

    def get(self, key: str) -> Result:
        return self.futures[key].result(timeout=2 * TIMEOUT)


def _bogus_device_graph(path: Path) -> None:
    """A well-formed graph file except for a device literal no torch knows."""
    nodes = (Node("z", NodeKind.OP, "aten.zeros.default", ((2,),),
                  (("device", torch.device("cpu")),),
                  (TensorMeta((2,), "float32"),)),)
    g = verify(Graph(nodes, (Output(Ref("z"), OutputKind.RESULT, "0"),), GraphInfo("bad")))
    path.write_text(g.to_json().replace('{"$device": "cpu"}', '{"$device": "bogus"}'))
    assert "bogus" in path.read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Start every CLI command of this module concurrently; yield their futures."""
    folder = tmp_path_factory.mktemp("cli")
    graph = folder / "graph.json"
    corrupt = {"not-json": folder / "not-json.json", "bogus-device": folder / "bogus.json"}
    corrupt["not-json"].write_text("{this is not json")
    _bogus_device_graph(corrupt["bogus-device"])
    # A relative --out path, as a user would type it, that still lands outside the repository.
    out = os.path.relpath(graph, REPO)
    pool = ThreadPoolExecutor(max_workers=10)
    futures: dict[str, Future[Result]] = {}

    def after_trace(*args: str) -> Result:
        futures["trace"].result()
        return meshplan_cli(*args)

    futures["trace"] = pool.submit(meshplan_cli, "trace", "examples/gpt.py:train_step",
                                   "--out", out)
    futures["demo"] = pool.submit(meshplan_cli, "demo")
    bad = {f"bad:{target}": ("trace", target, "--out", str(folder / "never.json"))
           for target in BAD_TARGETS}
    bad.update({f"corrupt:{kind}": ("ir", "show", str(path)) for kind, path in corrupt.items()})
    for key, args in bad.items():
        if key in IN_A_PROCESS:
            futures[key] = pool.submit(meshplan_cli, *args)
    futures["show"] = pool.submit(after_trace, "ir", "show", str(graph))
    for key, args in bad.items():
        if key not in IN_A_PROCESS:
            futures[key] = in_process(*args)
    try:
        yield Runs(graph, corrupt, futures)
    finally:
        pool.shutdown(wait=True)


def _gpt_param_count() -> int:
    from meshplan.examples import gpt

    return sum(p.numel() for p in gpt.model.parameters())


def _assert_one_error_line(r: Result, kind: str) -> str:
    """Exit status 1, exactly one stderr line ``KIND: ...``, no traceback anywhere."""
    assert r.returncode == 1, r
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r
    assert lines[0].startswith(f"{kind}: "), r
    return lines[0]


# ---- trace and ir show ----------------------------------------------------------------------

def test_trace_writes_a_loadable_graph(runs: Runs) -> None:
    """``trace FILE.py:NAME --out PATH`` exits 0, says what it wrote, and the file loads into a
    graph that verifies on meta tensors with the GPT's parameter count."""
    r = runs.get("trace")
    assert r.returncode == 0, r
    assert "Traceback" not in r.stderr, r
    assert "traced" in r.stdout and "graph.json" in r.stdout, r
    g = Graph.load(str(runs.graph))
    verify(g, shapes=True)
    assert g.num_params() == _gpt_param_count()
    assert f"{g.num_params():,} parameters" in r.stdout, r
    assert len(g.inputs_with_role(Role.PARAM)) > 0 and len(g.nodes) > 100


def test_ir_show_prints_parameters_and_flops(runs: Runs) -> None:
    """``ir show`` prints the parameter count (with thousands separators), FLOPs per phase and
    the tables."""
    r = runs.get("show")
    assert r.returncode == 0, r
    assert f"{_gpt_param_count():,} parameters" in r.stdout, r
    assert "FLOP" in r.stdout, r
    for word in ("forward", "backward", "update", "inputs by role", "largest activations"):
        assert word in r.stdout, (word, str(r))
    assert r.stderr.strip() == "", r


def test_ir_show_json_is_machine_readable(runs: Runs) -> None:
    """``ir show --json`` prints one JSON document with the summary's fields (in this process:
    ``ir show`` runs in a fresh one above)."""
    assert runs.get("trace").returncode == 0
    r = in_process("ir", "show", "--json", str(runs.graph)).result()
    assert r.returncode == 0, r
    doc = json.loads(r.stdout)
    assert doc["num_params"] == _gpt_param_count()
    assert doc["flops"] > 0 and doc["bytes_moved"] > 0
    assert doc["flops"] == sum(f for _, f in doc["flops_by_phase"])
    assert dict(doc["nodes_by_kind"])["input"] > 0
    assert doc["name"] == Graph.load(str(runs.graph)).info.name


# ---- errors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", list(BAD_TARGETS))
def test_bad_target_is_one_trace_error_line(runs: Runs, target: str) -> None:
    """A missing file, a missing function or a target without ``:NAME`` exits 1 with one
    ``TraceError:`` line that says what is wrong, and writes no graph."""
    line = _assert_one_error_line(runs.get(f"bad:{target}"), "TraceError")
    assert re.search(BAD_TARGETS[target], line), line
    assert not (runs.graph.parent / "never.json").exists()


@pytest.mark.parametrize("kind", ["not-json", "bogus-device"])
def test_ir_show_corrupt_file_is_one_ir_error_line(runs: Runs, kind: str) -> None:
    """A corrupt graph file exits 1 with one ``IRError:`` line naming the file, never a
    traceback; a bad literal inside an otherwise valid file counts as corrupt too."""
    line = _assert_one_error_line(runs.get(f"corrupt:{kind}"), "IRError")
    assert str(runs.corrupt[kind]) in line, line


# ---- demo -----------------------------------------------------------------------------------

def test_demo_replays_bit_identically(runs: Runs) -> None:
    """``demo`` traces the GPT step, prints its summary and the losses table (eager vs
    meshplan, one row per step) and reports bit-identical parameters."""
    r = runs.get("demo")
    assert r.returncode == 0, r
    assert "losses" in r.stdout and "eager" in r.stdout and "meshplan" in r.stdout, r
    assert "bit-identical: True" in r.stdout, r
    assert "FLOP" in r.stdout, r
    assert "Traceback" not in r.stderr, r
