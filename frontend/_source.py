"""Finding the user's line: the innermost stack frame that is neither torch nor meshplan."""

from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import types
from typing import Iterator

import torch

from ..ir import SourceLocation

_MESHPLAN_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = tuple(
    os.path.join(p, "")
    for p in (
        os.path.dirname(os.path.abspath(torch.__file__)),
        sysconfig.get_paths()["stdlib"],
        *(os.path.join(_MESHPLAN_ROOT, d) for d in (
            "frontend", "ir", "planner", "backends", "kernels", "runtime", "telemetry",
        )),
    )
)


def is_user_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    return not os.path.abspath(filename).startswith(_INTERNAL)


def location(filename: str, line: int, function: str) -> SourceLocation:
    code = linecache.getline(filename, line).strip()
    return SourceLocation(filename, line, function, code)


def user_frame(frame: types.FrameType | None) -> SourceLocation | None:
    """The innermost user frame at or above ``frame``."""
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            return location(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    return None


def current_user_location() -> SourceLocation | None:
    return user_frame(sys._getframe(1))


def _tb_frames(tb: types.TracebackType | None) -> Iterator[tuple[str, int, str]]:
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name
        tb = tb.tb_next


def exception_user_location(exc: BaseException) -> SourceLocation | None:
    """The innermost user frame in an exception's traceback (chained causes included)."""
    best = None
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        for filename, line, fn in _tb_frames(e.__traceback__):
            if is_user_file(filename):
                best = location(filename, line, fn)
        e = e.__cause__ or e.__context__
    return best


def describe(loc: SourceLocation | None) -> str:
    """``  at file:line in fn:   code`` (one line), or a note that the place is unknown."""
    if loc is None:
        return "  at an unknown place in the step"
    code = f":   {loc.code}" if loc.code else ""
    return f"  at {loc}{code}"
