"""meshplan's intermediate representation: a pure dataflow graph of aten ops.

Small closed set of node kinds, frozen typed metadata, a verifier, versioned JSON, a reference
interpreter (the oracle for every distributed run) and a networkx view. Imports nothing of
meshplan's but the shared error hierarchy.
"""

from .._errors import IRError
from ._foreach import split_foreach
from ._graph import ConstantValue, Graph, GraphInfo, Node, Output, ResultSpec
from ._interpret import interpret, last_uses
from ._ops import node_bytes, node_flops, op_name, resolve_op
from ._passes import (
    eliminate_dead_code,
    hoist_casts,
    merge_host_scalars,
    remove_identity_ops,
    run_passes,
    substitute,
)
from ._recompute import POLICIES as RECOMPUTE_POLICIES
from ._recompute import layers as repeated_layers
from ._recompute import recompute
from ._random import RANDOM_SEMANTICS, is_random, random_nodes, takes_generator
from ._serialize import FORMAT, VERSION, atomic_write_text
from ._summary import GraphSummary, summarize
from ._types import (
    STATE_ROLES,
    NodeKind,
    OutputKind,
    Phase,
    Ref,
    Role,
    ScalarMeta,
    SourceLocation,
    TensorMeta,
)
from ._verify import verify

__all__ = [
    "FORMAT",
    "STATE_ROLES",
    "RANDOM_SEMANTICS",
    "RECOMPUTE_POLICIES",
    "VERSION",
    "ConstantValue",
    "Graph",
    "GraphInfo",
    "GraphSummary",
    "IRError",
    "Node",
    "NodeKind",
    "Output",
    "OutputKind",
    "Phase",
    "Ref",
    "ResultSpec",
    "Role",
    "ScalarMeta",
    "SourceLocation",
    "TensorMeta",
    "atomic_write_text",
    "eliminate_dead_code",
    "hoist_casts",
    "merge_host_scalars",
    "interpret",
    "is_random",
    "last_uses",
    "node_bytes",
    "node_flops",
    "op_name",
    "random_nodes",
    "recompute",
    "remove_identity_ops",
    "repeated_layers",
    "resolve_op",
    "run_passes",
    "split_foreach",
    "substitute",
    "summarize",
    "takes_generator",
    "verify",
]
