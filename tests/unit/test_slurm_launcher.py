"""The ``slurm`` launcher's decisions that need no cluster (``runtime/_slurm_launch.py``):
its options, Slurm's CPU and exit notations, how many nodes and whether they fit, and one
clear error for each mistake. The launcher itself runs against a real slurmctld / slurmd in
``tests/dist/test_sandbox.py``."""

from __future__ import annotations

import os
import signal

import pytest

import meshplan
from meshplan._errors import RuntimeFailure
from meshplan.runtime._slurm_launch import (
    Allocation,
    SlurmLauncher,
    SlurmOptions,
    _check_fits,
    slurm_nodes,
    _task_code,
    cpus_per_node,
)


def test_options_from_a_dict_or_the_cli_string() -> None:
    a = SlurmOptions.parse({"nodes": 2, "partition": "gpu", "time": 30, "args": ["--exclusive"]})
    b = SlurmOptions.parse("nodes=2,partition=gpu,time=30,args=--exclusive")
    assert a == b and a.nodes == 2 and a.time == "30"
    assert a.salloc_args() == ["--partition=gpu", "--time=30", "--exclusive"]
    assert SlurmOptions.parse({"overcommit": "true"}).salloc_args() == ["--overcommit"]
    assert SlurmOptions.parse(None) == SlurmOptions()


@pytest.mark.parametrize("value, match", [
    ({"node": 2}, "unknown option 'node'; the options are"),
    ({"nodes": 0}, "nodes=0; give a whole number >= 1"),
    ({"nodes": "two"}, "nodes='two'"),
    ({"wait_s": -1}, "wait_s=-1; give seconds > 0"),
    ({"nodes": 2, "spare_nodes": -1}, "spare_nodes=-1; give a whole number >= 0"),
    ({"spare_nodes": 1}, "spare_nodes=1 needs nodes= too"),
    ("nodes", "'nodes' is not key=value"),
    (3, "pass a dict"),
])
def test_bad_options_say_which_and_how(value, match) -> None:
    with pytest.raises(RuntimeFailure, match=match):
        SlurmOptions.parse(value)


def test_slurm_notations() -> None:
    assert cpus_per_node("4(x2),2", 3) == [4, 4, 2]
    assert cpus_per_node("72", 1) == [72]
    assert cpus_per_node("", 2) == [0, 0]             # unknown: not checked
    assert _task_code("Exited with exit code 3") == 3
    assert _task_code("Killed") == -signal.SIGKILL
    assert _task_code("Terminated") == -signal.SIGTERM
    assert _task_code("Segmentation fault") == -signal.SIGSEGV
    assert _task_code("something else") is None


def test_nodes_used_and_whether_the_ranks_fit() -> None:
    alloc = Allocation("7", ["n0", "n1", "n2", "n3"], [8, 8, 8, 4])
    assert slurm_nodes(alloc, 8, None) == 4            # every node the ranks split evenly over
    assert slurm_nodes(alloc, 6, None) == 3
    assert slurm_nodes(alloc, 2, 1) == 1
    with pytest.raises(RuntimeFailure, match="5 nodes asked .*--slurm nodes=5.* has 4 nodes "
                       ".*ask salloc/sbatch for --nodes=5"):
        slurm_nodes(alloc, 10, 5)
    with pytest.raises(RuntimeFailure, match="6 ranks do not split evenly over 4 nodes"):
        slurm_nodes(alloc, 6, 4)
    _check_fits(alloc, 3, 8, overcommit=False)        # n0-n2 have 8
    with pytest.raises(RuntimeFailure, match="too small .*n3 has 4.*'overcommit': True"):
        _check_fits(alloc, 4, 8, overcommit=False)
    _check_fits(alloc, 4, 8, overcommit=True)


def test_a_lost_node_is_out_of_the_allocation_for_every_later_launch(monkeypatch) -> None:
    """Fault tolerance takes a lost node out (``lose``): the nodes and CPUs left, and the
    environment later launchers read the allocation from says so too (they name their nodes
    to srun and share CPUs with the steps Slurm still counts on the lost node)."""
    monkeypatch.setattr("meshplan.runtime._slurm_launch.expand_nodelist",
                        lambda text: text.split(","))
    alloc = Allocation("7", ["n0", "n1", "n2"], [8, 4, 2])
    alloc.lose(["n1"])
    assert (alloc.nodes, alloc.cpus, alloc.lost) == (["n0", "n2"], [8, 2], ["n1"])
    again = Allocation.current(alloc.environ({}))
    assert (again.nodes, again.cpus, again.lost) == (["n0", "n2"], [8, 2], ["n1"])
    assert slurm_nodes(again, 4, 2) == 2
    assert Allocation.current(Allocation("7", ["n0"], [8]).environ({})).lost == []


def test_distribute_options_belong_to_their_launcher() -> None:
    with pytest.raises(RuntimeFailure, match="slurm= sets the Slurm launcher's options"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, slurm={"nodes": 2})
    with pytest.raises(RuntimeFailure, match="launcher='slurm' runs the ranks on the Slurm"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, launcher="slurm", hosts=["a"])
    with pytest.raises(RuntimeFailure, match="launcher 'ray' is not available; use one of"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, launcher="ray")
    with pytest.raises(RuntimeFailure, match="k8s= sets the Kubernetes launcher's options"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, k8s={"image": "x"})
    with pytest.raises(RuntimeFailure, match="unknown option 'gpus'"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, launcher="slurm", slurm={"gpus": 8})


def test_without_slurm_commands_one_error_and_nothing_started(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))         # no srun, salloc, scontrol
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with pytest.raises(RuntimeFailure, match="needs `srun`, which is not on PATH.*slurm-client"):
        SlurmLauncher({"nodes": 2}, env=env).launch(4)


def test_run_cli_slurm_options_need_the_slurm_launcher(capsys) -> None:
    from meshplan.cli import main

    assert main(["run", "examples/gpt.py:train_step", "--plan", "x.plan", "--slurm",
                 "nodes=2"]) == 1
    assert "--slurm sets the Slurm launcher's options; add --launcher slurm" in \
        capsys.readouterr().err


def test_the_allocation_line_is_read_whole(capsys) -> None:
    """salloc's holding shell says what was granted in one line; a line that arrives in two
    reads is taken whole, not cut at the first read (a nodelist cut short names other nodes)."""
    import subprocess

    from meshplan.runtime._slurm_launch import _wait_granted

    proc = subprocess.Popen(
        ["sh", "-c", "echo 'salloc: Granted job allocation 12' >&2; "
         "printf 'meshplan-allocation 12 n[01-0'; sleep 0.3; printf '2] 4(x2)\\n'; sleep 30"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    alloc = Allocation("", [], [], proc)
    try:
        said: list[str] = []
        assert _wait_granted(proc, said, 10.0, 2, alloc) == "meshplan-allocation 12 n[01-02] 4(x2)"
        assert alloc.job_id == "12" and said == ["salloc: Granted job allocation 12"]
    finally:
        proc.kill()
        proc.wait()
