"""Checkpoints: a step's whole state in one safetensors file, read back piece by piece.

Format: one ``.safetensors`` file. Its tensors are the step's state (parameters, buffers,
gradients, optimizer state), whole, named as the plan's graph inputs (``model.fc1.weight``,
``opt.state.model.fc1.weight.exp_avg``, ...). The header's metadata holds one key, ``meshplan``,
a JSON object: ``format`` (``"meshplan-checkpoint"``), ``version`` (2), ``roles`` (name ->
``param``/``buffer``/``grad``/``opt_state``), ``saved_from`` (the saving plan's mesh and
strategy: provenance only), ``torch``, ``created`` (UTC, ISO 8601) and ``digests``:

- ``algorithm`` (``"sha256"``) and ``chunk_bytes`` (4 MiB);
- ``tensors``: name -> the hex sha256 of each ``chunk_bytes`` block of the tensor's bytes as
  stored (the last block shorter; none for an empty tensor). A tensor's own digest is the sha256
  of its concatenated chunk digests (a hash list, as ``runtime/_files.py`` hashes files);
- ``header``: the hex sha256 of the canonical JSON (sorted keys, no spaces) of
  ``{"meshplan": this object without digests.header, "metadata": the header's other metadata
  keys, "tensors": the safetensors tensor table (name -> dtype, shape, data_offsets)}``. It is
  written last, into a placeholder of the same length, once safetensors has placed the tensors.

Loading verifies before anything is used: the header digest wherever the file is opened (a
changed name, dtype, shape, offset or metadata field is refused), and every chunk that a read
touches, hashed from the bytes the read returns (a whole tensor: its own memory, read chunk by
chunk; a slice: the mapped pages it is copied from, just before the copy). A whole tensor (``read_whole``, the
controller's own copy) checks all its chunks; a rank's slice (``read_pieces``) checks the chunks
its slice's byte span covers (a split of dim 0 costs its own bytes, a split of a later dim the
whole tensor's). So each byte a process reads is hashed once, by threads beside the reads, and
a damaged file is a RuntimeFailure naming the file and the tensor, never a silent load (the
controller checks the header in ``read_info`` before any rank reads; a rank that finds damaged
data fails its load, and the mesh stops with a WorkerFailure carrying that message). Version 1
files (no digests) still load, unverified, with one warning naming the file (``read_info``,
once per file and process).

Whole tensors make a checkpoint independent of the mesh: one saved on ``dp=2`` loads on
``tp=2``. Loading does not need the whole file in one process: a rank reads only its own pieces
(``read_pieces`` maps the file, so a shard costs its own bytes). Writing is atomic: a temporary
file beside the target, fsynced, then ``os.replace`` and an fsync of the folder; a failed save
leaves the former file as it was and no temporary behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import secrets
import struct
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, BinaryIO

import torch

from .._errors import RuntimeFailure

__all__ = ["CheckpointInfo", "read_info", "read_pieces", "read_whole", "save_checkpoint"]

logger = logging.getLogger(__name__)

FORMAT = "meshplan-checkpoint"
VERSION = 2
READS = (1, 2)                   # versions this meshplan loads (1: no digests, unverified)
CHUNK_BYTES = 4 << 20
_ALGORITHM = "sha256"
_META_KEY = "meshplan"
_MAX_HEADER = 100_000_000        # safetensors' own limit
# safetensors' dtype names -> torch's
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_REDO = "restore it from a good copy, or save the checkpoint again"
_warned: set[tuple[str, int, int]] = set()      # version-1 files warned about (path, size, mtime)


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint file holds, read from its header alone (its digest checked)."""

    path: str
    specs: dict[str, tuple[tuple[int, ...], str]]     # name -> (shape, torch dtype name)
    roles: dict[str, str]
    meta: dict[str, Any]


def save_checkpoint(path: str | os.PathLike, values: Mapping[str, torch.Tensor],
                    roles: Mapping[str, str], saved_from: Mapping[str, Any]) -> str:
    """Write ``values`` (whole tensors by input name) to ``path`` atomically, with a digest of
    every 4 MiB of each tensor and of the header; returns the absolute path."""
    from safetensors.torch import save_file

    target = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise RuntimeFailure(f"save_checkpoint: folder {folder} does not exist; create it first")
    if os.path.isdir(target):
        raise RuntimeFailure(f"save_checkpoint: {target} is a folder; pass a file path such as "
                             f"{os.path.join(target, 'step.safetensors')}")
    # safetensors refuses views of one storage and non-contiguous tensors: own copies
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in values.items()}
    placeholder = secrets.token_hex(32)            # as long as a sha256 hex digest
    meta = {"format": FORMAT, "version": VERSION, "roles": {k: roles[k] for k in values},
            "saved_from": dict(saved_from), "torch": torch.__version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "digests": {"algorithm": _ALGORITHM, "chunk_bytes": CHUNK_BYTES,
                        "tensors": _tensor_digests(tensors), "header": placeholder}}
    tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{secrets.token_hex(4)}")
    try:
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
        del tensors
        _seal_header(tmp, placeholder)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, Exception):
            raise RuntimeFailure(f"save_checkpoint: writing {target} failed "
                                 f"({type(exc).__name__}: {exc}); the former file, if any, "
                                 "is unchanged") from exc
        raise
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return target


def read_info(path: str | os.PathLike) -> CheckpointInfo:
    """The header of the checkpoint at ``path``, its digest checked; one clear RuntimeFailure
    if it is none or its header is damaged. A version-1 file (no digests) logs one warning."""
    where = os.path.abspath(os.fspath(path))
    if not os.path.isfile(where):
        raise RuntimeFailure(f"load_checkpoint: {where} does not exist (or is not a file); pass "
                             "a file written by save_checkpoint")
    with open(where, "rb") as f:
        head = _Header.read(where, f)
    specs = {name: (e.shape, _DTYPES.get(e.dtype, e.dtype)) for name, e in head.table.items()}
    if head.meta.get("version") == 1:
        st = os.stat(where)
        key = (where, st.st_size, st.st_mtime_ns)
        if key not in _warned:
            _warned.add(key)
            logger.warning("meshplan: %s is a version-1 checkpoint: it has no digests, so its "
                           "data is loaded unverified; save it again to add them", where)
    return CheckpointInfo(where, specs, dict(head.meta.get("roles", {})), head.meta)


def check_matches(info: CheckpointInfo, expected: Mapping[str, tuple[Sequence[int], str]],
                  step_name: str) -> list[str]:
    """The state names the checkpoint provides, after checking them against ``expected``
    (name -> (shape, dtype) of the step's state inputs); names the step lacks are an error."""
    unknown = sorted(set(info.specs) - set(expected))
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise RuntimeFailure(
            f"load_checkpoint: {info.path} holds {', '.join(unknown[:3])}{more}, which "
            f"{step_name} does not have; it was saved from another model or optimizer")
    for name, (shape, dtype) in info.specs.items():
        want_shape, want_dtype = tuple(expected[name][0]), expected[name][1]
        if (shape, dtype) != (want_shape, want_dtype):
            raise RuntimeFailure(
                f"load_checkpoint: {name} in {info.path} is {list(shape)} {dtype}; {step_name} "
                f"has it as {list(want_shape)} {want_dtype}; the checkpoint is from another "
                "configuration of the model")
    return sorted(info.specs)


def read_whole(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, whole, each chunk checked against its
    digest (version 2) before anything is returned."""
    return _read(path, None, {})


def read_pieces(path: str, names: Sequence[str], slices: Mapping[str, tuple[slice, ...]]
                ) -> dict[str, torch.Tensor]:
    """``names`` read from ``path``, each only its ``slices`` (a rank's piece; an empty tuple:
    the whole tensor). The header digest and every chunk the pieces touch are checked
    (version 2) before anything is returned."""
    return _read(path, names, slices)


def _read(path: str, names: Sequence[str] | None, slices: Mapping[str, tuple[slice, ...]]
          ) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with open(path, "rb") as f, _hasher() as hasher:       # one open: header and data agree
        head = _Header.read(path, f)
        if names is None:
            names = sorted(head.table, key=lambda n: head.table[n].begin)     # in file order
        mm = None
        try:
            for name in names:
                entry = head.table.get(name)
                if entry is None:
                    raise RuntimeFailure(f"load_checkpoint: {path} has no tensor {name}; "
                                         "pass a file written by save_checkpoint")
                index = slices.get(name) or ()
                if not index:
                    out[name] = _read_tensor(f, head, name, hasher)
                    continue
                span = _span(entry, index)
                if mm is None and span is not None:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                out[name] = _read_slice(mm, head, name, index, span, hasher)
            hasher.check()
        finally:
            if mm is not None:
                try:
                    mm.close()
                except BufferError:           # a view still exported: the collector closes it
                    pass
    return out


# --- the header ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    dtype: str                      # safetensors' name
    shape: tuple[int, ...]
    begin: int                      # offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def torch_dtype(self, path: str, name: str) -> torch.dtype:
        dt = getattr(torch, _DTYPES.get(self.dtype, ""), None)
        if not isinstance(dt, torch.dtype):
            raise RuntimeFailure(f"load_checkpoint: {name} in {path} has dtype {self.dtype}, "
                                 "which this meshplan does not read")
        return dt


@dataclass(frozen=True)
class _Header:
    path: str
    data_start: int
    table: dict[str, _Entry]
    meta: dict[str, Any]
    chunk_bytes: int
    digests: dict[str, list[str]] | None      # None: version 1, nothing to verify

    @staticmethod
    def read(path: str, f: BinaryIO) -> _Header:
        """Parse and check the header of the checkpoint ``f`` at ``path`` (its digest, if
        version 2)."""
        obj, data_start, size = _raw_header(path, f)
        raw_meta = (obj.get("__metadata__") or {}).get(_META_KEY)
        try:
            meta = json.loads(raw_meta) if isinstance(raw_meta, str) else None
        except json.JSONDecodeError:
            raise _damaged_header(path, "its meshplan metadata is not JSON") from None
        digests = meta.get("digests") if isinstance(meta, dict) else None
        if isinstance(digests, dict) and "header" in digests:      # check before trusting it
            if _header_digest(obj) != digests["header"]:
                raise _damaged_header(path, _header_diff(obj, digests))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise RuntimeFailure(f"load_checkpoint: {path} is a safetensors file but not a "
                                 "meshplan checkpoint (no 'meshplan' metadata); pass a file "
                                 "written by save_checkpoint, or load plain weights with "
                                 "load_state_dict")
        version = meta.get("version")
        if version not in READS:
            raise RuntimeFailure(f"load_checkpoint: {path} is checkpoint version {version!r}; "
                                 f"this meshplan reads versions {', '.join(map(str, READS))}")
        table = _table(path, obj, size - data_start)
        if version == 1:
            return _Header(path, data_start, table, meta, CHUNK_BYTES, None)
        if not isinstance(digests, dict) or "header" not in digests:
            raise _damaged_header(path, "it is version 2 but has no digests")
        chunk, per = digests.get("chunk_bytes"), digests.get("tensors")
        if digests.get("algorithm") != _ALGORITHM or not isinstance(chunk, int) or chunk <= 0 \
                or not isinstance(per, dict):
            raise _damaged_header(path, f"its digests are not {_ALGORITHM} over chunks")
        for name, entry in table.items():
            if len(per.get(name, ())) != math.ceil(entry.nbytes / chunk):
                raise _damaged_header(path, f"tensor {name} has no digest for each chunk")
        return _Header(path, data_start, table, meta, chunk, per)


def _raw_header(path: str, f: BinaryIO) -> tuple[dict[str, Any], int, int]:
    """The safetensors header of ``f`` (at ``path``) as JSON, where its data starts, and the
    file size."""
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        first = f.read(8)
        if len(first) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", first)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
        obj = json.loads(f.read(n))
        if not isinstance(obj, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as exc:      # JSONDecodeError and UnicodeDecodeError included
        raise RuntimeFailure(f"load_checkpoint: {path} is not a safetensors file ({exc}); pass "
                             "a file written by save_checkpoint (if it was one, its header is "
                             f"damaged: {_REDO})") from None
    return obj, 8 + n, size


def _table(path: str, obj: dict[str, Any], data_bytes: int) -> dict[str, _Entry]:
    table = {}
    for name, e in obj.items():
        if name == "__metadata__":
            continue
        try:
            b, end = e["data_offsets"]
            entry = _Entry(str(e["dtype"]), tuple(int(d) for d in e["shape"]), int(b), int(end))
        except (KeyError, TypeError, ValueError):
            raise _damaged_header(path, f"the entry of tensor {name} is malformed") from None
        dt = getattr(torch, _DTYPES.get(entry.dtype, ""), None)
        want = math.prod(entry.shape) * dt.itemsize if isinstance(dt, torch.dtype) else None
        if entry.begin < 0 or min(entry.shape, default=0) < 0 \
                or (want is not None and entry.nbytes != want):
            raise _damaged_header(path, f"the entry of tensor {name} is inconsistent")
        if entry.end > data_bytes:
            raise RuntimeFailure(f"load_checkpoint: {path} is damaged: tensor {name} ends past "
                                 f"the end of the file (truncated?); {_REDO}")
        table[name] = entry
    return table


def _header_digest(obj: Mapping[str, Any]) -> str:
    md = dict(obj.get("__metadata__") or {})
    meta = json.loads(md.pop(_META_KEY))
    meta["digests"] = {k: v for k, v in meta["digests"].items() if k != "header"}
    canon = {"meshplan": meta, "metadata": md,
             "tensors": {k: v for k, v in obj.items() if k != "__metadata__"}}
    return hashlib.sha256(json.dumps(canon, sort_keys=True, separators=(",", ":"))
                          .encode()).hexdigest()


def _header_diff(obj: Mapping[str, Any], digests: Mapping[str, Any]) -> str:
    """What a damaged header changed, as far as the digests tell (names of tensors)."""
    table = {k for k in obj if k != "__metadata__"}
    per = digests.get("tensors")
    known = set(per) if isinstance(per, dict) else set()
    if table != known:
        odd = sorted(table ^ known)[:3]
        return f"its tensor table and its digests disagree on {', '.join(odd)}"
    return ("a tensor's name, dtype, shape or offsets, or a metadata field, changed after it "
            "was saved")


def _damaged_header(path: str, what: str) -> RuntimeFailure:
    return RuntimeFailure(f"load_checkpoint: the header of {path} is damaged ({what}): its "
                          f"digest does not match; {_REDO}")


def _seal_header(path: str, placeholder: str) -> None:
    """Write the header digest over ``placeholder`` (same length) in the file at ``path``, now
    that safetensors has placed the tensors (offsets)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        raw = f.read(n)
        at = raw.find(placeholder.encode())
        if at < 0 or raw.find(placeholder.encode(), at + 1) >= 0:
            raise RuntimeError("the header digest's placeholder is not found once in the header")
        f.seek(8 + at)
        f.write(_header_digest(json.loads(raw)).encode())


# --- the data -----------------------------------------------------------------------------


def _tensor_digests(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[str]]:
    """Name -> the sha256 of each ``CHUNK_BYTES`` block of the tensor's bytes (contiguous CPU
    tensors: their bytes are what safetensors writes, on a little-endian machine)."""
    views = {k: memoryview(t.reshape(-1).view(torch.uint8).numpy()) for k, t in tensors.items()}
    jobs = [(k, mv[i:i + CHUNK_BYTES]) for k, mv in views.items()
            for i in range(0, len(mv), CHUNK_BYTES)]
    out: dict[str, list[str]] = {k: [] for k in tensors}
    with ThreadPoolExecutor(_threads()) as pool:
        for (k, _), digest in zip(jobs, pool.map(_sha256, [mv for _, mv in jobs])):
            out[k].append(digest)
    return out


def _sha256(data: memoryview) -> str:
    return hashlib.sha256(data).hexdigest()      # releases the GIL: threads hash in parallel


def _threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:                       # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class _Hasher:
    """Chunks hashed by threads while the reads go on; ``check`` raises for the first chunk
    whose digest does not match."""

    def __init__(self, pool: ThreadPoolExecutor, threads: int) -> None:
        self.pool, self.keep = pool, 2 * threads
        self.pending: list[tuple[Future[str], str, str, str, int, int]] = []

    def add(self, data: memoryview, want: str, path: str, name: str, k: int, of: int) -> None:
        self.pending.append((self.pool.submit(_sha256, data), want, path, name, k, of))
        if len(self.pending) > 2 * self.keep:       # a bounded queue: check the older ones
            self._check(self.pending[:-self.keep])
            del self.pending[:-self.keep]

    def check(self) -> None:
        self._check(self.pending)
        self.pending.clear()

    @staticmethod
    def _check(pending) -> None:
        for fut, want, path, name, k, of in pending:
            if fut.result() != want:
                raise RuntimeFailure(
                    f"load_checkpoint: {path} is damaged: tensor {name} does not match its "
                    f"digest (chunk {k + 1} of {of}); its data changed after it was saved; "
                    f"{_REDO}")


@contextmanager
def _hasher() -> Iterator[_Hasher]:
    threads = _threads()
    pool = ThreadPoolExecutor(threads)
    try:
        yield _Hasher(pool, threads)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_tensor(f: BinaryIO, head: _Header, name: str, hasher: _Hasher) -> torch.Tensor:
    """Tensor ``name`` whole: its bytes read chunk by chunk into the returned tensor's
    memory, each chunk handed to the hasher as soon as it is read."""
    entry = head.table[name]
    dtype = entry.torch_dtype(head.path, name)
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=dtype)
    data = torch.empty(entry.nbytes, dtype=torch.uint8)       # torch's own storage
    mv = memoryview(data.numpy())
    f.seek(head.data_start + entry.begin)
    chunk = head.chunk_bytes
    of = math.ceil(entry.nbytes / chunk)
    for k in range(of):
        part = mv[k * chunk:(k + 1) * chunk]
        if f.readinto(part) != len(part):
            raise RuntimeFailure(f"load_checkpoint: {head.path} is damaged: tensor {name} ends "
                                 f"past the end of the file (truncated?); {_REDO}")
        if head.digests is not None:
            hasher.add(part, head.digests[name][k], head.path, name, k, of)
    return data.view(dtype).reshape(entry.shape)


def _read_slice(mm: mmap.mmap | None, head: _Header, name: str, index: tuple[slice, ...],
                span: tuple[int, int] | None, hasher: _Hasher) -> torch.Tensor:
    """Tensor ``name``'s piece ``index``, copied out of the mapped file once the chunks that
    hold its byte ``span`` are checked."""
    entry = head.table[name]
    dtype = entry.torch_dtype(head.path, name)
    if span is None:                                          # an empty piece: nothing to read
        return torch.empty(entry.shape, dtype=dtype)[index].contiguous()
    assert mm is not None
    start = head.data_start + entry.begin
    if head.digests is not None:
        chunk = head.chunk_bytes
        of = math.ceil(entry.nbytes / chunk)
        view = memoryview(mm)
        try:
            for k in range(span[0] // chunk, (span[1] - 1) // chunk + 1):
                lo, hi = start + k * chunk, start + min((k + 1) * chunk, entry.nbytes)
                hasher.add(view[lo:hi], head.digests[name][k], head.path, name, k, of)
            hasher.check()                    # before the bytes leave the map
        finally:
            view.release()
    whole = torch.frombuffer(mm, dtype=dtype, count=math.prod(entry.shape),
                             offset=start).reshape(entry.shape)
    piece = whole[index].clone(memory_format=torch.contiguous_format)
    del whole
    return piece


def _span(entry: _Entry, index: tuple[Any, ...]) -> tuple[int, int] | None:
    """The bytes of ``entry``'s data that the piece ``index`` (slices, first dims) lies in:
    from its first element to its last, row-major; None if the piece is empty."""
    shape = entry.shape
    if not all(isinstance(s, slice) for s in index) or len(index) > len(shape):
        return (0, entry.nbytes)                                  # anything else: all of it
    first = last = 0
    stride = 1
    for dim in reversed(range(len(shape))):
        if dim < len(index):
            r = range(*index[dim].indices(shape[dim]))
        else:
            r = range(shape[dim])
        if not r:
            return None
        first += min(r[0], r[-1]) * stride
        last += max(r[0], r[-1]) * stride
        stride *= shape[dim]
    itemsize = entry.nbytes // max(1, math.prod(shape))
    return first * itemsize, (last + 1) * itemsize
