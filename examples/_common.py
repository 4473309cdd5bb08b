"""Shared pieces of the example training steps: the ``Example`` record, optimizers, seeding."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = ["Example", "OptimizerName", "batch_generator", "decay_groups", "make_optimizer",
           "seeded"]

OptimizerName = Literal["sgd", "adamw"]


@dataclass(frozen=True, slots=True)
class Example:
    """A ready-to-run training example.

    ``step(*batch(i))`` runs one training step (forward, loss, backward, optional gradient
    clipping, ``opt.step()``, ``opt.zero_grad()``) and returns the loss. ``batch(i)`` builds the
    CPU tensors of step ``i``; it does not touch the global RNG and ignores any
    ``torch.device(...)`` context, so two calls with the same ``i`` give equal tensors.
    """

    model: nn.Module
    opt: torch.optim.Optimizer
    step: Callable[..., Tensor]
    batch: Callable[[int], tuple[Tensor, ...]]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU RNG seeded to ``seed``; restore the caller's RNG afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def batch_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for batch ``index`` of an example built with ``seed``."""
    if index < 0:
        raise ValueError(f"batch index must be >= 0, got {index}")
    return torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + index)


def make_optimizer(
    params: Iterable[Tensor] | Iterable[dict[str, Any]],
    name: OptimizerName,
    *,
    foreach: bool,
    lrs: Mapping[str, float],
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """``torch.optim.SGD`` or ``torch.optim.AdamW`` with an explicit ``foreach`` choice.

    ``lrs`` maps each optimizer name to the example's learning rate for it.
    """
    if name not in lrs:
        raise ValueError(f"unknown optimizer {name!r}; use one of {sorted(lrs)}")
    lr = lrs[name]
    if name == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=foreach
        )
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=foreach)
    raise ValueError(f"unknown optimizer {name!r}; use 'sgd' or 'adamw'")


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """nanoGPT's parameter groups: weight decay on matrices and embeddings, none on biases and
    norm weights. ``model.parameters()`` lists a tied weight once."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
