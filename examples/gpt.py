"""A tiny nanoGPT-style language model and its training step.

Token + position embeddings, ``n_layer`` pre-norm blocks (LayerNorm or RMSNorm; causal
self-attention through ``F.scaled_dot_product_attention(is_causal=True)``; an MLP with GELU or
SiLU), dropout modules with ``p=0.0``, a final norm and an ``lm_head`` whose weight IS the token
embedding weight (tied). Loss: cross-entropy on next-token targets.

The module-level ``model``, ``opt``, ``train_step`` and ``example_inputs`` (the defaults) let
``meshplan trace examples/gpt.py:train_step`` find the step and its inputs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from ._common import (
        Example, OptimizerName, batch_generator, decay_groups, make_optimizer, seeded,
    )
except ImportError:  # loaded as a plain file: its folder is on sys.path
    from _common import (
        Example, OptimizerName, batch_generator, decay_groups, make_optimizer, seeded,
    )

__all__ = ["GPT", "GPTConfig", "build", "example_inputs", "model", "opt", "train_step"]

logger = logging.getLogger(__name__)

_LR = {"sgd": 0.1, "adamw": 3e-3}


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTConfig:
    """Model and batch sizes; ``norm`` and ``activation`` pick the block's variants."""

    vocab_size: int = 64
    seq_len: int = 16
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 32
    batch_size: int = 4
    dropout: float = 0.0
    norm: Literal["layer", "rms"] = "layer"
    activation: Literal["gelu", "silu", "swiglu"] = "gelu"

    def __post_init__(self) -> None:
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"GPTConfig.norm must be 'layer' or 'rms', got {self.norm!r}")
        if self.activation not in ("gelu", "silu", "swiglu"):
            raise ValueError(f"GPTConfig.activation must be 'gelu', 'silu' or 'swiglu', got "
                             f"{self.activation!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


def _norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model) if cfg.norm == "layer" else nn.RMSNorm(cfg.d_model)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """d_model -> 4 d_model -> d_model with GELU or SiLU; with SwiGLU (Llama's MLP) the
    hidden layer is ``silu(c_fc(x)) * c_up(x)`` (bias-free projections)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        swiglu = cfg.activation == "swiglu"
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=not swiglu)
        self.c_up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False) if swiglu else None
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.SiLU()
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=not swiglu)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.c_fc(x))
        if self.c_up is not None:
            h = h * self.c_up(x)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = _norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = _norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``; ``lm_head`` tied to ``wte``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(cfg.vocab_size, cfg.d_model),
                "wpe": nn.Embedding(cfg.seq_len, cfg.d_model),
                "drop": nn.Dropout(cfg.dropout),
                "h": nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                "ln_f": _norm(cfg),
            }
        )
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # weight tying: one Parameter
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        tr = self.transformer
        x = tr["drop"](tr["wte"](idx) + tr["wpe"](pos))
        for block in tr["h"]:
            x = block(x)
        return self.lm_head(tr["ln_f"](x))


def build(
    optimizer: OptimizerName = "adamw",
    foreach: bool = False,
    clip: float | None = 1.0,
    seed: int = 0,
    config: GPTConfig = GPTConfig(),
) -> Example:
    """A freshly initialised GPT (train mode), its optimizer, train step and batches.

    The optimizer has two parameter groups (weight decay 0.1 on matrices, 0 elsewhere).
    ``batch(i)`` is ``(x, y)`` with ``y`` the next-token targets of one random token stream.
    """
    with seeded(seed):
        model = GPT(config)
    opt = make_optimizer(decay_groups(model, 0.1), optimizer, foreach=foreach, lrs=_LR)

    def step(x: Tensor, y: Tensor) -> Tensor:
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def batch(i: int) -> tuple[Tensor, Tensor]:
        shape = (config.batch_size, config.seq_len + 1)
        g = batch_generator(seed, i)
        tokens = torch.randint(0, config.vocab_size, shape, generator=g, device="cpu")
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Example(model=model, opt=opt, step=step, batch=batch)


_default = build()
model: GPT = _default.model  # type: ignore[assignment]
opt: torch.optim.Optimizer = _default.opt
train_step = _default.step
example_inputs: tuple[Tensor, Tensor] = _default.batch(0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for i in range(5):
        logger.info("step %d: loss %.4f", i, train_step(*_default.batch(i)).item())
