"""``meshplan sandbox``: several "hosts" on this machine as Linux namespaces
(``meshplan/runtime/_sandbox.py``).

    meshplan sandbox up --hosts N [--name NAME] [--slurm [--cpus K]]
                                                    make NAME-h0 .. NAME-h<N-1> and NAME-ctl
                                                    (--slurm: and a Slurm cluster over them)
    meshplan sandbox run [--name NAME] [--host H] -- CMD...
                                                    run CMD on NAME-ctl (or H), MESHPLAN_HOSTS set
    meshplan sandbox status [--name NAME] [--json]  the hosts, their addresses, whether up
    meshplan sandbox down [--name NAME]             stop everything, leave nothing behind
"""

from __future__ import annotations

import argparse
import json
import sys

from ._cli_run import _guarded
from ._errors import RuntimeFailure


def add_sandbox_commands(sub: argparse._SubParsersAction) -> None:
    from .runtime._sandbox import DEFAULT_NAME

    sb = sub.add_parser("sandbox", help="several hosts on this machine (Linux namespaces), for "
                        "trying multi-host runs")
    sb_sub = sb.add_subparsers(dest="sandbox_command", required=True)

    def named(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--name", default=DEFAULT_NAME,
                       help=f"which sandbox (default {DEFAULT_NAME}); prefixes its host names")
        p.add_argument("--debug", action="store_true", help="show the traceback of a failure")
        return p

    up = named(sb_sub.add_parser("up", help="make N hosts and a controller host on a private "
                                 "bridge (needs root)"))
    up.add_argument("--hosts", type=int, required=True, help="how many hosts")
    up.add_argument("--slurm", action="store_true",
                    help="also run a Slurm cluster: slurmctld on NAME-ctl, a slurmd per host "
                    "(Debian's slurm-wlm and munge)")
    up.add_argument("--cpus", type=int, default=None,
                    help="with --slurm: the CPUs each node declares (default: this machine's)")
    up.set_defaults(func=_guarded(cmd_up))
    run = named(sb_sub.add_parser("run", help="run CMD as the controller (on NAME-ctl) with "
                                  "MESHPLAN_HOSTS and mpiexec's launcher set"))
    run.add_argument("--host", default=None, help="run on this host instead of NAME-ctl")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...")
    run.set_defaults(func=_guarded(cmd_run))
    st = named(sb_sub.add_parser("status", help="the sandbox's hosts and whether they are up"))
    st.add_argument("--json", action="store_true", help="print the state as one JSON object")
    st.set_defaults(func=_guarded(cmd_status))
    down = named(sb_sub.add_parser("down", help="stop every process on the sandbox's hosts and "
                                   "remove the hosts"))
    down.set_defaults(func=_guarded(cmd_down))


def cmd_up(args: argparse.Namespace) -> int:
    from .runtime._sandbox import Sandbox

    if args.cpus is not None and not args.slurm:
        raise RuntimeFailure("meshplan sandbox up: --cpus sets the Slurm nodes' CPUs; add "
                             "--slurm")
    box = Sandbox.up(args.hosts, args.name, slurm=args.slurm, cpus=args.cpus)
    _print(box)
    print(f"run a command as the controller: meshplan sandbox run --name {box.name} -- CMD")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .runtime._sandbox import Sandbox

    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise RuntimeFailure("meshplan sandbox run: no command; e.g. meshplan sandbox run -- "
                             "python train.py")
    box = Sandbox.open(args.name)
    return box.run(cmd, host=args.host).returncode


def cmd_status(args: argparse.Namespace) -> int:
    from .runtime._sandbox import Sandbox

    box = Sandbox.open(args.name)
    if args.json:
        print(json.dumps({**box.to_dict(), "up": box.alive()}))
    else:
        _print(box)
    return 0 if box.alive() else 1


def cmd_down(args: argparse.Namespace) -> int:
    from .runtime._sandbox import ROOT, Sandbox, _check_name

    _check_name(args.name)
    if not (ROOT / args.name / "state.json").exists():
        print(f"no sandbox named {args.name} is up; nothing to do")
        return 0
    Sandbox.open(args.name).down()
    print(f"sandbox {args.name} is down")
    return 0


def _print(box: object) -> None:
    state = "up" if box.alive() else "down (its holders ended; `down` clears it)"
    slurm = (f"; Slurm: partition main over every host, SLURM_CONF={box.slurm_dir}/slurm.conf"
             if box.slurm else "")
    print(f"sandbox {box.name}: {state}{slurm}")
    for h in (box.ctl, *box.hosts):
        role = "controller" if h is box.ctl else "host"
        print(f"  {h.name:<20} {h.address:<15} {role}", file=sys.stdout)
