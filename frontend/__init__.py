"""Capturing an ordinary PyTorch training step (forward, backward, optimizer) into the IR."""

from .._errors import TraceError
from ._discover import SUPPORTED_OPTIMIZERS
from ._traced import TracedStep, trace

__all__ = ["SUPPORTED_OPTIMIZERS", "TraceError", "TracedStep", "trace"]
