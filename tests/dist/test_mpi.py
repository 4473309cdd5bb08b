"""MPI: ``MPICommunicator``, one-sided ``Transfer`` (RMA) and the ``mpi`` launcher.

- The communicator runs ``test_comm._program`` (every op, six dtypes, dims, sum / avg / max,
  groups, p2p ring, one-member no-ops, the error messages, the records) under ``mpiexec -n 2`` and
  ``-n 4`` and is checked with ``test_comm._check`` against the same reference, with the same
  tolerance: bit-equal except floating sums over four ranks, which MPI may associate in its own
  order (bounded by n * eps * sum|x_i|). float16/bfloat16 reduce in float32 and round once,
  which is inside that bound and, for two ranks, bit-equal to torch's a + b.
- RMA: every rank puts a disjoint row into rank 0's (and its neighbour's) exposed tensor and
  gets every other rank's tensors (different shapes, int64, bfloat16, empty): bit-equal, since
  nothing is reduced.
- The launcher: ``meshplan.distribute(..., launcher="mpi")`` against one process, with the
  tolerances of ``test_distribute.py``; a missing mpiexec / mpi4py; a failing rank; orphans.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from test_comm import _check
from test_distribute import EQUIVALENCE_CASES, _send_bad_piece, check_equal_to_one_process
from test_launch import _alive, _wait_gone


def _mpiexec() -> str | None:
    near = Path(sys.executable).parent / "mpiexec"
    return str(near) if near.exists() else shutil.which("mpiexec")


MPIEXEC = _mpiexec()
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="needs mpi4py and mpiexec: pip install 'meshplan[mpi]'")


def _mpirun(n: int, script: str, *args: str, timeout_s: float = 100) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(HERE / "mpi_scripts" / script),
                           *args], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          env=env, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        pytest.fail(f"mpiexec -n {n} {script} exited with {proc.returncode}:\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def mpi_run(request, tmp_path_factory) -> tuple[int, list[dict]]:
    world, outdir = request.param, tmp_path_factory.mktemp(f"mpi{request.param}")
    _mpirun(world, "comm_check.py", str(outdir))
    return world, [torch.load(outdir / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.mark.timeout(120)
def test_mpi_communicator_matches_the_reference(mpi_run) -> None:
    world, outs = mpi_run
    _check(outs, world, exact=False)
    assert all(out["is_communicator"] for out in outs)


@pytest.mark.timeout(120)
def test_rma_put_and_get(mpi_run) -> None:
    """Disjoint puts from several ranks land in one window; gets need no call on the target."""
    world, outs = mpi_run
    row = lambda r: torch.arange(5, dtype=torch.float32) + 10 * r
    for r, out in enumerate(outs):
        rma = out["rma"]
        board = rma["board"]
        writers = set(range(world)) if r == 0 else {(r - 1) % world}
        for q in range(world):
            want = row(q) if q in writers else torch.full((5,), -1.0)
            assert torch.equal(board[q], want), (r, q)
        for q in range(world):
            assert torch.equal(rma["got"][q], torch.arange(3 + q) * (q + 1)), (r, q)
            want_bf = (torch.arange(4, dtype=torch.float32) + q).to(torch.bfloat16)
            assert rma["got_bf"][q].dtype == torch.bfloat16
            assert torch.equal(rma["got_bf"][q], want_bf), (r, q)
        nxt = (r + 1) % world
        assert torch.equal(rma["part"], (torch.arange(3 + nxt) * (nxt + 1))[1:3])
        assert rma["part_out"]
        assert "out= must be a contiguous CPU torch.int64 tensor of 3" in rma["errors"]["out"]
        assert rma["empty"] == [(0,)] * world
        assert rma["shape"] == ((3 + nxt,), torch.int64)
        assert rma["closed_names"] == ()
        assert "elements [2, 7) are outside 'mine' on rank 0, which has 3" in rma["errors"]["range"]
        assert "holds torch.int64, got a torch.float32" in rma["errors"]["dtype"]
        assert "nothing is exposed as 'nosuch'" in rma["errors"]["unknown"]


@pytest.mark.timeout(120)
def test_one_sided_mailbox_delivers_by_tag_and_step(mpi_run) -> None:
    """``Mailbox`` (a pipeline's transfers as puts, ``MESHPLAN_STAGE_TRANSFERS=rma``): each
    receive gets the value its sender put with that tag, in the tag's order, whatever order
    the tags were sent in, in each of two steps; the communicator records sends and receives
    as before, and each step's end (``Mailbox.end()``) as a barrier; a message of another size than the receiver's slot is refused by name."""
    world, outs = mpi_run
    for r, out in enumerate(outs):
        box = out["mailbox"]
        for got in box["got"][-1:]:
            for g, w in zip(got, box["want"]):
                assert g.dtype == w.dtype and torch.equal(g, w), (r, g, w)
        assert box["got"][0][0].shape == (2, 3)
        assert not torch.equal(box["got"][0][0], box["got"][1][0])     # step 1's, then 2's
        assert box["kinds"] == ["barrier", "recv", "send"]      # end(): the barrier
        assert f"rank {(r + 1) % world} takes 24 bytes there, this rank sends 20" in \
            box["wrong_size"], box["wrong_size"]


@pytest.mark.timeout(120)
def test_mpi_a_rank_that_never_joins_raises_within_the_timeout(mpi_run) -> None:
    world, outs = mpi_run
    if world != 2:
        pytest.skip("checked once, in the world-2 job")
    for key in ("timeout", "timeout_wait"):      # blocking; started, then waited for
        message, seconds = outs[0][key]
        assert "all_reduce on group (0, 1) timed out on rank 0 after 1 s (MPI)" in message, \
            (key, message)
        assert 0.9 <= seconds <= 5, (key, seconds)
    assert "is closed" in outs[0]["after_timeout"]


def test_missing_mpi4py_is_one_clear_error(monkeypatch) -> None:
    from meshplan._errors import RuntimeFailure
    from meshplan.backends import MPICommunicator

    monkeypatch.setitem(sys.modules, "mpi4py", None)     # import mpi4py -> ImportError
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(RuntimeFailure, match=r"MPI is not available.*pip install 'meshplan\[mpi\]'"):
        MPICommunicator()


# ---- the mpi launcher ------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "axes", "strategy"), EQUIVALENCE_CASES)
def test_mpi_launcher_steps_equal_one_process(name: str, axes: dict[str, int],
                                              strategy: str) -> None:
    """``launcher="mpi"``: MPICommunicator collectives; ``state_dict()`` gathered by RMA onto
    rank 0. Tolerances as ``test_distribute.py`` (rtol 1e-5 / atol 1e-6 on losses, atol 1e-5
    on weights: cross-rank sums run in MPI's order, not one process's). The run leaves nothing
    in /dev/shm (issue 19, point 4: MPICH's file stays when MPI is not finalized)."""
    def no_send(step) -> None:
        assert all(c["kind"] != "send" for rank in step.last_comm for c in rank)

    before = set(os.listdir("/dev/shm"))
    check_equal_to_one_process(name, axes, strategy, after_steps=no_send, launcher="mpi",
                               telemetry=False, timeout_s=60)
    # MPICH unlinks its file as the last rank finalizes: give the exits a moment (on a loaded
    # 2-core CI machine the file was seen once, and gone a little later)
    deadline = time.monotonic() + 5.0
    while set(os.listdir("/dev/shm")) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(os.listdir("/dev/shm")) - before == set()


@pytest.mark.timeout(60)
def test_mpi_a_failing_rank_is_raised_on_the_controller() -> None:
    import meshplan
    from test_distribute import _models

    ex, _ = _models("mlp")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", topology="h100",
                               launcher="mpi", telemetry=False, timeout_s=30,
                               fault_tolerance=False)    # its snapshot would refuse the piece
    with step:
        step(*ex.batch(0))
        _send_bad_piece(step, "fc1.weight")
        with pytest.raises(meshplan.RuntimeFailure) as err:
            step(*ex.batch(1))
        workers = step._workers
    text = str(err.value)
    assert "rank" in text and "mlp.py" in text, text
    assert workers is None or workers.closed


@pytest.mark.timeout(60)
def test_mpi_a_killed_rank_is_the_rank_named() -> None:
    """Issue 19, point 7: mpiexec ends every rank once one dies, so all look gone when the
    controller looks; the rank whose process ended first is the one named (was rank 0 in 2
    of 5 runs when rank 1 was killed)."""
    import meshplan
    from test_distribute import _models

    ex, _ = _models("mlp")
    step = meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", launcher="mpi",
                               telemetry=False, timeout_s=30, fault_tolerance=False)
    with step:
        step(*ex.batch(0))
        step(*ex.batch(1))
        os.kill(step._workers.pids[1], signal.SIGKILL)
        with pytest.raises(meshplan.RuntimeFailure, match=r"rank 1 (exited|was killed)"):
            step(*ex.batch(2))


def test_mpich_files_left_behind_are_removed_and_others_kept(tmp_path: Path) -> None:
    """A launch's stop removes the ``mpich_shm_*`` files that appeared during it and that no
    process maps once mpiexec has ended (a rank that did not finalize leaves one, 4 MiB, until
    reboot); a file another job's live ranks map stays, and so does one from before."""
    import mmap

    from meshplan.runtime._channel import ControllerChannel, Secret
    from meshplan.runtime._mpi_launch import _MPIGroup

    tag = os.urandom(4).hex()
    older, dead, live = (f"/dev/shm/mpich_shm_{tag}_{k}" for k in ("older", "dead", "live"))
    Path(older).write_bytes(b"\0" * 4096)
    group = _MPIGroup(ControllerChannel(Secret.new(), "t" + tag, "127.0.0.1"), tmp_path / "s")
    try:
        for path in (dead, live):
            Path(path).write_bytes(b"\0" * 4096)
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mapped:
            group.mpiexec = subprocess.Popen(["true"])
            group.mpiexec.wait()
            group.stop()
            assert not os.path.exists(dead)
            assert os.path.exists(live) and os.path.exists(older)
            assert mapped[0] == 0
    finally:
        for path in (older, dead, live):
            Path(path).unlink(missing_ok=True)


def _secrets() -> set[Path]:
    """The launcher's secret files in the temporary folder. Tests compare this set before and
    after, since a run killed with SIGKILL elsewhere on the machine may have left one behind."""
    return set(Path(tempfile.gettempdir()).glob("meshplan-*/secret"))


def test_missing_mpiexec_or_mpi4py_is_one_clear_error(monkeypatch, tmp_path) -> None:
    import importlib.util as iu

    import meshplan
    from meshplan.runtime import _mpi_launch
    from meshplan.runtime._mpi_launch import MPILauncher

    before = _secrets()
    with pytest.raises(meshplan.RuntimeFailure,
                       match=r"mpiexec '/nonexistent/mpiexec' does not exist.*"
                             r"pip install 'meshplan\[mpi\]'"):
        MPILauncher(mpiexec="/nonexistent/mpiexec").launch(2)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_mpi_launch.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(meshplan.RuntimeFailure, match=r"needs mpiexec.*meshplan\[mpi\]"):
        MPILauncher().launch(2)
    monkeypatch.undo()
    real = iu.find_spec
    monkeypatch.setattr(_mpi_launch.importlib.util, "find_spec",
                        lambda n, *a: None if n == "mpi4py" else real(n, *a))
    with pytest.raises(meshplan.RuntimeFailure, match=r"needs mpi4py.*meshplan\[mpi\]"):
        MPILauncher().launch(2)
    assert _secrets() <= before


CONTROLLER = '''
import sys, threading, time
from meshplan.runtime._mpi_launch import MPILauncher

box = {}
def go():
    box["w"] = MPILauncher().launch(2)
if sys.argv[1] == "thread":
    t = threading.Thread(target=go)
    t.start()
    t.join()
else:
    go()
w = box["w"]
w.broadcast("ping")
w.gather("ping", timeout_s=30)
print(w._group.mpiexec.pid, *w.pids, flush=True)
time.sleep(600)
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launched_from", ["main", "thread"])
def test_mpi_workers_die_with_a_killed_controller(launched_from: str, tmp_path: Path) -> None:
    """kill -9 of the controller: from the main thread mpiexec gets SIGTERM (PR_SET_PDEATHSIG)
    and ends its ranks; from a thread (no PDEATHSIG) each rank's watcher sees the controller's
    pid vanish and exits, after which hydra ends mpiexec. Either way nothing survives."""
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    before = _secrets()
    ctrl = subprocess.Popen([sys.executable, str(script), launched_from], stdout=subprocess.PIPE,
                            text=True)
    pids: list[int] = []
    try:
        line = ctrl.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3 and all(_alive(p) for p in pids), line
        assert _secrets() <= before
        os.kill(ctrl.pid, signal.SIGKILL)
        ctrl.wait(10)
        assert not _wait_gone(pids, 10)
    finally:
        ctrl.kill()
        ctrl.wait()
        ctrl.stdout.close()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_files_push_through_the_mpi_launcher(tmp_path: Path) -> None:
    """``push_files(..., launcher="mpi")`` (and ``files push --launcher mpi``): the same chain
    broadcast, with the workers started by mpiexec; every rank's copy equals the source."""
    from meshplan.runtime import push_files

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.bin").write_bytes(os.urandom(3 << 20))
    (src / "b.txt").write_text("hello\n")
    result = push_files(src, str(tmp_path / "dst{rank}"), ranks=2, launcher="mpi",
                        chunk_bytes=1 << 20)
    assert result.files_sent == 2
    for rank in range(2):
        for rel in ("sub/a.bin", "b.txt"):
            assert (tmp_path / f"dst{rank}" / rel).read_bytes() == (src / rel).read_bytes()


@pytest.mark.timeout(180)
def test_mpi_launcher_starts_from_a_pushed_checkpoint_and_sends_each_replica_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the mpi launcher does with the plan and the state, on dp=2 x tp=2 under Megatron:

    - the plan and a checkpoint go to every host through the chain first (into
      ``$MESHPLAN_CACHE/<host>/plans`` and ``.../checkpoints``); the ranks load that plan and
      read their slices of that checkpoint:
      saved on the local launcher after 2 steps (dp=2), resumed by mpiexec from other weights,
      the next losses equal one eager process (tolerance of ``test_distribute.py``);
    - the controller sends each distinct piece of the state once, to the lowest rank holding
      it; ranks holding a replica read it from there through an RMA window (``share_state``).
      Every piece here has 2 holders (the dp replicas), so ``load_state_dict`` carries at most
      the state's size, where one piece per rank would be twice that. The launch's setup takes
      the same path (every mpi equivalence case above runs it)."""
    import meshplan
    from meshplan.examples import gpt
    from meshplan.runtime._launch import Workers

    sent: dict[str, int] = {}
    real = Workers.send

    def counting(self, rank, kind, header=None, tensors=()):
        sent[kind] = sent.get(kind, 0) + sum(t.numel() * t.element_size() for t in tensors)
        return real(self, rank, kind, header, tensors)

    monkeypatch.setattr(Workers, "send", counting)
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path / "cache"))
    ref = gpt.build(optimizer="adamw", clip=1.0, seed=0)
    want = [ref.step(*ref.batch(i)).detach() for i in range(5)]
    ex = gpt.build(optimizer="adamw", clip=1.0, seed=0)
    path = tmp_path / "gpt.safetensors"
    with meshplan.distribute(ex.step, mesh={"dp": 2}, strategy="dp", topology="h100") as step:
        for i in range(2):
            step(*ref.batch(i))
        step.save_checkpoint(path)
    other = gpt.build(optimizer="adamw", clip=1.0, seed=1)
    sent.clear()
    with meshplan.distribute(other.step, mesh={"dp": 2, "tp": 2}, strategy="megatron_tp",
                             topology="h100", launcher="mpi", checkpoint=path) as step:
        for i in range(2, 4):
            torch.testing.assert_close(step(*ref.batch(i)).detach(), want[i],
                                       rtol=1e-5, atol=1e-6, msg=f"loss at step {i}")
        assert sent["setup"] == 0                     # every rank read the state from the file
        sd = step.state_dict()
        state_bytes = sum(t.numel() * t.element_size() for t in step._named_state().values())
        step.load_state_dict(sd)
        assert 0 < sent["set_state"] <= state_bytes, (sent, state_bytes)
        torch.testing.assert_close(step(*ref.batch(4)).detach(), want[4],
                                   rtol=1e-5, atol=1e-6, msg="loss after load_state_dict")
    copies = list((tmp_path / "cache").rglob("gpt.safetensors"))
    assert len(copies) == 1 and copies[0].read_bytes() == path.read_bytes()
    (plan_copy,) = (tmp_path / "cache").rglob("*.plan")      # the plan went the same way
    assert meshplan.Plan.load(plan_copy).to_json() == step.plan.to_json()
