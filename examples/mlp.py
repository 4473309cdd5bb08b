"""A small MLP regression step: Linear -> GELU -> LayerNorm -> Linear, mean-squared error.

The targets come from a fixed random "teacher" (``sin(x @ W)``), so the loss falls as the model
learns. Run it directly (``python examples/mlp.py``) to take a few eager steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from ._common import Example, OptimizerName, batch_generator, make_optimizer, seeded
except ImportError:  # loaded as a plain file: its folder is on sys.path
    from _common import Example, OptimizerName, batch_generator, make_optimizer, seeded

__all__ = ["MLP", "MLPConfig", "build"]

logger = logging.getLogger(__name__)

_LR = {"sgd": 0.1, "adamw": 1e-2}
_TEACHER_SEED = 12345


@dataclass(frozen=True, slots=True, kw_only=True)
class MLPConfig:
    """Sizes of the MLP and its batches."""

    d_in: int = 16
    d_hidden: int = 64
    d_out: int = 4
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("d_in", "d_hidden", "d_out", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLPConfig.{name} must be positive, got {getattr(self, name)}")


class MLP(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_in, cfg.d_hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(cfg.d_hidden)
        self.fc2 = nn.Linear(cfg.d_hidden, cfg.d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.norm(self.act(self.fc1(x))))


def build(
    optimizer: OptimizerName = "sgd",
    foreach: bool = False,
    clip: float | None = None,
    seed: int = 0,
    config: MLPConfig = MLPConfig(),
) -> Example:
    """A freshly initialised MLP, its optimizer, its train step and its batches.

    Parameters are created under the ambient device context, so building inside
    ``with torch.device("meta"):`` gives a meta model. The global RNG is left untouched.
    """
    with seeded(seed):
        model = MLP(config)
    opt = make_optimizer(model.parameters(), optimizer, foreach=foreach, lrs=_LR)

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        opt.step()
        opt.zero_grad()
        return loss

    def batch(i: int) -> tuple[Tensor, Tensor]:
        teacher = torch.randn(
            config.d_in, config.d_out, generator=batch_generator(_TEACHER_SEED, 0), device="cpu"
        )
        g = batch_generator(seed, i)
        x = torch.randn(config.batch_size, config.d_in, generator=g, device="cpu")
        return x, torch.sin(x @ teacher)

    return Example(model=model, opt=opt, step=step, batch=batch)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ex = build("adamw", clip=1.0)
    for i in range(5):
        logger.info("step %d: loss %.4f", i, ex.step(*ex.batch(i)).item())
