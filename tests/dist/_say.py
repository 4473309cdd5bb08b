"""A worker plugin for the live-debugging tests (``MESHPLAN_WORKER_PLUGINS``): ``say`` makes
the rank write lines to its stdout and stderr, as a rank's warnings and prints do."""

from __future__ import annotations

import sys

from meshplan.runtime._worker import register


@register("say")
def _say(state, header, tensors):
    print("the same line on every rank")
    print(f"a line of rank {state.rank} alone")
    if state.rank % 2:
        print("a line of the odd ranks")
    print("a warning on every rank", file=sys.stderr)
    print("the same line on every rank")        # again: a second group
    sys.stdout.flush()
    return {}, []
