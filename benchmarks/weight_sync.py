"""Weight sync between two meshes (issue 25, point 1): ``meshplan.transfer`` next to the
controller path a user writes without it, ``generator.load_state_dict(trainer.state_dict())``.

    python benchmarks/weight_sync.py [--d-model 1024] [--layers 8] [--vocab 8192]
                                     [--rounds 3] [--launchers local,mpi]

A GPT (``examples/gpt.py``; d_model 1024, 8 layers, vocab 8192: 109 M parameters, 436 MB in
float32) is trained by an FSDP trainer on 2 ranks (AdamW) and served by a generator on 2
other ranks with Megatron's tensor parallel split (inference only): every sync reshards
row shards into column and row splits. Each round times, on the controller:

- ``transfer``: ``meshplan.transfer(trainer, generator)``, by ``shm`` under the local
  launcher and by ``rma`` under mpi (the two mpiexec worlds joined once, before the rounds);
- ``state_dict``: ``generator.load_state_dict({"model": trainer.state_dict()["model"],
  "optim": {}})``: every rank's pieces gathered into this process (the trainer's optimizer
  state too: ``state_dict()`` returns it), then each generator rank sent its pieces;
- ``controller``: ``meshplan.transfer(trainer, generator, method="controller")``, the same
  path with the model's tensors only (what a careful user's own gather would move);
- ``tcp``: ``meshplan.transfer(trainer, generator, method="tcp")``, the path ranks on other
  hosts without MPI take (slurm, k8s): each generator rank reads its regions from the trainer
  ranks over TCP, here on loopback.

After the rounds the generator's weights are checked against the trainer's (bit for bit).
Printed per launcher: the median seconds of each, the bytes the destination ranks read, the
bytes through the controller, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import meshplan
from meshplan.examples.gpt import GPT, GPTConfig


def _steps(cfg: GPTConfig, launcher: str):
    torch.manual_seed(0)
    policy = GPT(cfg)
    torch.manual_seed(1)
    gen_policy = GPT(cfg)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)

    def train(x, y):
        logits = policy(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def generate(x):
        with torch.no_grad():
            return gen_policy(x)[:, -1].argmax(-1)

    opts = dict(launcher=launcher, telemetry=False, timeout_s=600)
    trainer = meshplan.distribute(train, mesh={"dp": 2}, strategy="fsdp", **opts)
    generator = meshplan.distribute(generate, mesh={"tp": 2}, strategy="megatron_tp", **opts)
    return trainer, generator


def measure(launcher: str, cfg: GPTConfig, rounds: int) -> dict:
    trainer, generator = _steps(cfg, launcher)
    x = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    try:
        trainer(x, x)
        trainer(x, x)
        generator(x)
        first = meshplan.transfer(trainer, generator)     # under mpi: joins the two worlds
        times: dict[str, list[float]] = {"transfer": [], "state_dict": [], "controller": [],
                                         "tcp": []}
        report = first
        for _ in range(rounds):
            t0 = time.perf_counter()
            report = meshplan.transfer(trainer, generator)
            times["transfer"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            generator.load_state_dict({"model": trainer.state_dict()["model"], "optim": {}})
            times["state_dict"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            via = meshplan.transfer(trainer, generator, method="controller")
            times["controller"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            meshplan.transfer(trainer, generator, method="tcp")
            times["tcp"].append(time.perf_counter() - t0)
        meshplan.transfer(trainer, generator)
        want, got = trainer.state_dict()["model"], generator.state_dict()["model"]
        assert all(torch.equal(want[k], got[k]) for k in want), "the weights differ"
        model_bytes = sum(v.nbytes for k, v in want.items() if k != "lm_head.weight")
        state_bytes = sum(v.nbytes for v in trainer._named_state().values())
    finally:
        trainer.shutdown()
        generator.shutdown()
    return {"launcher": launcher, "method": report.method, "first_s": first.seconds,
            "transfer_s": statistics.median(times["transfer"]),
            "state_dict_s": statistics.median(times["state_dict"]),
            "controller_s": statistics.median(times["controller"]),
            "tcp_s": statistics.median(times["tcp"]),
            "controller_path_bytes": via.controller_bytes,
            "read_bytes": report.nbytes, "model_bytes": model_bytes,
            "controller_bytes": state_bytes + model_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launchers", default="local,mpi")
    args = ap.parse_args()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=16, n_layer=args.layers,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    mib = 2 ** 20
    for launcher in args.launchers.split(","):
        r = measure(launcher, cfg, args.rounds)
        print(f"{r['launcher']:>6}: transfer ({r['method']}) {r['transfer_s']:.3f} s "
              f"(first {r['first_s']:.3f} s), destination ranks read "
              f"{r['read_bytes'] / mib:.0f} MiB, 0 MiB through the controller | "
              f"state_dict + load_state_dict {r['state_dict_s']:.3f} s, "
              f"{r['controller_bytes'] / mib:.0f} MiB through the controller "
              f"({r['state_dict_s'] / r['transfer_s']:.1f}x) | model only through the "
              f"controller {r['controller_s']:.3f} s, {r['controller_path_bytes'] / mib:.0f} "
              f"MiB ({r['controller_s'] / r['transfer_s']:.1f}x) | tcp {r['tcp_s']:.3f} s "
              f"({r['state_dict_s'] / r['tcp_s']:.1f}x faster than state_dict)  (model "
              f"{r['model_bytes'] / mib:.0f} MiB)", flush=True)


if __name__ == "__main__":
    main()
