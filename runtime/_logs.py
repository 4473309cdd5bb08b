"""Every rank's output on the controller, rank-prefixed and collapsed; every rank's Python
stacks on request (README, "Live debugging").

The worker side (``LogCapture``): the rank's file descriptors 1 and 2 become pipes, two
threads read them line by line into a queue, and the rank's side thread (``_channel._Side``)
sends the queued lines to the controller in batches, as they come, also while the rank's main
thread computes or waits in a collective. ``faulthandler`` writes a fatal error's traceback to
the original stderr, not through the pipe that dies with the process.
``$MESHPLAN_WORKER_LOGS``: ``stream`` (the default: to the controller only), ``tee`` (also
to the original stdout/stderr: a k8s pod's log keeps them), ``off`` (the rank writes to what
it inherited, as before; a launcher's ``log_dir`` sets it: the files keep every line).

The controller side (``LogLines``): lines that several ranks of a mesh write alike arrive
within a short window of each other; the same line from ranks 0-3 is printed once, as
``[train r0-3] <line>``, as soon as every rank of the mesh sent it or ``window_s`` after the
first did (a line only some ranks write names those: ``[train r1,3]``). Lines arrive while the
controller waits for the ranks (during steps and other calls): between calls they wait in the
channel's queue.

``python_stacks`` is what a rank answers to ``STACKS``: every thread's Python stack (the main
thread first), its innermost frame, and what the rank was serving.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

ENV_LOGS = "MESHPLAN_WORKER_LOGS"
LOG_MODES = ("stream", "tee", "off")
MAX_LINE = 4096                 # characters of one line that travel; the rest is cut
MAX_QUEUED = 20_000             # lines a rank keeps while the controller does not read them
WINDOW_S = 0.5                  # how long the controller waits for other ranks' same line


def ranks_text(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``r0-3,6``."""
    rs = sorted(set(ranks))
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return "r" + ",".join(parts)


class LogCapture:
    """A worker's fds 1 and 2 as pipes read into ``lines`` (``[stream, text]``); see the
    module docstring. ``close()`` restores them and waits for the readers to finish."""

    def __init__(self, *, tee: bool = False) -> None:
        self.lines: collections.deque = collections.deque(maxlen=MAX_QUEUED)
        self.tee = tee
        self.wake: Callable[[], None] | None = None   # the side thread's: lines are queued
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._saved = {fd: os.dup(fd) for fd in (1, 2)}
        # a fatal signal's traceback: to the original stderr (the pipe's reader dies too)
        self._fault_file = os.fdopen(os.dup(self._saved[2]), "w")
        faulthandler.enable(file=self._fault_file, all_threads=True)
        self._threads = []
        for fd, name in ((1, "out"), (2, "err")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            t = threading.Thread(target=self._read, args=(r, name, self._saved[fd]),
                                 name=f"meshplan-std{name}", daemon=True)
            t.start()
            self._threads.append(t)
        try:       # a pipe is block-buffered: print() must reach it line by line
            sys.stdout.reconfigure(line_buffering=True)
        except (AttributeError, ValueError):
            pass

    def _read(self, fd: int, stream: str, original: int) -> None:
        rest = b""
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            if self.tee:
                try:
                    os.write(original, chunk)
                except OSError:
                    pass
            *whole, rest = (rest + chunk).split(b"\n")
            for raw in whole:
                self._push(stream, raw)
            if whole and self.wake is not None:
                self.wake()
        if rest:
            self._push(stream, rest)
        if self.wake is not None:
            self.wake()
        os.close(fd)

    def _push(self, stream: str, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        if len(text) > MAX_LINE:
            text = text[:MAX_LINE] + f" ... ({len(text) - MAX_LINE} more characters)"
        self.lines.append([stream, text])

    def close(self, timeout_s: float = 2.0) -> None:
        """Put the original fds back; the readers see the pipes' ends and push what was
        left."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)
        for t in self._threads:
            t.join(timeout_s)


def python_stacks(doing: Callable[[], str] | None = None) -> dict[str, Any]:
    """Every thread's Python stack but the caller's (the side thread), the main thread
    first: ``{"text", "frame" (the main thread's innermost frame, ``file:line in name``),
    "doing" (what the rank serves), "threads"}``."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    me = threading.get_ident()
    parts, frame_text, main_text = [], "", ""
    for ident, frame in sorted(frames.items(), key=lambda kv: kv[0] != main):
        if ident == me:
            continue
        summary = traceback.extract_stack(frame)
        title = f"Thread {names.get(ident, ident)}" + (" (main)" if ident == main else "")
        parts.append(title + ", most recent call last:\n" + "".join(summary.format()))
        if ident == main:
            main_text = "".join(summary.format())
            if summary:
                last = summary[-1]
                frame_text = f"{last.filename}:{last.lineno} in {last.name}"
    return {"text": "\n".join(parts), "main": main_text, "frame": frame_text,
            "doing": doing() if doing is not None else "", "threads": len(parts)}


def stacks_text(stacks: dict[int, dict[str, Any]], n: int, label: str = "") -> str:
    """Every rank's stacks as one text (a dump's printout): ranks whose main thread is in
    the same place share one entry."""
    name = f"{label}: " if label else ""
    if not stacks:
        return f"meshplan: {name}no rank answered with its stacks"
    same: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(stacks):
        got = stacks[rank]
        same.setdefault((got.get("main", ""), got.get("doing", "")), []).append(rank)
    lines = [f"meshplan: {name}the main thread's Python stack of {len(stacks)} of {n} ranks "
             "(every thread's: str of one rank's entry, or the telemetry's stacks table)"]
    for (text, doing), ranks in same.items():
        first = stacks[ranks[0]]
        lines.append(f"--- {ranks_text(ranks)}: {doing}, in {first.get('frame') or '?'}")
        lines.append(text.rstrip())
    missing = [r for r in range(n) if r not in stacks]
    if missing:
        lines.append(f"--- {ranks_text(missing)}: no answer (stopped, gone, or in C code that "
                     "holds Python's lock)")
    return "\n".join(lines)


class Stacks(dict):
    """``{rank: {"text", "frame", "doing"}}`` whose ``str()`` is ``stacks_text``."""

    def __init__(self, stacks: dict[int, dict[str, Any]], *, n: int, label: str = "") -> None:
        super().__init__(stacks)
        self.n, self.label = n, label

    def __str__(self) -> str:
        return stacks_text(dict(self), self.n, self.label)


_LAUNCHING: list[str] = []          # the name of the step whose mesh is being launched


@contextlib.contextmanager
def launching(label: str) -> Iterator[None]:
    """Workers made inside are labelled ``label`` from their first line on."""
    _LAUNCHING.append(label)
    try:
        yield
    finally:
        _LAUNCHING.pop()


class LogLines:
    """The controller's printer of one mesh's lines (module docstring). ``add`` is called
    from the thread that reads the channel; a timer thread prints what waited ``window_s``."""

    def __init__(self, n: int, label: str | None = None, *, window_s: float = WINDOW_S,
                 out: TextIO | None = None, err: TextIO | None = None) -> None:
        if label is None:
            label = _LAUNCHING[-1] if _LAUNCHING else ""
        self.n, self.label, self.window_s = n, label, window_s
        self._out, self._err = out, err
        # (stream, text) -> its open groups, oldest first: [time of the first, ranks, key];
        # a rank's k-th copy of a line joins the k-th group that lacks it. ``_order``: every
        # open group in the order they began
        self._pending: dict[tuple[str, str], list[list[Any]]] = {}
        self._order: collections.deque[list[Any]] = collections.deque()
        # per (rank, stream): its groups in the order its lines came
        self._queues: dict[tuple[int, str], collections.deque[list[Any]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        self.printed = 0

    def add(self, rank: int, lines: list[Any]) -> None:
        now = time.monotonic()
        with self._lock:
            for item in lines:
                if not isinstance(item, (list, tuple)) or len(item) != 2:
                    continue
                key = (str(item[0]), str(item[1]))
                groups = self._pending.setdefault(key, [])
                group = next((g for g in groups if rank not in g[1]), None)
                if group is None:
                    group = [now, set(), key, False]      # the last: printed
                    groups.append(group)
                    self._order.append(group)
                group[1].add(rank)
                # a rank's lines keep their order within each stream (stdout and stderr
                # are read apart: no order between them)
                self._queues.setdefault((rank, key[0]), collections.deque()).append(group)
            self._print_due(now, self.window_s)
            waiting = bool(self._pending)
        if waiting and self._timer is None:
            self._timer = threading.Thread(target=self._tick, name="meshplan-logs",
                                           daemon=True)
            self._timer.start()

    def _tick(self) -> None:
        while not self._stop.wait(self.window_s / 3):
            self.flush(older_than_s=self.window_s)

    def flush(self, older_than_s: float = 0.0) -> None:
        """Print the lines that waited at least ``older_than_s`` (all of them: 0)."""
        with self._lock:
            self._print_due(time.monotonic(), older_than_s)

    def _print_due(self, now: float, older_than_s: float) -> None:
        """Print every group that is complete (every rank sent its line) or waited
        ``older_than_s``, oldest first, each after the earlier lines of its ranks in its
        stream (which then go out as they are): every rank's lines keep their order."""
        done: list[tuple[tuple[str, str], set[int]]] = []
        for group in list(self._order):
            if not group[3] and (len(group[1]) >= self.n or now - group[0] >= older_than_s):
                self._emit(group, done)
        while self._order and self._order[0][3]:
            self._order.popleft()
        self._print(done)

    def _emit(self, target: list[Any], done: list[tuple[tuple[str, str], set[int]]]) -> None:
        """Print ``target`` after the earlier lines of each of its ranks (iteratively: a rank
        may have many). Ranks that wrote the same lines in different orders make a cycle;
        there the line waited for goes first, and only those ranks' order gives."""
        stack, visiting = [target], {id(target)}
        while stack:
            group = stack[-1]
            blocker = None
            stream = group[2][0]
            for rank in sorted(group[1]):
                head = self._queues[(rank, stream)][0]
                if head is not group and id(head) not in visiting:
                    blocker = head
                    break
            if blocker is not None:
                stack.append(blocker)
                visiting.add(id(blocker))
                continue
            stack.pop()
            visiting.discard(id(group))
            for rank in group[1]:
                queue = self._queues[(rank, group[2][0])]
                if queue[0] is group:
                    queue.popleft()
                else:                                  # a cycle: out of its place
                    queue.remove(group)
            group[3] = True
            groups = self._pending[group[2]]
            groups.remove(group)
            if not groups:
                del self._pending[group[2]]
            done.append((group[2], group[1]))

    def _print(self, groups: list[tuple[tuple[str, str], set[int]]]) -> None:
        name = f"{self.label} " if self.label else ""
        for (stream, text), ranks in groups:
            target = (self._err or sys.stderr) if stream == "err" else (self._out or sys.stdout)
            try:
                print(f"[{name}{ranks_text(ranks)}] {text}", file=target, flush=True)
            except (OSError, ValueError):
                pass
            self.printed += 1

    def close(self) -> None:
        self._stop.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(1.0)
        self.flush()
