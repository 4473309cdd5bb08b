"""The process that holds one sandbox "host" (or the sandbox's switch) alive: ``runtime/_sandbox.py``.

Run as a plain script (``python -I _sandbox_holder.py ...``: no meshplan, no torch import),
already inside the namespaces ``unshare`` made for it. As a host it names itself (UTS), mounts a
fresh ``/dev/shm`` and ``/tmp`` (keeping the folders it is told to keep, such as a project
cloned under /tmp) and binds the sandbox's ``hosts`` file over ``/etc/hosts`` (its
mount namespace is private: nothing it mounts is seen outside). Then it prints ``ready`` and
waits until it is told to stop (SIGTERM, SIGINT) or its owner process ends, and on the way out
kills every process left in its network namespace, so that the namespace, its veth and the
addresses on it go away with it. Namespaces are held by processes only (no ``ip netns`` names,
no bind-mounted namespace files), so a crash of everything leaves nothing behind either: the
holders notice their owner is gone and end.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import time


def _same_netns(pid: int, mine: tuple[int, int]) -> bool:
    try:
        st = os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == mine


def kill_namespace_peers() -> None:
    """SIGKILL every other process in this process's network namespace, until none is left
    (a process may fork while we look)."""
    st = os.stat("/proc/self/ns/net")
    mine, me = (st.st_dev, st.st_ino), os.getpid()
    for _ in range(50):
        found = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me
                 and _same_netns(int(p), mine)]
        if not found:
            return
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def _setup_host(hostname: str, hosts_file: str, keep: list[str], stash: str) -> None:
    """Name the host; a fresh /dev/shm and /tmp, except the folders of ``keep`` (under /tmp:
    the project, its virtual environment), which are bound back at their paths through
    ``stash``; the sandbox's hosts file as /etc/hosts."""
    socket.sethostname(hostname)
    held = []
    for i, path in enumerate(keep):
        spot = os.path.join(stash, f"keep{i}")
        os.makedirs(spot, exist_ok=True)
        subprocess.run(["mount", "--bind", path, spot], check=True)
        held.append((path, spot))
    for where in ("/dev/shm", "/tmp"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", where], check=True)
    for path, spot in held:
        os.makedirs(path, exist_ok=True)
        subprocess.run(["mount", "--bind", spot, path], check=True)
        subprocess.run(["umount", spot], check=True)
    subprocess.run(["mount", "--bind", hosts_file, "/etc/hosts"], check=True)
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--hostname")
    p.add_argument("--hosts-file")
    p.add_argument("--owner", type=int, default=0)
    p.add_argument("--keep", action="append", default=[])
    p.add_argument("--stash")
    args = p.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    signal.signal(signal.SIGHUP, signal.SIG_IGN)      # the terminal that ran `up` may close
    if args.hostname:
        _setup_host(args.hostname, args.hosts_file, args.keep, args.stash)
    owner = None
    if args.owner:
        try:
            owner = os.pidfd_open(args.owner)
        except OSError:                   # already gone: nothing to hold the sandbox for
            return 0
    print("ready", flush=True)
    try:
        while not stop:
            if owner is not None and select.select([owner], [], [], 0.5)[0]:
                break                     # the owner ended
            if owner is None:
                time.sleep(0.5)
    finally:
        kill_namespace_peers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
