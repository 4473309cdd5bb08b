"""Sharding rules, one module per op family; importing this package registers them all."""

from . import (  # noqa: F401  (each module registers its rules on import)
    attention,
    conv,
    creation,
    embedding,
    loss,
    matmul,
    norm,
    pointwise,
    pool,
    random_ops,
    reduction,
    softmax,
    view,
)
from ._registry import (
    OpInfo,
    OpStrategy,
    Rule,
    default_localize,
    op_info,
    registered,
    rule_for,
    sharding_rule,
    strategies_for,
)

__all__ = [
    "OpInfo",
    "OpStrategy",
    "Rule",
    "default_localize",
    "op_info",
    "registered",
    "rule_for",
    "sharding_rule",
    "strategies_for",
]
