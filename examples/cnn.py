"""A small CNN classifier step: two Conv2d/BatchNorm2d blocks, pooling, a Linear head.

BatchNorm2d brings buffers (``running_mean``, ``running_var``, ``num_batches_tracked``) that a
training step updates in place; SGD with momentum brings per-parameter optimizer state. Run it
directly (``python examples/cnn.py``) to take a few eager steps.
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

__all__ = ["CNN", "CNNConfig", "build"]

logger = logging.getLogger(__name__)

_LR = {"sgd": 0.05, "adamw": 1e-2}


@dataclass(frozen=True, slots=True, kw_only=True)
class CNNConfig:
    """Sizes of the CNN and its batches (square images)."""

    in_channels: int = 3
    image_size: int = 16
    channels: tuple[int, int] = (8, 16)
    n_classes: int = 10
    batch_size: int = 8

    def __post_init__(self) -> None:
        if self.image_size % 2:
            raise ValueError(
                f"CNNConfig.image_size must be even (one 2x2 max-pool), got {self.image_size}"
            )
        if min(self.in_channels, *self.channels, self.n_classes, self.batch_size) <= 0:
            raise ValueError(f"CNNConfig sizes must be positive: {self}")


class CNN(nn.Module):
    """Conv-BN-SiLU, max-pool, Conv-BN-ReLU, global average pool, Linear."""

    def __init__(self, cfg: CNNConfig) -> None:
        super().__init__()
        c1, c2 = cfg.channels
        self.features = nn.Sequential(
            nn.Conv2d(cfg.in_channels, c1, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c1),
            nn.SiLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(c2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(c2, cfg.n_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def build(
    optimizer: OptimizerName = "sgd",
    foreach: bool = False,
    clip: float | None = None,
    seed: int = 0,
    config: CNNConfig = CNNConfig(),
) -> Example:
    """A freshly initialised CNN (train mode), its optimizer, train step and batches.

    SGD uses momentum 0.9 and weight decay 1e-4. The global RNG is left untouched.
    """
    with seeded(seed):
        model = CNN(config)
    opt = make_optimizer(
        model.parameters(), optimizer, foreach=foreach, lrs=_LR,
        momentum=0.9 if optimizer == "sgd" else 0.0, weight_decay=1e-4,
    )

    def step(x: Tensor, y: Tensor) -> Tensor:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        opt.step()
        opt.zero_grad()
        return loss

    def batch(i: int) -> tuple[Tensor, Tensor]:
        g = batch_generator(seed, i)
        shape = (config.batch_size, config.in_channels, config.image_size, config.image_size)
        x = torch.randn(shape, generator=g, device="cpu")
        y = torch.randint(0, config.n_classes, (config.batch_size,), generator=g, device="cpu")
        return x, y

    return Example(model=model, opt=opt, step=step, batch=batch)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ex = build()
    for i in range(5):
        logger.info("step %d: loss %.4f", i, ex.step(*ex.batch(i)).item())
