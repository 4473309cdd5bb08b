"""Several "hosts" on one machine, for multi-host tests and for trying a multi-host run on a
laptop: ``meshplan sandbox up --hosts N`` / ``run -- CMD`` / ``down``.

Each host is a set of Linux namespaces held by one process (``_sandbox_holder.py``):

- network: its own interfaces, with ``eth0`` on a bridge that lives in a separate network
  namespace of its own (the sandbox's switch), so the sandbox's addresses (``10.213.0.0/24``)
  exist only inside the sandbox and never touch the machine's own network;
- UTS: its own hostname, ``<name>-h<i>``;
- mount: its own ``/dev/shm`` and ``/tmp`` (fresh tmpfs), and an ``/etc/hosts`` that names every
  host of the sandbox; the rest of the file system is the machine's (the code, the virtual
  environment), as on a cluster with a shared home, and so are the top folders under /tmp
  that hold this project, the working directory or the Python environment at ``up`` (a CI
  job that cloned into /tmp);
- IPC: its own System V shared memory and semaphores.

What is shared, since it is one machine: the CPUs and memory, the kernel, and the process ids
(a host can see another's processes in ``/proc``). MPICH's default network module (UCX) uses
the last to move bytes between hosts through shared memory, past the network, so ``run`` sets
``MPIR_CVAR_CH4_NETMOD=ofi`` and ``FI_PROVIDER=tcp``: between hosts MPI then goes over the
sandbox's links (which ``tc`` can shape), inside a host through MPICH's shared memory.

One more host, ``<name>-ctl``, is where ``sandbox run`` runs its command: the controller, on its
own "login node", with ``MESHPLAN_HOSTS`` (the hosts, comma-separated, which ``hosts=None`` under
``launcher="mpi"`` reads), ``MESHPLAN_SANDBOX`` and MPICH's ``HYDRA_LAUNCHER=ssh`` /
``HYDRA_LAUNCHER_EXEC`` set: the sandbox's ``ssh`` stand-in, which runs a command on a host by
entering its namespaces (there is no sshd in a sandbox), so ``mpiexec -hosts`` works unchanged.

Nothing is named outside the processes: no ``ip netns`` entries, no bind-mounted namespace
files. The state file (``/run/meshplan-sandbox/<name>/state.json``) records the holders' pids;
``down`` stops them, and each holder kills every process left in its network namespace on the
way out, so the namespaces, veths and addresses go with them. With ``owner=`` (the test fixture
passes its own pid) the holders also end by themselves when the owner ends, however it ends.

With ``--slurm`` the sandbox is also a Slurm cluster: ``munged`` (one, with a key made for this
sandbox, its socket in the state folder that every host sees), ``slurmctld`` on ``<name>-ctl``
and one ``slurmd`` per host, each in its host's namespaces, from the machine's own Slurm
(Debian's ``slurm-wlm`` and ``munge``). The configuration (``<state>/slurm/slurm.conf``, which
``run`` names in ``SLURM_CONF``) has one partition, ``main``, with every host; each node
declares ``--cpus`` CPUs (default: this machine's count; they are the same CPUs). No cgroups,
no accounting database: process tracking by ``/proc`` (``proctrack/linuxproc``). The daemons
live in the hosts' network namespaces, so ``down`` (and the owner's end) stops them with the
rest.

Needs root (``CAP_SYS_ADMIN``, ``CAP_NET_ADMIN``), ``unshare``, ``nsenter`` and ``ip``; ``Sandbox.
check()`` says which is missing (``check(slurm=True)``: and Slurm's daemons).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from .._errors import RuntimeFailure
from ..ir import atomic_write_text

ROOT = Path(os.environ.get("MESHPLAN_SANDBOX_DIR", "/run/meshplan-sandbox"))
SUBNET = ipaddress.ip_network("10.213.0.0/24")
CTL_ADDRESS = 2             # .2: the controller's host; hosts from .10
FIRST_HOST = 10
MAX_HOSTS = 200
DEFAULT_NAME = "meshplan"
_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
_HOLDER = Path(__file__).with_name("_sandbox_holder.py")
_TOOLS = ("unshare", "nsenter", "ip", "mount", "setpriv")
_SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "srun", "salloc", "sinfo", "scontrol")


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    address: str
    pid: int                 # the holder: its namespaces are the host's


class Sandbox:
    """A running sandbox (``Sandbox.up``), or one found by name (``Sandbox.open``)."""

    def __init__(self, name: str, hosts: list[Host], ctl: Host, switch_pid: int,
                 owner: int | None, slurm: bool = False) -> None:
        self.name, self.hosts, self.ctl = name, hosts, ctl
        self.switch_pid, self.owner, self.slurm = switch_pid, owner, slurm

    # ---- bringing it up and down ------------------------------------------------------------

    @staticmethod
    def check(slurm: bool = False) -> None:
        """Raise RuntimeFailure naming what this machine lacks for a sandbox (``slurm``: one
        with Slurm's daemons)."""
        if not sys.platform.startswith("linux"):
            raise RuntimeFailure("meshplan sandbox needs Linux namespaces; this is "
                                 f"{sys.platform}")
        if os.geteuid() != 0:
            raise RuntimeFailure("meshplan sandbox needs root (it makes network, UTS and "
                                 "mount namespaces); run it with sudo or as root")
        missing = [t for t in _TOOLS if shutil.which(t) is None]
        if missing:
            raise RuntimeFailure(f"meshplan sandbox needs {', '.join(missing)} on PATH "
                                 "(Debian: apt-get install util-linux iproute2)")
        missing = [t for t in _SLURM_TOOLS if slurm and _which(t) is None]
        if missing:
            raise RuntimeFailure(f"meshplan sandbox up --slurm needs {', '.join(missing)} "
                                 "(Slurm's daemons and client, and munge; Debian: apt-get "
                                 "install slurmctld slurmd slurm-client munge)")
        try:
            subprocess.run(["unshare", "--net", "--uts", "--mount", "true"], check=True,
                           capture_output=True, timeout=30)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            err = getattr(exc, "stderr", b"") or b""
            raise RuntimeFailure("meshplan sandbox: this machine does not allow new "
                                 f"namespaces here ({err.decode(errors='replace').strip()}); "
                                 "in a container, run it with --privileged") from None

    @classmethod
    def up(cls, hosts: int, name: str = DEFAULT_NAME, *, owner: int | None = None,
           timeout_s: float = 30.0, slurm: bool = False, cpus: int | None = None) -> Sandbox:
        """Make ``hosts`` hosts (and the controller's) on a private bridge. ``owner``: a pid
        whose end takes the sandbox down by itself (default: none; ``down`` does); ``slurm``:
        also run a Slurm cluster over them, each node with ``cpus`` CPUs (module docstring)."""
        _check_name(name)
        if not 1 <= hosts <= MAX_HOSTS:
            raise RuntimeFailure(f"meshplan sandbox up: --hosts {hosts}: make 1 to "
                                 f"{MAX_HOSTS} hosts")
        cpus = cpus or os.cpu_count() or 1
        if cpus < 1:
            raise RuntimeFailure(f"meshplan sandbox up: --cpus {cpus}: give 1 or more")
        cls.check(slurm)
        where = ROOT / name
        if (where / "state.json").exists():
            old = cls.open(name)
            if old.alive():
                raise RuntimeFailure(f"a sandbox named {name!r} is already up "
                                     f"({len(old.hosts)} hosts); `meshplan sandbox down "
                                     f"--name {name}` first, or pick another --name")
            old.down()                       # its holders are gone (a crash): clear the rest
        where.mkdir(parents=True, exist_ok=True)
        names = [f"{name}-ctl"] + [f"{name}-h{i}" for i in range(hosts)]
        addrs = [str(SUBNET[CTL_ADDRESS])] + [str(SUBNET[FIRST_HOST + i]) for i in range(hosts)]
        hosts_file = where / "hosts"
        hosts_file.write_text("127.0.0.1\tlocalhost\n::1\tlocalhost\n" + "".join(
            f"{a}\t{n}\n" for n, a in zip(names, addrs)))
        started: list[subprocess.Popen] = []
        try:
            switch = _start_holder(["--net"], [], owner, started, timeout_s)
            _ip(["link", "add", "br0", "type", "bridge"], switch)
            _ip(["link", "set", "br0", "up"], switch)
            made = []
            keep = [a for k in _kept() for a in ("--keep", k)]
            for i, (host, addr) in enumerate(zip(names, addrs)):
                pid = _start_holder(["--net", "--uts", "--ipc", "--mount", "--propagation",
                                     "private"],
                                    ["--hostname", host, "--hosts-file", str(hosts_file),
                                     "--stash", str(where), *keep],
                                    owner, started, timeout_s)
                port = f"mp{i}"
                subprocess.run(["ip", "link", "add", "eth0", "netns", str(pid), "type", "veth",
                                "peer", "name", port, "netns", str(switch)], check=True,
                               capture_output=True)
                _ip(["link", "set", port, "master", "br0"], switch)
                _ip(["link", "set", port, "up"], switch)
                _ip(["addr", "add", f"{addr}/{SUBNET.prefixlen}", "dev", "eth0"], pid)
                _ip(["link", "set", "eth0", "up"], pid)
                made.append(Host(host, addr, pid))
        except BaseException:
            for proc in started:
                proc.terminate()
            for proc in started:
                _reap(proc, 5.0)
            shutil.rmtree(where, ignore_errors=True)
            raise
        box = cls(name, made[1:], made[0], switch, owner, slurm)
        box._write_shim()
        atomic_write_text(where / "state.json", json.dumps(box.to_dict(), indent=1))
        if slurm:
            try:
                box._start_slurm(cpus, timeout_s)
            except BaseException:
                box.down()
                raise
        return box

    # ---- Slurm ------------------------------------------------------------------------------

    @property
    def slurm_dir(self) -> Path:
        return ROOT / self.name / "slurm"

    def _start_slurm(self, cpus: int, timeout_s: float) -> None:
        """munged, slurmctld on the controller's host, a slurmd on every host; returns when
        every node is idle (module docstring)."""
        d = self.slurm_dir
        d.mkdir(mode=0o755)
        d.chmod(0o755)                  # munged wants every folder above its socket searchable
        (d / "state").mkdir(mode=0o700)
        fd = os.open(d / "munge.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
        conf = d / "slurm.conf"
        atomic_write_text(conf, _slurm_conf(self, d, cpus))
        self._daemon(self.ctl, ["munged", f"--socket={d / 'munge.socket'}",
                                f"--key-file={d / 'munge.key'}",
                                f"--pid-file={d / 'munged.pid'}",
                                f"--log-file={d / 'munged.log'}",
                                f"--seed-file={d / 'munged.seed'}"])
        self._daemon(self.ctl, ["slurmctld", "-f", str(conf)])
        for h in self.hosts:
            self._daemon(h, ["slurmd", "-f", str(conf), "-N", h.name])
        deadline = time.monotonic() + max(timeout_s, 30.0)
        states = ""
        while time.monotonic() < deadline:
            done = subprocess.run(self.argv(["sinfo", "-h", "-N", "-o", "%N %t"]),
                                  capture_output=True, text=True, timeout=30)
            states = done.stdout.strip() or done.stderr.strip()
            found = dict(line.split()[:2] for line in done.stdout.splitlines()
                         if len(line.split()) >= 2)
            if len(found) == len(self.hosts) and all(v == "idle" for v in found.values()):
                return
            time.sleep(0.3)
        logs = "".join(f"\n  {p.name}: {_last_line(p)}" for p in sorted(d.glob("*.log")))
        raise RuntimeFailure(f"meshplan sandbox up --slurm: the nodes did not come up within "
                             f"{max(timeout_s, 30.0):g} s (sinfo: {states or 'nothing'}); the "
                             f"daemons' last words:{logs}")

    def _daemon(self, host: Host, cmd: list[str]) -> None:
        """Start a daemon (it forks into the background) in ``host``'s namespaces."""
        argv = [*_enter(host.pid), "--", _which(cmd[0]) or cmd[0], *cmd[1:]]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        if done.returncode:
            raise RuntimeFailure(f"meshplan sandbox up --slurm: `{shlex.join(cmd)}` on "
                                 f"{host.name} failed (exit {done.returncode}): "
                                 f"{(done.stderr or done.stdout).strip()}")

    def down(self, timeout_s: float = 10.0) -> None:
        """Stop every holder (each kills what still runs on its host) and forget the sandbox.
        Safe to call twice, and on a sandbox whose holders already ended."""
        pids = self._holders()
        for pid in pids:
            if _is_holder(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(_is_holder(p) for p in pids):
            time.sleep(0.05)
        for pid in pids:
            if _is_holder(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(ROOT / self.name, ignore_errors=True)

    def alive(self) -> bool:
        return all(_is_holder(p) for p in self._holders())

    def _holders(self) -> list[int]:
        """The pids of the processes that hold the hosts' (and the switch's) namespaces."""
        return [h.pid for h in (*self.hosts, self.ctl)] + [self.switch_pid]

    # ---- finding and using it ---------------------------------------------------------------

    @classmethod
    def open(cls, name: str = DEFAULT_NAME) -> Sandbox:
        _check_name(name)
        path = ROOT / name / "state.json"
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise RuntimeFailure(f"no sandbox named {name!r} is up (no {path}); start one "
                                 f"with `meshplan sandbox up --hosts N --name {name}`") from None
        except (OSError, ValueError) as exc:
            raise RuntimeFailure(f"sandbox state {path} is unreadable ({exc}); remove "
                                 f"{path.parent} and run `meshplan sandbox up` again") from None
        return cls(d["name"], [Host(**h) for h in d["hosts"]], Host(**d["ctl"]),
                   int(d["switch_pid"]), d.get("owner"), bool(d.get("slurm")))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "hosts": [asdict(h) for h in self.hosts],
                "ctl": asdict(self.ctl), "switch_pid": self.switch_pid, "owner": self.owner,
                "slurm": self.slurm}

    def host(self, name: str) -> Host:
        for h in (*self.hosts, self.ctl):
            if h.name == name:
                return h
        raise RuntimeFailure(f"sandbox {self.name!r} has no host {name!r}; its hosts are "
                             f"{', '.join(h.name for h in (*self.hosts, self.ctl))}")

    @property
    def shim(self) -> Path:
        """The ``ssh`` stand-in: ``shim [ssh options] HOST COMMAND...``."""
        return ROOT / self.name / "ssh"

    def env(self) -> dict[str, str]:
        """What ``run`` adds to a command's environment."""
        slurm = {"SLURM_CONF": str(self.slurm_dir / "slurm.conf")} if self.slurm else {}
        return {**slurm, "MESHPLAN_HOSTS": ",".join(h.name for h in self.hosts),
                "MESHPLAN_SANDBOX": self.name,
                "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(self.shim),
                # MPICH's default netmod, UCX, sees one kernel (one boot id) and moves bytes
                # between the "hosts" through shared memory it finds by /proc, past the
                # sandbox's network; OFI's tcp provider sends them over the hosts' links,
                # while MPICH's own shared memory still serves ranks inside one host
                "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}

    def argv(self, cmd: Sequence[str], host: str | None = None) -> list[str]:
        """``cmd`` as it runs on ``host`` (default: the controller's), in the current working
        directory, with ``env()`` set."""
        h = self.ctl if host is None else self.host(host)
        if not _is_holder(h.pid):
            raise RuntimeFailure(f"sandbox {self.name!r} is down (host {h.name}'s holder "
                                 f"{h.pid} ended); `meshplan sandbox down --name {self.name}` "
                                 "then `up` again")
        env = [f"{k}={v}" for k, v in self.env().items()]
        return [*_enter(h.pid), f"--wd={os.getcwd()}", "--", "env", *env, *cmd]

    def run(self, cmd: Sequence[str], host: str | None = None,
            **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(cmd, host), **kwargs)

    def _write_shim(self) -> None:
        cases = "".join(f"  {h.name}) pid={h.pid} ;;\n" for h in (*self.hosts, self.ctl))
        text = f"""#!/bin/sh
# ssh stand-in for meshplan sandbox {self.name!r}: [ssh options] HOST COMMAND...
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
host=$1; shift
case "$host" in
{cases}  *) echo "meshplan sandbox {self.name}: no host $host" >&2; exit 255 ;;
esac
# as over ssh, the command ends with the launcher that started it (sshd hangs up on a
# session whose client is gone): a supervising shell gets SIGTERM when its parent (mpiexec)
# ends, and then kills the command's process group (hydra's proxy makes its own session);
# a parent gone before that signal was asked for is caught by the check after the trap
# (this shell's parent is then no longer the one that ran us, or was init already)
exec nsenter --target "$pid" --net --uts --ipc --mount --wd="$PWD" -- \
  setpriv --pdeathsig TERM -- /bin/sh -c '
    /bin/sh -c "exec $1" <&0 &
    child=$!
    trap "kill -KILL -$child $child 2>/dev/null; exit 129" TERM HUP INT
    read -r _ _ _ ppid _ < /proc/$$/stat
    [ "$ppid" = "$2" ] && [ "$2" != 1 ] || {{ kill -KILL -$child $child 2>/dev/null; exit 129; }}
    wait $child' supervise "$*" "$PPID"
"""
        atomic_write_text(self.shim, text)
        self.shim.chmod(0o755)


def _slurm_conf(box: Sandbox, d: Path, cpus: int) -> str:
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN\n"
                    for h in box.hosts)
    return f"""# meshplan sandbox {box.name!r}: a Slurm cluster of {len(box.hosts)} node(s), one machine
ClusterName={box.name}
SlurmctldHost={box.ctl.name}({box.ctl.address})
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d / 'munge.socket'}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool-%n'}
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'slurmctld.log'}
SlurmdLogFile={d / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
{nodes}PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def _which(tool: str) -> str | None:
    """A tool on PATH or in the sbin folders (daemons live there, and a user's PATH may lack
    them)."""
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/local/sbin")


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(unreadable)"
    return lines[-1] if lines else "(empty)"


def _enter(pid: int) -> list[str]:
    """``nsenter`` into every namespace of the host that ``pid`` holds."""
    return ["nsenter", "--target", str(pid), "--net", "--uts", "--ipc", "--mount"]


def _kept() -> list[str]:
    """The folders under /tmp that every host keeps seeing (its own /tmp hides the rest): this
    project, the working directory and the Python environment, when they live there (a CI
    job cloned into /tmp)."""
    tmp = Path("/tmp").resolve()
    found = []
    package = Path(__file__).resolve().parents[1]           # meshplan's folder
    for p in (Path.cwd(), Path(sys.prefix), package):
        p = p.resolve()
        if p.is_dir() and tmp in p.parents and p.parts[:len(tmp.parts) + 1] not in found:
            found.append(p.parts[:len(tmp.parts) + 1])     # its top folder under /tmp
    return [str(Path(*parts)) for parts in found]


def _check_name(name: str) -> None:
    if not _NAME.match(name or ""):
        raise RuntimeFailure(f"sandbox name {name!r}: use 1-12 lowercase letters and digits, "
                             "starting with a letter (it prefixes the host names)")


def _start_holder(unshare: list[str], args: list[str], owner: int | None,
                  started: list[subprocess.Popen], timeout_s: float) -> int:
    cmd = ["unshare", *unshare, sys.executable, "-I", str(_HOLDER), *args]
    if owner:
        cmd += ["--owner", str(owner)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    started.append(proc)
    line = _read_line(proc, timeout_s)
    if line != "ready":
        proc.kill()
        err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
        raise RuntimeFailure(f"meshplan sandbox: a host did not start ({' '.join(cmd)}): "
                             f"{err or line or 'no output'}")
    # the holder is `unshare`'s child when unshare forks; without --fork it is the same pid
    return proc.pid


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().decode().strip() if ready else ""


def _reap(proc: subprocess.Popen, timeout_s: float) -> None:
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ip(args: list[str], pid: int) -> None:
    cmd = ["nsenter", "--target", str(pid), "--net", "--", "ip", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeFailure(f"meshplan sandbox: `{shlex.join(cmd)}` failed: "
                             f"{done.stderr.strip()}")


def _is_holder(pid: int) -> bool:
    """Whether ``pid`` is still a sandbox holder (not a reused pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return _HOLDER.name.encode() in cmd


