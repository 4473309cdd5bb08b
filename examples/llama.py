"""A LLaMA-style language model and its training step.

Token embedding, ``n_layer`` pre-norm blocks (RMSNorm; grouped-query causal self-attention with
rotary position embeddings through ``F.scaled_dot_product_attention(is_causal=True)``; a SwiGLU
MLP), a final RMSNorm and an untied ``lm_head``; no biases. Loss: cross-entropy on next-token
targets. Optimizer: AdamW (weight decay on matrices) or SGD, gradient clipping optional.

Presets: ``tiny`` (for tests) and ``llama3_8b`` (32 layers, d 4096, 32 query / 8 key-value
heads, SwiGLU hidden 14336, vocab 128256, batch 8 x 2048). Build the large one on the meta
device (``build(config="llama3_8b", device="meta")``) to trace and plan it without memory.

The module-level ``model``, ``opt``, ``train_step`` and ``example_inputs`` (the tiny preset) let
``meshplan trace examples/llama.py:train_step`` find the step and its inputs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

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

__all__ = ["PRESETS", "Llama", "LlamaConfig", "build", "example_inputs", "model", "opt",
           "train_step"]

logger = logging.getLogger(__name__)

_LR = {"sgd": 0.1, "adamw": 3e-3}


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaConfig:
    """Model and batch sizes. ``n_kv_head`` < ``n_head`` is grouped-query attention."""

    vocab_size: int = 128
    seq_len: int = 16
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    hidden: int = 128
    batch_size: int = 2
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "n_kv_head",
                     "hidden", "batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"LlamaConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig.n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}"
            )
        if (self.d_model // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: head size {self.d_model // self.n_head} must be even "
                             "for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(),
    "llama3_8b": LlamaConfig(vocab_size=128256, seq_len=2048, n_layer=32, d_model=4096,
                             n_head=32, n_kv_head=8, hidden=14336, batch_size=8,
                             rope_theta=500000.0),
}


def _rope_tables(cfg: LlamaConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, ``(seq_len, head_dim // 2)`` each."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding on ``(batch, heads, seq, head_dim)`` with the half-split convention, in
    ``x``'s dtype (the tables are fp32 buffers; under bf16 mixed precision q and k stay bf16)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Grouped-query causal self-attention with rotary position embeddings."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = self.n_head // self.n_kv_head
        if rep > 1:   # each key-value head serves ``rep`` query heads
            k = k[:, :, None].expand(b, self.n_kv_head, rep, t, self.head_dim).reshape(
                b, self.n_head, t, self.head_dim)
            v = v[:, :, None].expand(b, self.n_kv_head, rep, t, self.head_dim).reshape(
                b, self.n_head, t, self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU MLP."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids ``(batch, seq)`` -> logits ``(batch, seq, vocab)``; ``lm_head`` is untied."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of length {t} exceeds seq_len={self.cfg.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def build(
    config: LlamaConfig | str = "tiny",
    optimizer: OptimizerName = "adamw",
    device: str | torch.device | None = None,
    foreach: bool = False,
    clip: float | None = 1.0,
    seed: int = 0,
) -> Example:
    """A freshly initialised LLaMA-style model (train mode), its optimizer, step and batches.

    ``config`` is a :class:`LlamaConfig` or a preset name (``"tiny"``, ``"llama3_8b"``).
    ``device="meta"`` builds the model without memory (it can be traced and planned, not run);
    ``None`` uses the ambient device. ``batch(i)`` is ``(x, y)`` on the CPU, ``y`` the
    next-token targets of one random token stream. The global RNG is left untouched.
    """
    cfg = PRESETS[config] if isinstance(config, str) else config
    if not isinstance(cfg, LlamaConfig):
        raise TypeError(f"config must be a LlamaConfig or one of {sorted(PRESETS)}, got {config!r}")
    where = torch.device(device) if device is not None else contextlib.nullcontext()
    with seeded(seed), where:
        model = Llama(cfg)
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
        shape = (cfg.batch_size, cfg.seq_len + 1)
        tokens = torch.randint(0, cfg.vocab_size, shape, generator=batch_generator(seed, i),
                               device="cpu")
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return Example(model=model, opt=opt, step=step, batch=batch)


_default = build()
model: Llama = _default.model  # type: ignore[assignment]
opt: torch.optim.Optimizer = _default.opt
train_step = _default.step
example_inputs: tuple[Tensor, Tensor] = _default.batch(0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for i in range(5):
        logger.info("step %d: loss %.4f", i, train_step(*_default.batch(i)).item())
