"""Sharding rules, one module per op family; importing this package registers them all."""

from . import matmul  # noqa: F401  (registers on import)
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
