"""A running step's live side, for ``meshplan serve`` and ``meshplan mcp`` on the same host
(issue 25, point 3): what the ranks hold in memory now, asked of their side threads.

A ``distribute``d step that records telemetry starts a ``LiveEndpoint`` with its ranks: an
HTTP server on loopback (a port the system picks) in a thread of the controller, with a
token of its own. It writes where it listens and the token to ``live.json`` in the run's
segment folder (beside the database: ``t.duckdb`` -> ``t.segments/<run_id>/live.json``; mode
0600, written atomically) and
removes it when the ranks stop. Whoever can read that folder can read the run's telemetry
anyway; nobody else gets the token. ``LiveClient`` is the other end (``_serve.Service``).

Requests (every one with ``Authorization: Bearer <token>``):

- ``GET /status``: ``{"run_id", "step", "world", "running"}``.
- ``GET /rows?tables=steps,ops&timeout_s=3``: every rank's recent rows of those tables (the
  last ``live_rows`` of each, flushed to segments or not), put together per table. The body
  is, per table in the order asked, an 8-byte little-endian length and an Arrow IPC stream;
  the ``X-Meshplan-Live`` header (JSON) names the ranks that answered, those that did not
  (stopped, gone, or stuck in C code holding Python's lock) and those whose answer was an
  error. Nothing is unpickled on either side.
- ``GET /stacks?timeout_s=3``: every rank's Python stacks (``Workers.stacks``' form) as JSON.

The ranks answer from their side threads while their main threads compute or wait in a
collective (``runtime/_channel._Side``), and the controller's channel lets this thread ask
them while the step's thread runs steps (``ControllerChannel.ask_sides``). A controller on a
login node is reached from that host only: the server binds loopback.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlsplit

logger = logging.getLogger(__name__)

LIVE_FILE = "live.json"
MAX_ASK_S = 30.0                  # the longest a request may wait for the ranks
DEFAULT_ASK_S = 3.0


class LiveEndpoint:
    """The controller's end (module docstring). ``workers()`` gives the step's running
    ``Workers`` now (None between a failure and its recovery, or after shutdown)."""

    def __init__(self, *, run_id: str, step: str, folder: Path,
                 workers: Callable[[], Any]) -> None:
        self.run_id, self.step, self.workers = run_id, step, workers
        self.token = secrets.token_urlsafe(24)
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:          # noqa: N802 (http.server's names)
                status, headers, body = endpoint.handle(self.path,
                                                        self.headers.get("Authorization"))
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:      # noqa: A002
                logger.debug("live endpoint: " + format, *args)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="meshplan-live")
        self._thread.start()
        self.path = Path(folder) / LIVE_FILE
        try:
            _write_private(self.path, {"run_id": run_id, "step": step, "url": self.url,
                                       "token": self.token, "pid": os.getpid(),
                                       "host": socket.gethostname(),
                                       "started_us": time.time_ns() // 1000})
        except OSError as exc:
            logger.warning("meshplan: meshplan serve will not see run %s's ranks live: cannot "
                           "write %s (%s)", run_id, self.path, exc)
        # also at interpreter exit, when the step was never shut down
        self._remove = weakref.finalize(self, _remove_if_ours, self.path, self.token)

    def handle(self, target: str, auth: str | None) -> tuple[int, dict[str, str], bytes]:
        scheme, _, given = (auth or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self.token.encode()):
            return _error(401, "missing or wrong token")
        url = urlsplit(target)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        try:
            timeout_s = min(MAX_ASK_S, max(0.1, float(query.get("timeout_s", DEFAULT_ASK_S))))
        except ValueError:
            return _error(400, f"timeout_s={query['timeout_s']!r} is not a number")
        workers = self.workers()
        running = workers is not None and not workers.closed
        if url.path == "/status":
            return _ok({"run_id": self.run_id, "step": self.step, "running": running,
                        "world": workers.n if running else None})
        if url.path not in ("/rows", "/stacks"):
            return _error(404, f"no {url.path}")
        if not running:
            return _error(503, f"run {self.run_id} has no running ranks now (it failed and "
                               "is being recovered, or it ended)")
        try:
            if url.path == "/stacks":        # the channel only: launchers are the step's
                from . import _channel as P

                got = workers.channel.ask_sides(range(workers.n), P.STACKS, None, timeout_s)
                return _ok({str(r): {k: v for k, v in m.header.items() if k != "req"}
                            for r, m in sorted(got.items())})
            tables = [t for t in query.get("tables", "").split(",") if t]
            return self._rows(workers, tables, timeout_s)
        except Exception as exc:  # noqa: BLE001 - the ranks stopped meanwhile, most likely
            return _error(503, f"run {self.run_id}: {type(exc).__name__}: {exc}")

    def _rows(self, workers: Any, tables: list[str], timeout_s: float
              ) -> tuple[int, dict[str, str], bytes]:
        import pyarrow as pa

        from ..telemetry._recorder import arrow_ipc, read_ipc
        from ..telemetry._schema import TABLES

        unknown = [t for t in tables if t not in TABLES]
        if not tables or unknown:
            return _error(400, f"tables= names telemetry tables ({', '.join(TABLES)}), "
                               f"not {unknown or 'none'}")
        from . import _channel as P

        got = workers.channel.ask_sides(range(workers.n), P.ROWS, {"tables": tables},
                                        timeout_s)
        errors = {r: str(m.header["error"]) for r, m in got.items() if "error" in m.header}
        parts: dict[str, list[pa.Table]] = {t: [] for t in tables}
        for rank, m in sorted(got.items()):
            if rank in errors:
                continue
            for table, tensor in zip(tables, m.tensors):
                parts[table].append(read_ipc(tensor.numpy()))
        body = bytearray()
        for table in tables:
            arrow = (pa.concat_tables(parts[table], promote_options="permissive")
                     if parts[table] else TABLES[table].empty_table())
            data = arrow_ipc(arrow)
            body += struct.pack("<Q", len(data)) + data
        meta = {"run_id": self.run_id, "answered": sorted(r for r in got if r not in errors),
                "missing": [r for r in range(workers.n) if r not in got],
                "errors": {str(r): e for r, e in errors.items()}}
        return 200, {"Content-Type": "application/octet-stream",
                     "X-Meshplan-Live": json.dumps(meta)}, bytes(body)

    def close(self) -> None:
        """Stop answering and remove ``live.json`` (if it is still this endpoint's)."""
        self._remove()
        # its loop notices within its poll interval (0.5 s): not waited for here
        server = self._server
        threading.Thread(target=lambda: (server.shutdown(), server.server_close()),
                         daemon=True, name="meshplan-live-stop").start()


def _remove_if_ours(path: Path, token: str) -> None:
    try:
        if json.loads(path.read_text()).get("token") == token:
            path.unlink()
    except (OSError, ValueError):
        pass


def _ok(body: Any) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(body).encode()


def _error(status: int, message: str) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json"}, json.dumps(
        {"error": message}).encode()


def _write_private(path: Path, doc: dict[str, Any]) -> None:
    """``doc`` as JSON at ``path``, readable by this user only, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


# ---- the other end ---------------------------------------------------------------------------

class LiveError(Exception):
    """A live run could not answer: ``status`` (0: not reached) and why."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class LiveClient:
    """One running step's endpoint, as its ``live.json`` says."""

    run_id: str
    step: str
    url: str
    token: str
    path: Path

    @classmethod
    def find(cls, segments: Path) -> list[LiveClient]:
        """The endpoints whose ``live.json`` lies in ``segments``' run folders (runs whose
        controller is gone may leave one: ``status`` then fails to connect)."""
        found = []
        for path in sorted(Path(segments).glob(f"*/{LIVE_FILE}")):
            try:
                doc = json.loads(path.read_text())
                found.append(cls(str(doc["run_id"]), str(doc.get("step", "")),
                                 str(doc["url"]), str(doc["token"]), path))
            except (OSError, ValueError, KeyError, TypeError):
                continue               # being written, or not ours: skipped
        return found

    def _get(self, target: str, timeout_s: float) -> tuple[bytes, Any]:
        if not self.url.startswith("http://127.0.0.1:"):
            raise LiveError(0, f"{self.path} names {self.url!r}, not a loopback address")
        request = urllib.request.Request(self.url + target,
                                         headers={"Authorization": f"Bearer {self.token}"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                return answer.read(), answer.headers
        except urllib.error.HTTPError as e:
            try:
                why = json.loads(e.read()).get("error", e.reason)
            except ValueError:
                why = e.reason
            raise LiveError(e.code, str(why)) from None
        except (OSError, urllib.error.URLError) as e:
            raise LiveError(0, f"run {self.run_id}'s controller does not answer at {self.url} "
                               f"({getattr(e, 'reason', e)}): it ended") from None

    def status(self, timeout_s: float = 1.0) -> dict[str, Any]:
        return json.loads(self._get("/status", timeout_s)[0])

    def stacks(self, timeout_s: float = DEFAULT_ASK_S) -> dict[str, Any]:
        return json.loads(self._get(f"/stacks?timeout_s={timeout_s:g}", timeout_s + 5)[0])

    def rows(self, tables: list[str], timeout_s: float = DEFAULT_ASK_S
             ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``({table: pyarrow.Table}, {"answered", "missing", "errors"})``."""
        from ..telemetry._recorder import read_ipc

        body, headers = self._get(f"/rows?tables={','.join(tables)}&timeout_s={timeout_s:g}",
                                  timeout_s + 5)
        out, at = {}, 0
        for table in tables:
            (size,) = struct.unpack_from("<Q", body, at)
            out[table] = read_ipc(body[at + 8:at + 8 + size])
            at += 8 + size
        return out, json.loads(headers.get("X-Meshplan-Live") or "{}")


__all__ = ["LIVE_FILE", "LiveClient", "LiveEndpoint", "LiveError"]
