"""Reinforcement learning with two meshes in one program: a generator, a trainer, a weight sync.

A small GPT policy (``examples/gpt.py``) learns a verifiable toy task with GRPO: continue a
prompt of random tokens with tokens of a target set (the lowest quarter of the vocabulary);
the reward is the fraction of generated tokens in it (about 0.25 at the start, near 1 after
~30 steps). Every step:

1. the **generator** samples ``GROUP`` continuations of each prompt with its copy of the
   policy (``torch.no_grad()``, one token at a time; Gumbel-max sampling, whose noise is an
   input, so one process and a mesh draw the same tokens);
2. the rewards and each group's normalised advantages are computed on the controller;
3. the **trainer** takes one policy-gradient step (AdamW) on the sampled sequences;
4. the trainer's weights go to the generator: ``meshplan.transfer(trainer, generator)``,
   one-sided from the trainer's ranks to the generator's, resharded on the way.

``run()`` distributes the generator and the trainer on their own meshes and plans (by default
Megatron-style tensor parallel for the generator, FSDP for the trainer: every transfer
reshards); ``reference()`` is the same loop in one process, ``gen_policy.load_state_dict(
policy.state_dict())`` as the sync. ``python examples/rl_grpo.py`` runs both and prints them
side by side (``--launcher mpi`` joins the two meshes' MPI worlds for the transfer).
"""

from __future__ import annotations

import argparse
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

try:
    from .gpt import GPT, GPTConfig
    from ._common import seeded
except ImportError:  # loaded as a plain file: its folder is on sys.path
    from gpt import GPT, GPTConfig
    from _common import seeded

__all__ = ["CONFIG", "History", "Policy", "reference", "run"]

logger = logging.getLogger(__name__)

PROMPT, NEW, GROUP, PROMPTS = 4, 4, 4, 4     # prompt tokens, new tokens, samples per prompt
CONFIG = GPTConfig(vocab_size=16, seq_len=PROMPT + NEW, n_layer=2, n_head=2, d_model=32)
LR = 1e-2


@dataclass
class Policy:
    """The trainer's policy and optimizer, the generator's copy, and the two steps."""

    policy: GPT
    gen_policy: GPT
    opt: torch.optim.Optimizer
    generate: Callable[[Tensor, Tensor], Tensor]
    train: Callable[[Tensor, Tensor], Tensor]


def build(seed: int = 0) -> Policy:
    with seeded(seed):
        policy = GPT(CONFIG)
    gen_policy = copy.deepcopy(policy)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)

    def generate(prompts: Tensor, gumbel: Tensor) -> Tensor:
        """Sample ``NEW`` tokens after each prompt (Gumbel-max: argmax of logits + noise)."""
        seq = prompts
        with torch.no_grad():
            for t in range(NEW):
                logits = gen_policy(seq)[:, -1]
                nxt = torch.argmax(logits + gumbel[:, t], dim=-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=1)
        return seq

    def train(seq: Tensor, adv: Tensor) -> Tensor:
        """One GRPO step: raise the log-probability of the sampled tokens by their advantage
        (on-policy, one update per batch: the clipped ratio is 1 and drops out)."""
        logits = policy(seq[:, :-1])[:, PROMPT - 1:]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)
        loss = -(adv[:, None] * logp).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Policy(policy, gen_policy, opt, generate, train)


def batch(i: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Step ``i``'s prompts (each repeated ``GROUP`` times) and sampling noise."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    prompts = torch.randint(0, CONFIG.vocab_size, (PROMPTS, PROMPT), generator=g)
    u = torch.rand(PROMPTS * GROUP, NEW, CONFIG.vocab_size, generator=g).clamp_(1e-9, 1 - 1e-9)
    return prompts.repeat_interleave(GROUP, dim=0), -torch.log(-torch.log(u))


def rewards(seq: Tensor) -> Tensor:
    """The fraction of new tokens in the target set (ids below a quarter of the vocabulary)."""
    return (seq[:, PROMPT:] < CONFIG.vocab_size // 4).float().mean(dim=1)


def advantages(r: Tensor) -> Tensor:
    """GRPO: each sample's reward against its group's (mean 0, std 1 where it varies)."""
    g = r.view(PROMPTS, GROUP)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)


@dataclass
class History:
    rewards: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    samples: list[Tensor] = field(default_factory=list)
    syncs: list[Any] = field(default_factory=list)        # TransferReports (run() only)
    params: dict[str, Tensor] = field(default_factory=dict)


def _loop(p: Policy, generate: Callable, train: Callable, sync: Callable[[], Any],
          steps: int, seed: int) -> History:
    h = History()
    for i in range(steps):
        prompts, gumbel = batch(i, seed)
        seq = generate(prompts, gumbel)
        r = rewards(seq)
        loss = train(seq, advantages(r))
        h.syncs.append(sync())
        h.rewards.append(float(r.mean()))
        h.losses.append(float(loss.detach()))
        h.samples.append(seq.clone())
    return h


def reference(steps: int = 8, seed: int = 0) -> History:
    """The loop in one process."""
    p = build(seed)
    h = _loop(p, p.generate, p.train,
              lambda: p.gen_policy.load_state_dict(p.policy.state_dict()) and None, steps, seed)
    h.params = {k: v.detach().clone() for k, v in p.policy.state_dict().items()}
    return h


def run(steps: int = 8, seed: int = 0, *, launcher: str = "local",
        gen_mesh: dict[str, int] | None = None, train_mesh: dict[str, int] | None = None,
        gen_strategy: str = "megatron_tp", train_strategy: str = "fsdp",
        method: str | None = None, telemetry: Any = False) -> History:
    """The loop with the generator and the trainer each on its own mesh."""
    import meshplan

    p = build(seed)
    opts = dict(launcher=launcher, telemetry=telemetry)
    generator = meshplan.distribute(p.generate, mesh=gen_mesh or {"tp": 2},
                                    strategy=gen_strategy, **opts)
    trainer = meshplan.distribute(p.train, mesh=train_mesh or {"dp": 2},
                                  strategy=train_strategy, **opts)
    try:
        h = _loop(p, generator, trainer,
                  lambda: meshplan.transfer(trainer, generator, method=method), steps, seed)
        h.params = {k: v.detach().clone() for k, v in trainer.state_dict()["model"].items()}
    finally:
        generator.shutdown()
        trainer.shutdown()
    return h


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--launcher", default="local", choices=("local", "mpi"))
    ap.add_argument("--gen-strategy", default="megatron_tp")
    ap.add_argument("--train-strategy", default="fsdp")
    args = ap.parse_args(argv)
    one = reference(args.steps)
    mesh = run(args.steps, launcher=args.launcher, gen_strategy=args.gen_strategy,
               train_strategy=args.train_strategy)
    print(f"{'step':>4}  {'reward (1 process)':>18}  {'reward (meshes)':>15}  "
          f"{'loss (1 process)':>16}  {'loss (meshes)':>13}  same samples")
    for i in range(args.steps):
        same = torch.equal(one.samples[i], mesh.samples[i])
        print(f"{i:>4}  {one.rewards[i]:>18.4f}  {mesh.rewards[i]:>15.4f}  "
              f"{one.losses[i]:>16.6f}  {mesh.losses[i]:>13.6f}  {same}")
    print(mesh.syncs[-1])
    worst = max((one.params[k] - mesh.params[k]).abs().max().item() for k in one.params)
    print(f"largest parameter difference after {args.steps} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
