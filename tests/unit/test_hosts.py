"""Where ``launcher="mpi"`` puts ranks over several hosts (``runtime/_mpi_launch.host_slots``):
names, slots, hostfiles, ``$MESHPLAN_HOSTS``, and one clear error for each mistake."""

from __future__ import annotations

import pytest

import meshplan
from meshplan._errors import RuntimeFailure
from meshplan.runtime._mpi_launch import controller_address, host_slots


def test_ranks_fill_hosts_in_order_so_inner_axes_stay_inside_one() -> None:
    assert host_slots(["a", "b"], 4, env={}) == [("a", 2), ("b", 2)]
    assert host_slots("a:4,b:4", 6, env={}) == [("a", 4), ("b", 2)]
    assert host_slots("a:2,b:2,c:2", 4, env={}) == [("a", 2), ("b", 2)]   # c is not used
    assert host_slots(None, 4, env={}) is None                            # this host only
    assert host_slots(None, 2, env={"MESHPLAN_HOSTS": "x,y"}) == [("x", 1), ("y", 1)]


def test_a_hostfile_as_mpiexec_reads_it(tmp_path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# the job's nodes\nnode1:2\n\nnode2:2  # second\n")
    assert host_slots(str(f), 4, env={}) == [("node1", 2), ("node2", 2)]
    assert host_slots(f, 3, env={}) == [("node1", 2), ("node2", 1)]


@pytest.mark.parametrize("hosts, n, match", [
    (["a", "b"], 3, "do not split evenly over the 2 hosts"),
    ("a:1,b:1", 4, "the mesh has 4 ranks but hosts= has 2 slots"),
    ("a:2,b", 4, "slots for some hosts only"),
    ("a,a", 2, "names a host twice"),
    ("a:x", 2, "is not host or host:slots"),
    ("a:0", 2, "has no slots"),
    (" , ", 2, "names no host"),
])
def test_bad_hosts_say_what_and_how_to_fix(hosts, n, match) -> None:
    with pytest.raises(RuntimeFailure, match=match):
        host_slots(hosts, n, env={})


def test_empty_hostfile_and_unknown_host(tmp_path) -> None:
    f = tmp_path / "hosts"
    f.write_text("# nothing\n")
    with pytest.raises(RuntimeFailure, match=f"hostfile {f} names no host"):
        host_slots(str(f), 2, env={})
    with pytest.raises(RuntimeFailure, match="does not resolve"):
        controller_address(["no-such-host.invalid"])
    with pytest.raises(RuntimeFailure, match=r"fix the name in \$MESHPLAN_HOSTS"):
        controller_address(["no-such-host.invalid"], "$MESHPLAN_HOSTS")
    assert controller_address(["localhost"]) == "127.0.0.1"


def test_hosts_need_the_mpi_launcher() -> None:
    with pytest.raises(RuntimeFailure, match="hosts= places ranks under launcher='mpi'"):
        meshplan.distribute(lambda x: x, mesh={"dp": 2}, hosts=["a", "b"])


def test_run_cli_hosts_need_the_mpi_launcher(capsys) -> None:
    from meshplan.cli import main

    assert main(["run", "examples/gpt.py:train_step", "--plan", "x.plan", "--hosts", "a,b"]) == 1
    assert "--hosts places ranks under --launcher mpi" in capsys.readouterr().err


def test_the_launchers_own_words_survive_later_lines() -> None:
    """mpiexec's error keeps the sandbox's or ssh's line naming the host, however many
    hydra or rank lines came after it (under load the "no host" line fell out of the last
    10, and tests/dist/test_sandbox.py's unreachable-host check failed)."""
    from meshplan.runtime._mpi_launch import _last_words

    tail = ["[proxy:0@h0] started", "meshplan sandbox x: no host 10.1.2.3",
            *[f"[mpiexec@ctl] line {i}" for i in range(12)]]
    said = _last_words(tail)
    assert said[0] == "meshplan sandbox x: no host 10.1.2.3"
    assert said[1:] == tail[-10:]
    assert _last_words(tail[1:6]) == tail[1:6]        # short: all of it, once
    # a rank that did start prints a traceback (not bracketed) after it: the cause stays first
    tail = [tail[1], *[f"  File x.py, line {i}" for i in range(6)], *tail[2:]]
    said = _last_words(tail)
    assert said[0] == "meshplan sandbox x: no host 10.1.2.3" and said[-10:] == tail[-10:]


def test_a_lost_host_leaves_the_others_and_the_spares() -> None:
    """``fault_tolerance=True`` under mpi: after a host is lost, the hosts a new mesh may use
    (each with its slots, or as many ranks as it ran: those given without slots), spares
    included; whether the same mesh fits on them decides between moving and shrinking."""
    from types import SimpleNamespace

    from meshplan.runtime._distributed import DistributedStep

    def lost(hosts, ranks, world):
        return DistributedStep._lost_hosts(SimpleNamespace(hosts=hosts, launcher="mpi"), ranks,
                                          world)

    assert lost("a:2,b:2,c:2", [2], 4) == ({2, 3}, ["a:2", "c:2"], ["b"])
    assert host_slots(["a:2", "c:2"], 4, env={}) == [("a", 2), ("c", 2)]   # c takes b's ranks
    assert lost(["a", "b"], [3, 2], 4) == ({2, 3}, ["a:2"], ["b"])         # no spare: shrink
    assert lost(None, [1], 2) is None                                       # one host


def test_the_launcher_is_asked_again_which_hosts_it_reaches(tmp_path) -> None:
    """When mpiexec ends before every rank started, its launcher's own words may not have
    come through it: ``probe_hosts`` runs the launcher (here a stand-in, as the sandbox's
    ``HYDRA_LAUNCHER_EXEC``) with ``true`` on each host and names those it did not reach,
    with what it said; this host is not asked."""
    import socket

    from meshplan.runtime._mpi_launch import probe_hosts

    shim = tmp_path / "ssh"
    shim.write_text('#!/bin/sh\ncase "$1" in good) exit 0 ;; '
                    '*) echo "no route to $1" >&2; exit 255 ;; esac\n')
    shim.chmod(0o755)
    env = {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(shim), "PATH": "/usr/bin:/bin"}
    said = probe_hosts(["good", "10.9.9.9", socket.gethostname()], env)
    assert said == ["10.9.9.9: ssh exited 255: no route to 10.9.9.9"]
    assert probe_hosts(["good"], env) == []
    assert probe_hosts(["x"], {**env, "HYDRA_LAUNCHER": "slurm"}) == []   # not ssh-like
