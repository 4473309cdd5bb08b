"""``distribute(fault_tolerance=True)``: a rank that fails anywhere in a step (or in
``state_dict()``, or during the recovery itself) and training goes on by itself, bit for bit.

The faults are injected inside the workers by ``_faults.py`` (a worker plugin): SIGKILL,
SIGSEGV, ``os._exit`` and SIGSTOP, before the forward, mid-backward, in the optimizer, entering
an all-reduce, half way through a snapshot, in ``get_state``, in ``restore_snapshot``. Each run
is compared with ``torch.equal`` (no tolerance) against the same steps on the same mesh without
fault tolerance and without a fault: the restart replays the interrupted steps from their kept
batches on the same mesh, where every op and collective runs in the same order, so any
difference at all is a bug (a lost step, a step applied twice, a rank restored to the wrong
snapshot). And nothing is left behind: no worker process, no ``/dev/shm`` file.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import meshplan
from meshplan.examples import gpt
from meshplan.runtime._mpi_launch import _alive

STEPS = 4
_HERE = Path(__file__).resolve().parent


def _run(mesh: dict[str, int], *, faults=(), ft: bool = True, **options):
    """``STEPS`` steps of the GPT example and its state_dict(); the losses, the state, the
    restarts, the pids of every worker the run started."""
    if faults:                     # the plugin fixture restores the variable
        os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps(list(faults))
    ex = gpt.build(optimizer="adamw", clip=1.0)
    if ft:
        options = {"fault_tolerance": True, **options}
    step = meshplan.distribute(ex.step, mesh=mesh, topology="h100", telemetry=False,
                               **options)
    losses, pids = [], set()
    with step:
        for i in range(STEPS):
            losses.append(step(*ex.batch(i)).detach())
            pids.update(step._workers.pids)
        sd = step.state_dict()
        pids.update(step._workers.pids)
        restarts = step.restarts
        replaced = step._ft.replaced if step._ft is not None else []
    return losses, sd, restarts, pids, replaced


@pytest.fixture(scope="module")
def reference():
    """The fault-free run, fault tolerance off."""
    return _run({"dp": 2}, ft=False)[:2]


@pytest.fixture
def plugin(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(_HERE), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MESHPLAN_WORKER_PLUGINS", "_faults")
    monkeypatch.setenv("MESHPLAN_TEST_FAULTS", "[]")
    before = set(os.listdir("/dev/shm"))
    yield lambda rank, step, at, how, name="fired": {
        "rank": rank, "step": step, "at": at, "how": how, "marker": str(tmp_path / name)}
    assert set(os.listdir("/dev/shm")) <= before, "a /dev/shm file was left behind"


def _same(got, want) -> None:
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"loss of step {i}: {a} != {b}"
    for part in ("model", "optim"):
        a, b = got[1][part], want[1][part]
        if part == "optim":
            a = {f"{i}.{k}": v for i, e in a["state"].items() for k, v in e.items()}
            b = {f"{i}.{k}": v for i, e in b["state"].items() for k, v in e.items()}
        assert sorted(a) == sorted(b)
        for k in b:
            assert torch.equal(a[k], b[k]), f"{part} {k} differs after the recovery"


def _gone(pids) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "a worker outlived the run"



@pytest.mark.timeout(120)
@pytest.mark.parametrize("at, how", [
    ("forward", "kill"), ("backward", "segv"), ("optimizer", "exit"), ("allreduce", "kill"),
    ("snapshot", "kill"), ("state", "kill"), ("backward", "stop")])
def test_a_failed_rank_restarts_the_mesh_and_the_run_is_bit_for_bit_the_same(
        reference, plugin, tmp_path, at, how) -> None:
    got = _run({"dp": 2}, faults=[plugin(1, 2, at, how)], hang_s=1.5)
    assert (tmp_path / "fired").exists(), "the fault never fired"
    assert got[2] == 1
    assert got[4] == [1], "only the failed rank is started again"
    _same(got, reference)
    _gone(got[3])


@pytest.mark.timeout(120)
def test_a_rank_lost_in_the_first_step_goes_back_to_the_launch_state(reference, plugin) -> None:
    """The state a mesh starts from is the snapshot of step -1: a rank killed in step 0 (or
    in step 1 before its copy of step 0 is written, which overlaps step 1's forward) restores
    it and the run is bit for bit the fault-free one. -1 once marked an empty slot, so that
    snapshot did not count and the run ended with "no step before 0 has a snapshot"."""
    got = _run({"dp": 2}, faults=[plugin(1, 0, "forward", "kill")])
    assert got[2] == 1
    _same(got, reference)


@pytest.mark.timeout(120)
def test_a_rank_that_hangs_past_the_step_deadline_restarts_every_rank(reference,
                                                                      plugin) -> None:
    """Alive, running, never answering: after three measured steps a step may take ten times
    their median (at least hang_s); then every rank starts again (the hung one cannot be told
    from a slow one, and its peers wait for it)."""
    got = _run({"dp": 2}, faults=[plugin(0, 3, "backward", "hang")], hang_s=1.5)
    assert got[2] == 1
    assert got[4] == [0, 1]
    _same(got, reference)
    _gone(got[3])


@pytest.mark.timeout(120)
def test_a_rank_that_drops_its_control_connection_is_replaced_at_once(reference,
                                                                      plugin) -> None:
    """Rank 0 closes its control socket mid-backward and sleeps, alive. The controller sees
    the connection end (not the step deadline: hang_s=300 would outlast the test's timeout),
    replaces that rank alone, and the run is bit for bit the fault-free one."""
    got = _run({"dp": 2}, faults=[plugin(0, 2, "backward", "drop")], hang_s=300)
    assert got[2] == 1
    assert got[4] == [0], "only the rank that lost its connection is started again"
    _same(got, reference)
    _gone(got[3])


@pytest.mark.timeout(120)
def test_two_ranks_at_once_and_a_kill_during_the_recovery(reference, plugin) -> None:
    faults = [plugin(0, 1, "backward", "kill", "a"), plugin(1, 1, "backward", "kill", "b"),
              plugin(1, 0, "restore", "exit", "c")]
    got = _run({"dp": 2}, faults=faults)
    assert got[2] == 2, "the kill during the recovery is a second restart"
    _same(got, reference)
    _gone(got[3])


@pytest.mark.timeout(120)
def test_snapshots_every_other_step_replay_the_steps_since(reference, plugin) -> None:
    got = _run({"dp": 2}, faults=[plugin(0, 3, "optimizer", "kill")], snapshot_every=2)
    assert got[2] == 1
    _same(got, reference)


@pytest.mark.timeout(120)
def test_a_snapshot_copy_that_fails_keeps_the_one_before_and_the_run_goes_on(
        reference, plugin, caplog) -> None:
    """Rank 1's copy of step 1 fails (an exception in the copy thread, as out of memory
    would): the step itself is fine, a warning says so, and when rank 0 is killed in step 2
    the mesh goes back to step 0's snapshot (the newest both hold) and re-runs steps 1-2."""
    faults = [plugin(1, 1, "snapshot", "raise", "a"), plugin(0, 2, "backward", "kill", "b")]
    got = _run({"dp": 2}, faults=faults)
    said = caplog.text
    assert "rank 1 could not copy its snapshot of step 1 (MemoryError" in said
    assert "back to its snapshot after step 0 and re-ran 2 steps" in said
    assert got[2] == 1
    _same(got, reference)


@pytest.mark.timeout(180)
def test_sharded_state_on_four_ranks(plugin) -> None:
    """FSDP x TP: every rank holds pieces no other rank has; the replacement reads its own
    back from the snapshot its predecessor wrote."""
    mesh = {"dp": 2, "tp": 2}
    want = _run(mesh, ft=False, strategy="fsdp")
    got = _run(mesh, faults=[plugin(3, 1, "allreduce", "kill")], strategy="fsdp")
    assert got[2] == 1
    _same(got, want)
    _gone(want[3] | got[3])


@pytest.mark.timeout(120)
def test_past_max_restarts_the_failure_is_raised_and_nothing_is_left(plugin) -> None:
    faults = [plugin(1, 1, "forward", "kill", "a"), plugin(1, 1, "restore", "kill", "b")]
    with pytest.raises(meshplan.RuntimeFailure, match="max_restarts=1") as err:
        _run({"dp": 2}, faults=faults, max_restarts=1)
    assert "rank 1 was killed by SIGKILL" in str(err.value)


@pytest.mark.timeout(120)
def test_failures_and_recoveries_are_in_the_telemetry(plugin, tmp_path) -> None:
    from meshplan.telemetry import Store

    os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps([plugin(1, 1, "backward", "kill")])
    ex = gpt.build(optimizer="adamw")
    db = tmp_path / "t.duckdb"
    with meshplan.distribute(ex.step, mesh={"dp": 2}, topology="h100", telemetry=str(db),
                             fault_tolerance=True) as step:
        for i in range(3):
            step(*ex.batch(i))
        run = step.run_id
    with Store.open(db) as store:
        def rows(q: str) -> list[tuple]:
            return [tuple(r.values()) for r in store.sql(q, [run]).to_pylist()]
        rec = rows("SELECT step, ranks, kind, restart, restored_step, replayed "
                   "FROM recoveries WHERE run_id = ?")
        fail = rows("SELECT rank, step, kind, error FROM failures WHERE run_id = ? "
                    "ORDER BY rank DESC")
        ranks = rows("SELECT count(DISTINCT step) FROM steps WHERE run_id = ? AND rank = -1")
    assert rec == [(1, "1", "exit", 1, 0, 1)]
    # the controller's row for the killed rank; the survivor's own row for the step it could
    # not finish (its shared-memory group saw the peer die)
    assert [f[:3] for f in fail] == [(1, 1, "exit"), (0, 1, "error")]
    assert "died" in fail[1][3], fail[1][3]
    assert ranks == [(3,)], "the controller's steps go on in the same run"


def test_fault_tolerance_is_refused_where_it_cannot_work_yet() -> None:
    ex = gpt.build(optimizer="adamw")
    with pytest.raises(meshplan.RuntimeFailure, match="not built for pods"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, launcher="k8s", elastic=True,
                            k8s={"image": "registry/train:1", "pods": 1})
    with pytest.raises(meshplan.RuntimeFailure, match="snapshot_every=0"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, fault_tolerance=True, snapshot_every=0)
    with pytest.raises(meshplan.RuntimeFailure, match="hang_s"):
        meshplan.distribute(ex.step, mesh={"dp": 2}, hang_s=0)


def test_the_default_is_on_for_cpu_ranks_and_off_where_it_is_not_built_or_measured(
        monkeypatch) -> None:
    """``fault_tolerance=None`` (the default): on for CPU ranks under local / mpi / slurm,
    off under k8s (not measured on a cluster) and on GPU ranks; ``$MESHPLAN_FAULT_TOLERANCE``
    changes it; ``elastic=`` asks for it; an explicit value is kept."""
    from meshplan.runtime._distributed import _fault_tolerance_default as default

    monkeypatch.delenv("MESHPLAN_FAULT_TOLERANCE", raising=False)
    for launcher in ("local", "mpi", "slurm"):
        assert default(None, False, launcher, "cpu")[0] is True
    assert default(None, False, "k8s", "cpu")[0] is False
    on, note = default(None, False, "local", "cuda")
    assert on is False and "GPU" in note
    assert default(False, False, "local", "cpu") == (False, "off, as asked")
    assert default(True, False, "k8s", "cuda")[0] is True
    assert default(None, True, "local", "cuda")[0] is True
    monkeypatch.setenv("MESHPLAN_FAULT_TOLERANCE", "off")
    assert default(None, False, "local", "cpu")[0] is False
    assert default(True, False, "local", "cpu")[0] is True
    monkeypatch.setenv("MESHPLAN_FAULT_TOLERANCE", "on")
    assert default(None, False, "local", "cuda")[0] is True
    assert default(None, False, "k8s", "cpu")[0] is True
    monkeypatch.setenv("MESHPLAN_FAULT_TOLERANCE", "yes")
    with pytest.raises(meshplan.RuntimeFailure, match="MESHPLAN_FAULT_TOLERANCE"):
        default(None, False, "local", "cpu")


@pytest.mark.timeout(120)
def test_on_by_default_unless_the_snapshots_would_not_fit_in_memory(monkeypatch,
                                                                    caplog) -> None:
    """The default run keeps snapshots (the plan summary says so); where they would take more
    than half of the host's available memory, it runs without, and says so once."""
    from meshplan.examples import mlp
    from meshplan.runtime import _distributed

    monkeypatch.delenv("MESHPLAN_FAULT_TOLERANCE", raising=False)
    ex = mlp.build(optimizer="adamw")
    with meshplan.distribute(ex.step, mesh={"dp": 2}, telemetry=False) as step:
        step(*ex.batch(0))
        assert step.fault_tolerance and step._ft.files is not None
        assert "fault tolerance: on (the default" in step.plan.summary()
    monkeypatch.setattr(_distributed, "_available_memory", lambda: 4096)
    ex = mlp.build(optimizer="adamw")
    with caplog.at_level("WARNING", logger="meshplan"), \
            meshplan.distribute(ex.step, mesh={"dp": 2}, telemetry=False) as step:
        step(*ex.batch(0))
        step(*ex.batch(1))
        assert not step.fault_tolerance and step.restarts == 0
        assert "would take" in step.fault_tolerance_note
    said = [r.getMessage() for r in caplog.records if "fault tolerance off" in r.getMessage()]
    assert len(said) == 1 and "available memory" in said[0], said


@pytest.mark.timeout(120)
def test_a_state_loaded_mid_run_is_what_a_recovery_goes_back_to(plugin) -> None:
    """``load_state_dict()`` between steps replaces every rank's snapshot: a rank killed after
    it comes back to the loaded state, not to the snapshot of the step before the load."""
    def run(faults, ft):
        if faults:
            os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps(faults)
        ex = gpt.build(optimizer="adamw", clip=1.0)
        losses = []
        with meshplan.distribute(ex.step, mesh={"dp": 2}, topology="h100", telemetry=False,
                                 fault_tolerance=ft) as step:
            losses.append(step(*ex.batch(0)).detach())
            saved = step.state_dict()
            losses.append(step(*ex.batch(1)).detach())
            step.load_state_dict(saved)                   # back to the state after step 0
            for i in (2, 3):
                losses.append(step(*ex.batch(i)).detach())
            return losses, step.state_dict(), step.restarts

    want = run([], False)
    got = run([plugin(1, 2, "backward", "kill")], True)
    assert got[2] == 1
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"loss {i}"
    for k, v in want[1]["model"].items():
        assert torch.equal(got[1]["model"][k], v), k


def _mpiexec() -> bool:
    import shutil
    import sys
    from importlib.util import find_spec

    near = Path(sys.executable).parent / "mpiexec"
    return find_spec("mpi4py") is not None and (near.exists() or bool(shutil.which("mpiexec")))


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _mpiexec(), reason="needs mpi4py and mpiexec: pip install 'meshplan[mpi]'")
def test_under_mpiexec_every_rank_starts_again(plugin) -> None:
    """mpiexec ends every rank once one dies: the whole mesh starts again under a new
    mpiexec, every rank back at its snapshot (against the same run under mpiexec without a
    fault: MPI sums in its own order, so not against the gloo reference)."""
    want = _run({"dp": 2}, ft=False, launcher="mpi")
    got = _run({"dp": 2}, faults=[plugin(1, 2, "backward", "kill")], launcher="mpi")
    assert got[2] == 1
    assert got[4] == [0, 1]
    _same(got, want)


@pytest.mark.timeout(180)
def test_elastic_a_failed_rank_shrinks_the_mesh_and_the_run_goes_on(plugin) -> None:
    """``elastic=True``: FSDP on 4 ranks, rank 2 killed in step 2's backward. 3 ranks cannot
    split the batch of 4, so the run goes on on 2 (fsdp again), from the snapshot after step
    1. The reference is that by hand: steps 0-1 on dp4, the state moved, steps 2-3 on dp2:
    equal with no tolerance (the same sums in the same order on each mesh); nothing is left."""
    def run(mesh, steps, faults=(), sd=None, **options):
        if faults:
            os.environ["MESHPLAN_TEST_FAULTS"] = json.dumps(list(faults))
        ex = gpt.build(optimizer="adamw", clip=1.0)
        with meshplan.distribute(ex.step, mesh=mesh, topology="h100", telemetry=False,
                                 strategy="fsdp", **options) as step:
            if sd is not None:
                step(*ex.batch(steps[0] - 1))     # the first call runs on the controller
                step.load_state_dict(sd)
            losses = [step(*ex.batch(i)).detach() for i in steps]
            return losses, step.state_dict(), step, set(step._workers.pids)

    first = run({"dp": 4}, [0, 1])
    second = run({"dp": 2}, [2, 3], sd=first[1])
    got = run({"dp": 4}, [0, 1, 2, 3], faults=[plugin(2, 2, "backward", "kill")],
              fault_tolerance=True, elastic=True)
    step = got[2]
    assert step.restarts == 1 and step.mesh == {"dp": 2} and step.plan.mesh.sizes == (2,)
    assert step.plan.strategy == "fsdp"
    _same((got[0], got[1]), (first[0] + second[0], second[1]))
    _gone(got[3])


@pytest.mark.timeout(120)
def test_elastic_below_its_least_ranks_is_an_error_naming_why(plugin) -> None:
    with pytest.raises(meshplan.RuntimeFailure, match=r"1 rank survives .*elastic=2 goes on with no fewer than 2"):
        _run({"dp": 2}, faults=[plugin(1, 1, "forward", "kill")], elastic=2)
    with pytest.raises(meshplan.RuntimeFailure, match="needs fault_tolerance=True"):
        meshplan.distribute(gpt.build().step, mesh={"dp": 2}, elastic=True,
                            fault_tolerance=False)
    assert meshplan.distribute(gpt.build().step, mesh={"dp": 2}, elastic=True,
                               device="cpu").fault_tolerance     # elastic= asks for it
    with pytest.raises(meshplan.RuntimeFailure, match="an int >= 1"):
        meshplan.distribute(gpt.build().step, mesh={"dp": 2}, fault_tolerance=True, elastic=0)
