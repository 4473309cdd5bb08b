"""Checkpoints: a step's whole state in one safetensors file, read back piece by piece.

Format: one ``.safetensors`` file. Its tensors are the step's state (parameters, buffers,
gradients, optimizer state), whole, named as the plan's graph inputs (``model.fc1.weight``,
``opt.state.model.fc1.weight.exp_avg``, ...). The header's metadata holds one key, ``meshplan``,
a JSON object: ``format`` (``"meshplan-checkpoint"``), ``version`` (1), ``roles`` (name ->
``param``/``buffer``/``grad``/``opt_state``), ``saved_from`` (the saving plan's mesh and
strategy: provenance only), ``torch`` and ``created`` (UTC, ISO 8601).

Whole tensors make a checkpoint independent of the mesh: one saved on ``dp=2`` loads on
``tp=2``. Loading does not need the whole file in one process: a rank reads only its own pieces
(``read_pieces``: safetensors slices the file, so a shard costs its own bytes). Writing is
atomic: a temporary file beside the target, fsynced, then ``os.replace`` and an fsync of the
folder; a failed save leaves the former file as it was and no temporary behind.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from .._errors import RuntimeFailure

__all__ = ["CheckpointInfo", "read_info", "read_pieces", "read_whole", "save_checkpoint"]

FORMAT = "meshplan-checkpoint"
VERSION = 1
_META_KEY = "meshplan"
# safetensors' dtype names -> torch's
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
           "BOOL": "bool"}


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint file holds, read from its header alone."""

    path: str
    specs: dict[str, tuple[tuple[int, ...], str]]     # name -> (shape, torch dtype name)
    roles: dict[str, str]
    meta: dict[str, Any]


def save_checkpoint(path: str | os.PathLike, values: Mapping[str, torch.Tensor],
                    roles: Mapping[str, str], saved_from: Mapping[str, Any]) -> str:
    """Write ``values`` (whole tensors by input name) to ``path`` atomically; returns the
    absolute path."""
    from safetensors.torch import save_file

    target = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise RuntimeFailure(f"save_checkpoint: folder {folder} does not exist; create it first")
    if os.path.isdir(target):
        raise RuntimeFailure(f"save_checkpoint: {target} is a folder; pass a file path such as "
                             f"{os.path.join(target, 'step.safetensors')}")
    meta = {"format": FORMAT, "version": VERSION, "roles": {k: roles[k] for k in values},
            "saved_from": dict(saved_from), "torch": torch.__version__,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    # safetensors refuses views of one storage and non-contiguous tensors: own copies
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in values.items()}
    tmp = os.path.join(folder, f".{os.path.basename(target)}.tmp-{secrets.token_hex(4)}")
    try:
        save_file(tensors, tmp, metadata={_META_KEY: json.dumps(meta, sort_keys=True)})
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
    """The header of the checkpoint at ``path``; one clear RuntimeFailure if it is none."""
    from safetensors import safe_open

    where = os.path.abspath(os.fspath(path))
    if not os.path.isfile(where):
        raise RuntimeFailure(f"load_checkpoint: {where} does not exist (or is not a file); pass "
                             "a file written by save_checkpoint")
    try:
        with safe_open(where, framework="pt") as f:
            raw = (f.metadata() or {}).get(_META_KEY)
            specs = {}
            for name in f.keys():
                sl = f.get_slice(name)
                specs[name] = (tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype(),
                                                                  sl.get_dtype()))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise RuntimeFailure(f"load_checkpoint: {where} is not a safetensors file ({exc}); "
                             "pass a file written by save_checkpoint") from None
    try:
        meta = json.loads(raw) if raw is not None else None
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RuntimeFailure(f"load_checkpoint: {where} is a safetensors file but not a meshplan "
                             "checkpoint (no 'meshplan' metadata); pass a file written by "
                             "save_checkpoint, or load plain weights with load_state_dict")
    if meta.get("version") != VERSION:
        raise RuntimeFailure(f"load_checkpoint: {where} is checkpoint version "
                             f"{meta.get('version')!r}; this meshplan reads version {VERSION}")
    return CheckpointInfo(where, specs, dict(meta.get("roles", {})), meta)


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
    from safetensors.torch import load_file

    return load_file(path)


def read_pieces(path: str, names: Sequence[str], slices: Mapping[str, tuple[slice, ...]]
                ) -> dict[str, torch.Tensor]:
    """``names`` read from ``path``, each only its ``slices`` (a rank's piece)."""
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="pt") as f:
        for name in names:
            index = slices[name]
            t = f.get_slice(name)[index] if index else f.get_tensor(name)
            out[name] = t.contiguous()
    return out
