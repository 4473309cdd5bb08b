"""Example training steps: ordinary single-process PyTorch programs that meshplan traces.

Each module (``mlp``, ``gpt``, ``cnn``) has a ``build(...)`` function returning an
:class:`~._common.Example` (model, optimizer, step function, deterministic batches). The model
code imports nothing from meshplan; the tests replay these steps through the tracer and demand
bit-equality with eager PyTorch. ``rl_grpo`` is a whole RL program instead: a generator and a
trainer step, each distributed on its own mesh, and the weight sync between them
(``meshplan.transfer``).
"""

__all__: list[str] = []
