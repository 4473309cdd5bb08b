"""Traces shared by several unit-test files (suite time: a GPT trace costs seconds of CPU).

Test files import this module by name (``sys.path`` gets this folder, as the e2e and dist tests
do for their shared helpers), so it is imported once per session and its caches hold for every
file. What it hands out is read-only by contract: the graphs are frozen, and a caller must not
step the example's model or optimizer nor call the traced step (tests that mutate build their
own copy).
"""

from __future__ import annotations

from functools import lru_cache

import meshplan
from meshplan.examples import gpt
from meshplan.examples._common import Example


@lru_cache(maxsize=None)
def default_gpt() -> tuple[Example, meshplan.TracedStep]:
    """``gpt.build()`` (tied weights, AdamW in two param groups, gradient clipping at 1.0, not
    foreach) traced before its first step at ``batch(0)``, with its first-step graph traced
    too, now: that graph is traced lazily from the example's state at the time of the first
    request, and the example must stay as built."""
    ex = gpt.build()
    traced = meshplan.trace(ex.step, *ex.batch(0))
    assert traced.first_step_graph is not None
    return ex, traced
