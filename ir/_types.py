"""Typed metadata of the IR: enums, tensor and scalar metadata, source locations, references."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from .._errors import IRError


class NodeKind(enum.Enum):
    """The closed set of node kinds."""

    INPUT = "input"        # a graph input: parameter, buffer, optimizer state, gradient or data
    CONSTANT = "constant"  # a tensor baked into the graph at trace time
    OP = "op"              # one aten operator applied to values
    HOST = "host"          # Python scalar arithmetic (operator.*, math.*) done on the host


class Role(enum.Enum):
    """What a tensor value is to the training step."""

    PARAM = "param"
    GRAD = "grad"
    OPT_STATE = "opt_state"
    BUFFER = "buffer"
    DATA = "data"
    HYPER = "hyper"        # an optimizer hyperparameter (0-d float64), fed at every call
    ACTIVATION = "activation"
    CONSTANT = "constant"


class Phase(enum.Enum):
    """Which part of the training step produced a node."""

    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"      # after backward: gradient clipping and the optimizer step


class OutputKind(enum.Enum):
    RESULT = "result"      # a value the step function returns to its caller
    STATE = "state"        # the new value of a stateful input (parameter, buffer, opt state, grad)


STATE_ROLES = frozenset({Role.PARAM, Role.GRAD, Role.OPT_STATE, Role.BUFFER})

# dtype names the IR knows, mapped to the element size in bytes.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex64": 8, "complex128": 16,
}
SCALAR_TYPES = ("float", "int", "bool")


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape, dtype and role of one tensor value. ``dim`` always means a tensor dimension."""

    shape: tuple[int, ...]
    dtype: str
    role: Role = Role.ACTIVATION

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise IRError(f"unknown dtype {self.dtype!r}; the IR knows {sorted(DTYPE_BYTES)}")
        if any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise IRError(f"tensor shape must be non-negative ints, got {self.shape!r}")
        if not isinstance(self.role, Role):
            raise IRError(f"role must be a Role, got {self.role!r}")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def with_role(self, role: Role) -> TensorMeta:
        return TensorMeta(self.shape, self.dtype, role)


@dataclass(frozen=True, slots=True)
class ScalarMeta:
    """A Python scalar living on the host (a step counter read with ``.item()``, a bias correction)."""

    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in SCALAR_TYPES:
            raise IRError(f"scalar dtype must be one of {SCALAR_TYPES}, got {self.dtype!r}")


ValueMeta = Union[TensorMeta, ScalarMeta, None]


@dataclass(frozen=True, slots=True)
class SourceLocation:
    """Where in the user's code a node came from."""

    file: str
    line: int
    function: str = ""
    code: str = ""

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}"
        return f"{where} in {self.function}" if self.function else where


@dataclass(frozen=True, slots=True)
class Ref:
    """A reference to output ``index`` of node ``node`` (nodes may have several outputs)."""

    node: str
    index: int = 0

    @property
    def label(self) -> str:
        """``node`` or ``node[i]``: how plans, reports and telemetry name the value."""
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"

    @staticmethod
    def parse(label: str) -> Ref:
        """The inverse of ``label``."""
        name, _, rest = label.partition("[")
        return Ref(name, int(rest.rstrip("]")) if rest else 0)

    def __str__(self) -> str:
        return f"%{self.label}"
