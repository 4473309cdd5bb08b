"""``meshplan.trace`` rejects steps it cannot capture with a ``TraceError`` aimed at user code.

Every case asserts: the error is a ``meshplan.TraceError``; its message names this file; where
the offending line is known (data-dependent control flow, ``.item()``) it names
``test_trace_errors.py:LINE``; and it says how to fix the step (a verb such as "use", "remove",
"register", "return"). Line numbers come from ``# mark: NAME`` comments, never hard-coded
numbers. Other wording is free, so the assertions check meaning, not phrasing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import meshplan

logger = logging.getLogger(__name__)

_FILE = Path(__file__).name
_FIX = re.compile(
    r"\b(use|remove|register|return|call|pass|move|replace|wrap|set|make|compute|keep|detach|add)\b"
)


def _line_of(marker: str) -> int:
    """The number of the one line of this file that ends with ``# mark: <marker>``."""
    tag = "# mark: " + marker
    lines = Path(__file__).read_text().splitlines()
    hits = [n for n, line in enumerate(lines, start=1) if line.rstrip().endswith(tag)]
    assert len(hits) == 1, f"marker {tag!r} found on lines {hits}"
    return hits[0]


def _trace_error(step: Callable[..., Any], *args: Tensor) -> str:
    with pytest.raises(meshplan.TraceError) as info:
        meshplan.trace(step, *args)
    message = str(info.value)
    assert _FILE in message, f"message does not name the user's file {_FILE}:\n{message}"
    assert _FIX.search(message.lower()), f"message does not say how to fix the step:\n{message}"
    return message


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


class _Gated(nn.Module):
    """A forward with Python control flow on a tensor value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # mark: forward-branch
            h = h * 2
        return h


def test_control_flow_on_tensor_in_forward() -> None:
    model = _Gated()
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    message = _trace_error(step, *_data())
    assert f"{_FILE}:{_line_of('forward-branch')}" in message, message


def test_control_flow_on_loss_in_step() -> None:
    model = nn.Linear(4, 2)
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        if loss > 1:  # mark: step-branch
            loss = loss * 0.5
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    message = _trace_error(step, *_data())
    assert f"{_FILE}:{_line_of('step-branch')}" in message, message


def test_item_read_inside_step() -> None:
    model = nn.Linear(4, 2)
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        logger.info("loss %.4f", loss.item())  # mark: item
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    message = _trace_error(step, *_data())
    assert f"{_FILE}:{_line_of('item')}" in message, message


class _SignSGD(torch.optim.Optimizer):
    """A custom optimizer: meshplan supports torch.optim's SGD and AdamW only."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def test_lbfgs_is_rejected() -> None:
    model = nn.Linear(4, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)

    def step(x: Tensor, y: Tensor) -> Tensor:
        def closure() -> Tensor:
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        return opt.step(closure)  # type: ignore[return-value]

    message = _trace_error(step, *_data())
    assert "LBFGS" in message, message
    supported = "SGD" in message or "AdamW" in message
    assert supported, f"message should name a supported optimizer:\n{message}"


def test_custom_optimizer_is_rejected() -> None:
    model = nn.Linear(4, 2)
    opt = _SignSGD(model.parameters())

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    message = _trace_error(step, *_data())
    assert "_SignSGD" in message, message
    assert "SGD" in message.replace("_SignSGD", "") or "AdamW" in message, message


def test_step_returning_a_python_float() -> None:
    model = nn.Linear(4, 2)
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> float:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return opt.param_groups[0]["lr"]

    message = _trace_error(step, *_data())
    assert "float" in message and "tensor" in message.lower(), message


def test_frozen_parameter_in_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].bias.requires_grad_(False)
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    message = _trace_error(step, *_data())
    assert "requires_grad" in message and "0.bias" in message, message


def test_step_without_optimizer_step() -> None:
    model = nn.Linear(4, 2)
    opt = _sgd(model)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.zero_grad()  # forgot opt.step()
        return loss

    message = _trace_error(step, *_data())
    assert "optimizer" in message.lower() and re.search(r"\bstep\(\)", message), message


def test_step_without_model_or_optimizer() -> None:
    def step(x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(x[:, :2] * 2, y)

    message = _trace_error(step, *_data())
    assert "optimizer" in message.lower(), message
